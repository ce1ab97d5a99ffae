// Schedulers and thread / CPU-model control (scheduler.hpp).
#include "scheduler.hpp"

#include "arm_compute/core/CPP/ICPPKernel.h"
#include "arm_compute/core/ITensorPack.h"
#include "arm_compute/core/Window.h"
#include "arm_compute/runtime/Scheduler.h"

#include <pthread.h>
#include <sched.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstddef>
#include <memory>

#include "json.hpp"
#include "request.hpp"
#include "acl_version.hpp"
#include "timing.hpp"

using namespace arm_compute;

namespace ks
{
namespace ext
{
// ---- per-kernel records ----------------------------------------------------------------------
struct KernelStat
{
    std::string                      name;
    int                              split_dim{ -1 };
    size_t                           iterations{ 0 };
    bool                             own_split{ false }; // the kernel divides its work by thread id (split mode)
    std::vector<std::pair<long, long>> parts;     // per thread [begin, end) in iterations (split mode)
    std::vector<std::vector<double>> thread_us; // per thread, one entry per timed run (split mode)
    std::vector<double>              wall_us;   // whole schedule() call, one per timed run
};

struct Recorder
{
    bool                    active{ false };
    size_t                  seq{ 0 };
    bool                    mismatch{ false };
    std::vector<KernelStat> stats;

    void reset()
    {
        active   = false;
        seq      = 0;
        mismatch = false;
        stats.clear();
    }
    KernelStat *slot(const char *name)
    {
        if(!active)
            return nullptr;
        if(seq < stats.size())
        {
            if(stats[seq].name != name)
                mismatch = true;
            return &stats[seq++];
        }
        stats.emplace_back();
        stats.back().name = name;
        ++seq;
        return &stats.back();
    }
};
Recorder g_rec;

RecordingScheduler::RecordingScheduler(IScheduler &inner) : _inner(inner) {}

void RecordingScheduler::set_num_threads(unsigned int n) { _inner.set_num_threads(n); }

unsigned int RecordingScheduler::num_threads() const { return _inner.num_threads(); }

void RecordingScheduler::schedule(ICPPKernel *kernel, const Hints &hints)
{
    KernelStat *ks = g_rec.slot(kernel->name());
    auto        t0 = Clock::now();
    _inner.schedule(kernel, hints);
    if(ks != nullptr)
        ks->wall_us.push_back(std::chrono::duration<double, std::micro>(Clock::now() - t0).count());
}

#if KS_ACL_24
void RecordingScheduler::schedule_op(ICPPKernel *kernel, const Hints &hints, const Window &window, ITensorPack &tensors)
#else
void RecordingScheduler::schedule_op(ICPPKernel *kernel, const Hints &hints, ITensorPack &tensors)
#endif
{
    KernelStat *ks = g_rec.slot(kernel->name());
    auto        t0 = Clock::now();
#if KS_ACL_24
    _inner.schedule_op(kernel, hints, window, tensors);
#else
    _inner.schedule_op(kernel, hints, tensors);
#endif
    if(ks != nullptr)
        ks->wall_us.push_back(std::chrono::duration<double, std::micro>(Clock::now() - t0).count());
}

void RecordingScheduler::run_tagged_workloads(std::vector<Workload> &workloads, const char *tag) { _inner.run_tagged_workloads(workloads, tag); }

void RecordingScheduler::run_workloads(std::vector<Workload> &workloads) { _inner.run_tagged_workloads(workloads, nullptr); }

// ---- scheduler that splits every kernel's window by per-thread ratios --------------------------
cpu_set_t g_main_mask;
bool      g_main_mask_ok = false;
void      restore_main_affinity()
{
    if(g_main_mask_ok)
        pthread_setaffinity_np(pthread_self(), sizeof(g_main_mask), &g_main_mask);
}

SplitScheduler::SplitScheduler(unsigned n, std::vector<double> ratios, std::vector<int> pin) : _ratios(std::move(ratios)), _pin(std::move(pin))
{
    start(n);
}

SplitScheduler::~SplitScheduler() { stop(); }

void SplitScheduler::set_num_threads(unsigned int n)
{
    stop();
    start(n == 0 ? std::max(1u, std::thread::hardware_concurrency()) : n);
}

unsigned int SplitScheduler::num_threads() const { return _n; }

void SplitScheduler::schedule(ICPPKernel *kernel, const Hints &hints) { run_kernel(kernel, hints, kernel->window(), nullptr); }

#if KS_ACL_24
void SplitScheduler::schedule_op(ICPPKernel *kernel, const Hints &hints, const Window &window, ITensorPack &tensors) { run_kernel(kernel, hints, window, &tensors); }
#else
void SplitScheduler::schedule_op(ICPPKernel *kernel, const Hints &hints, ITensorPack &tensors) { run_kernel(kernel, hints, kernel->window(), &tensors); }
#endif

void SplitScheduler::run_workloads(std::vector<Workload> &workloads)
{
    const unsigned n = _n;
    parallel([&](unsigned t) {
        ThreadInfo info;
        info.thread_id   = static_cast<int>(t);
        info.num_threads = static_cast<int>(n);
        info.cpu_info    = &cpu_info();
        for(size_t i = t; i < workloads.size(); i += n)
            workloads[i](info);
    });
}

void SplitScheduler::pin_self(int cpu)
{
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(cpu, &set);
    pthread_setaffinity_np(pthread_self(), sizeof(set), &set);
}

void SplitScheduler::start(unsigned n)
{
    _n    = std::max(1u, n);
    _stop = false;
    if(!_pin.empty())
    {
        pin_self(_pin[0]);
        _caller_pinned = true;
    }
    for(unsigned t = 1; t < _n; ++t)
        _workers.emplace_back([this, t]() { worker(t); });
}

void SplitScheduler::stop()
{
    {
        std::lock_guard<std::mutex> lock(_m);
        _stop = true;
    }
    _cv_start.notify_all();
    for(auto &w : _workers)
        w.join();
    _workers.clear();
    if(_caller_pinned)
    {
        restore_main_affinity();
        _caller_pinned = false;
    }
}

void SplitScheduler::shutdown() { stop(); }

void SplitScheduler::set_ratios(const std::vector<double> &r) { _ratios = r; }

void SplitScheduler::worker(unsigned t)
{
    if(t < _pin.size())
        pin_self(_pin[t]);
    unsigned long seen = 0;
    for(;;)
    {
        std::function<void(unsigned)> job;
        {
            std::unique_lock<std::mutex> lock(_m);
            _cv_start.wait(lock, [&] { return _stop || _generation != seen; });
            if(_stop)
                return;
            seen = _generation;
            job  = _job;
        }
        try
        {
            job(t);
        }
        catch(...)
        {
            std::lock_guard<std::mutex> lock(_m);
            _error = std::current_exception();
        }
        {
            std::lock_guard<std::mutex> lock(_m);
            if(--_pending == 0)
                _cv_done.notify_one();
        }
    }
}

// Run fn(t) for t in [0, n): t = 0 on the calling thread, the others on the workers.
void SplitScheduler::parallel(const std::function<void(unsigned)> &fn)
{
    if(_n == 1)
    {
        fn(0);
        return;
    }
    {
        std::lock_guard<std::mutex> lock(_m);
        _job     = fn;
        _pending = _n - 1;
        _error   = nullptr;
        ++_generation;
    }
    _cv_start.notify_all();
    std::exception_ptr mine;
    try
    {
        fn(0);
    }
    catch(...)
    {
        mine = std::current_exception();
    }
    std::unique_lock<std::mutex> lock(_m);
    _cv_done.wait(lock, [&] { return _pending == 0; });
    if(mine)
        std::rethrow_exception(mine);
    if(_error)
        std::rethrow_exception(_error);
}

// ACL kernels that divide their work by ThreadInfo::thread_id themselves and ignore the window
// they are given (24.11: its Winograd transforms, whose window is one iteration per thread, and its
// assembly depthwise convolution and pooling). Cut by the ratios, a thread whose share rounds to
// nothing would leave its part of the output unwritten; they run on every thread with the whole
// window instead: their split is their own, whatever the ratios.
const std::vector<std::string> &kernels_splitting_by_thread_id()
{
#if KS_ACL_24
    static const std::vector<std::string> names = { "CpuWinogradConv2dTransformInputKernel", "CpuWinogradConv2dTransformOutputKernel",
                                                    "CpuDepthwiseConv2dAssemblyWrapperKernel", "CpuPool2dAssemblyWrapperKernel" };
#else
    static const std::vector<std::string> names; // 20.08's kernels run the window they are given
#endif
    return names;
}

bool splits_by_thread_id(const char *kernel_name)
{
    // the assembly wrappers name their arm_conv kernel after a '/': "CpuDepthwiseConv2dAssemblyWrapperKernel/a64_..."
    const std::string name(kernel_name);
    const std::string wrapper = name.substr(0, name.find('/'));
    for(const std::string &known : kernels_splitting_by_thread_id())
        if(known == wrapper)
            return true;
    return false;
}

void SplitScheduler::run_kernel(ICPPKernel *kernel, const Hints &hints, const Window &maxw, ITensorPack *tensors)
{
    const bool    all    = hints.split_dimension() == IScheduler::split_dimensions_all;
    size_t        dim    = hints.split_dimension();
    if(all || dim >= Coordinates::num_max_dimensions)
    {
        // 2D-splittable kernels (e.g. arm_gemm interleaved 2D): split the larger dimension.
        dim = maxw.num_iterations(Window::DimY) > maxw.num_iterations(Window::DimX) ? Window::DimY : Window::DimX;
    }
    const Window::Dimension &d     = maxw[dim];
    const long               step  = std::max(1, d.step());
    const long               iters = std::max<long>(0, (d.end() - d.start() + step - 1) / step);
    unsigned                 n     = _n;
    if(!kernel->is_parallelisable() || iters < 2)
        n = 1;
    // arm_gemm's QuantizeWrapper (the "quantized_wrapper" GEMM of an int8 conv / fc) waits on a
    // barrier for as many threads as ACL configured it for, min(window, threads) (ACL's own
    // CPPScheduler gives each of them at least one iteration): here too, or a thread whose share
    // rounds to nothing never arrives and the others wait forever.
    const bool every_thread = n > 1 && std::string(kernel->name()).find("quantized_wrapper") != std::string::npos;
    if(every_thread)
        n = static_cast<unsigned>(std::min<long>(n, iters));
    const bool own_split = tensors != nullptr && splits_by_thread_id(kernel->name());
    if(own_split)
        n = _n;

    // Part boundaries (in iterations) from the cumulative ratios.
    std::vector<long> b(n + 1, 0);
    {
        std::vector<double> r(n, 1.0);
        if(n > 1 && _ratios.size() >= n)
            for(unsigned t = 0; t < n; ++t)
                r[t] = std::max(0.0, _ratios[t]);
        double sum = 0;
        for(double x : r)
            sum += x;
        if(sum <= 0)
            std::fill(r.begin(), r.end(), 1.0), sum = n;
        double acc = 0;
        for(unsigned t = 0; t < n; ++t)
        {
            acc += r[t];
            b[t + 1] = (t + 1 == n) ? iters : std::min<long>(iters, std::lround(acc / sum * static_cast<double>(iters)));
        }
        if(every_thread) // at least one iteration per thread, the rest as the ratios say
            for(unsigned t = 0; t < n; ++t)
                b[t + 1] = std::min<long>(std::max<long>(b[t + 1], b[t] + 1), iters - static_cast<long>(n - 1 - t));
    }

    KernelStat *ks = g_rec.slot(kernel->name());
    if(ks != nullptr && ks->parts.empty())
    {
        ks->split_dim  = static_cast<int>(dim);
        ks->iterations = static_cast<size_t>(iters);
        ks->own_split  = own_split;
        for(unsigned t = 0; t < _n; ++t)
            ks->parts.emplace_back(own_split ? 0 : t < n ? b[t] : 0, own_split ? iters : t < n ? b[t + 1] : 0);
        ks->thread_us.assign(_n, {});
    }
    std::vector<double> tus(_n, 0.0);
    const unsigned      nn = n;
    auto                t0 = Clock::now();
    auto                job = [&](unsigned t) {
        if(t >= nn || (!own_split && b[t] == b[t + 1]))
            return;
        Window w = maxw;
        if(!own_split)
            w.set(dim, Window::Dimension(static_cast<int>(d.start() + b[t] * step), t + 1 == nn ? d.end() : static_cast<int>(d.start() + b[t + 1] * step), static_cast<int>(step)));
        ThreadInfo info;
        info.thread_id   = static_cast<int>(t);
        info.num_threads = static_cast<int>(nn);
        info.cpu_info    = &cpu_info();
        auto s           = Clock::now();
        if(tensors != nullptr)
            kernel->run_op(*tensors, w, info);
        else if(all)
        {
            Window loc;
            loc.set(Window::DimX, Window::Dimension(dim == Window::DimX ? static_cast<int>(t) : 0, dim == Window::DimX ? static_cast<int>(nn) : 1));
            loc.set(Window::DimY, Window::Dimension(dim == Window::DimY ? static_cast<int>(t) : 0, dim == Window::DimY ? static_cast<int>(nn) : 1));
            kernel->run_nd(w, info, loc);
        }
        else
            kernel->run(w, info);
        tus[t] = std::chrono::duration<double, std::micro>(Clock::now() - s).count();
    };
    if(nn == 1)
        job(0);
    else
        parallel(job);
    if(ks != nullptr)
    {
        ks->wall_us.push_back(std::chrono::duration<double, std::micro>(Clock::now() - t0).count());
        for(unsigned t = 0; t < _n && t < ks->thread_us.size(); ++t)
            ks->thread_us[t].push_back(tus[t]);
    }
}

IScheduler                     *g_cpp = nullptr; // ACL's own CPPScheduler instance
std::shared_ptr<IScheduler>     g_custom;
std::shared_ptr<SplitScheduler> g_split;
std::string                     g_mode = "default";
std::vector<double>             g_ratios;

void scheduler_startup()
{
    Scheduler::set(Scheduler::Type::CPP);
    g_cpp          = &Scheduler::get();
    g_main_mask_ok = pthread_getaffinity_np(pthread_self(), sizeof(g_main_mask), &g_main_mask) == 0;
}

std::vector<double> num_list(const JVal &cfg, const std::string &k)
{
    std::vector<double> out;
    const JVal         *v = cfg.get(k);
    if(v == nullptr || v->type == JVal::NUL)
        return out;
    if(v->type != JVal::ARR)
        throw BadRequest("'" + k + "' must be a list of numbers");
    for(const auto &e : v->a)
    {
        if(e.type != JVal::NUM)
            throw BadRequest("'" + k + "' must be a list of numbers");
        out.push_back(e.n);
    }
    return out;
}

// Install the scheduler the config asks for: "default" (ACL's CPPScheduler), "record" (CPPScheduler,
// each kernel timed) or "split" (own thread pool; every kernel window split by split_ratios).
void install_scheduler(const JVal &cfg, int threads)
{
    std::string mode = opt_str(cfg, "scheduler", "default");
    unsigned    n    = threads > 0 ? static_cast<unsigned>(threads) : std::max(1u, std::thread::hardware_concurrency());
    g_rec.reset();
    g_ratios.clear();
    if(g_split)
    {
        g_split->shutdown(); // its threads stop and the main thread is unpinned now, not at replacement
        g_split.reset();
    }
    if(mode == "default" || mode == "record")
    {
        Scheduler::set(Scheduler::Type::CPP);
        g_cpp->set_num_threads(n);
        g_custom.reset();
        if(mode == "record")
        {
            g_custom = std::make_shared<RecordingScheduler>(*g_cpp);
            Scheduler::set(g_custom);
        }
    }
    else if(mode == "split")
    {
        std::vector<double> r = num_list(cfg, "split_ratios");
        if(!r.empty() && r.size() != n)
            throw BadRequest("split_ratios needs one entry per thread (" + std::to_string(n) + ")");
        for(double x : r)
            if(!(x >= 0))
                throw BadRequest("split_ratios must be >= 0");
        std::vector<int> pin;
        const JVal      *p = cfg.get("pin_threads");
        if(p != nullptr && p->type == JVal::BOOL && p->b)
            for(unsigned t = 0; t < n; ++t)
                pin.push_back(static_cast<int>(t));
        else if(p != nullptr && p->type == JVal::ARR)
        {
            for(const auto &e : p->a)
                pin.push_back(static_cast<int>(as_int(e, "pin_threads")));
            if(pin.size() != n)
                throw BadRequest("pin_threads needs one cpu per thread");
        }
        Scheduler::set(Scheduler::Type::CPP);
        g_split  = std::make_shared<SplitScheduler>(n, r, pin);
        g_custom = g_split;
        Scheduler::set(g_custom);
        g_ratios = r;
    }
    else
        throw BadRequest("scheduler must be default, record or split");
    g_mode = mode;
}

// cpu models must be set on the active scheduler (functions read it at configure) and on ACL's
// CPPScheduler (it hands its own CPUInfo to the kernels at run time).
void set_cpu_model_all(unsigned cpu, CPUModel m)
{
    set_cpu_model(Scheduler::get().cpu_info(), cpu, m);
    if(g_cpp != nullptr && g_cpp != &Scheduler::get())
        set_cpu_model(g_cpp->cpu_info(), cpu, m);
}

void begin_run()
{
    g_rec.seq = 0;
}
void begin_timed_phase()
{
    g_rec.stats.clear();
    g_rec.mismatch = false;
    g_rec.active   = g_mode != "default";
}
void end_timed_phase()
{
    g_rec.active = false;
}

std::string scheduler_report()
{
    if(g_mode == "default")
        return "";
    std::string ks = "[";
    for(size_t i = 0; i < g_rec.stats.size(); ++i)
    {
        const KernelStat &k = g_rec.stats[i];
        Obj               o;
        o.str("kernel", k.name).num("median_us", median(k.wall_us)).integer("calls", static_cast<long long>(k.wall_us.size()));
        if(g_mode == "split")
        {
            std::string parts = "[", tus = "[";
            for(size_t t = 0; t < k.parts.size(); ++t)
                parts += (t ? "," : "") + std::string("[") + std::to_string(k.parts[t].first) + "," + std::to_string(k.parts[t].second) + "]";
            for(size_t t = 0; t < k.thread_us.size(); ++t)
                tus += (t ? "," : "") + jnum3(median(k.thread_us[t]));
            o.integer("split_dim", k.split_dim).integer("iterations", static_cast<long long>(k.iterations)).boolean("own_split", k.own_split).raw("parts", parts + "]").raw("thread_median_us", tus + "]");
        }
        ks += (i ? "," : "") + o.done();
    }
    ks += "]";
    std::string ratios = "[";
    for(size_t i = 0; i < g_ratios.size(); ++i)
        ratios += (i ? "," : "") + jnum(g_ratios[i]);
    ratios += "]";
    Obj o;
    o.str("mode", g_mode).raw("split_ratios", ratios).boolean("sequence_mismatch", g_rec.mismatch).raw("kernels", ks);
    return o.done();
}

void reset_kernel_records()
{
    g_rec.reset();
}
} // namespace ext

// ---------------------------------------------------------------------------------------------
// CPU model / threads
// ---------------------------------------------------------------------------------------------
CpuState g_cpu;

const std::vector<std::pair<std::string, CPUModel>> &cpu_models()
{
    static const std::vector<std::pair<std::string, CPUModel>> m = {
        { "GENERIC", CPUModel::GENERIC }, { "GENERIC_FP16", CPUModel::GENERIC_FP16 }, { "GENERIC_FP16_DOT", CPUModel::GENERIC_FP16_DOT }, { "A53", CPUModel::A53 }, { "A55R0", CPUModel::A55r0 }, { "A55R1", CPUModel::A55r1 }, { "X1", CPUModel::X1 }, { "A73", CPUModel::A73 }
    };
    return m;
}
std::string cpu_model_str(CPUModel m)
{
    for(const auto &kv : cpu_models())
        if(kv.second == m)
            return kv.first == "A55R0" ? "A55r0" : kv.first == "A55R1" ? "A55r1" : kv.first;
    return "UNKNOWN";
}
void set_cpu_model(CPUInfo &ci, unsigned cpu, CPUModel m)
{
#if KS_ACL_CPU_MODEL_HINT
    ci.set_cpu_model(cpu, m);
#else
    if(ci.get_cpu_model(cpu) != m)
        throw Unsupported("cpu_model " + cpu_model_str(m) + ": this ACL has no CPU model hint (CPUInfo::set_cpu_model is ACL 20.08's)");
#endif
}

std::string cpu_models_json()
{
    CPUInfo    &ci = Scheduler::get().cpu_info();
    std::string out = "[";
    for(unsigned i = 0; i < ci.get_cpu_num(); ++i)
        out += (i ? "," : "") + jstr(cpu_model_str(ci.get_cpu_model(i)));
    return out + "]";
}

// Apply the config's cpu_model (or restore the detected models) and thread count.
void apply_cpu_config(const JVal &cfg, int *threads_out)
{
    int threads = static_cast<int>(opt_int(cfg, "threads", 0));
    if(threads < 0)
        throw BadRequest("threads must be >= 0");
    ext::install_scheduler(cfg, threads); // first: every IScheduler has its own CPUInfo
    CPUInfo    &ci    = Scheduler::get().cpu_info();
    std::string model = upper(opt_str(cfg, "cpu_model", ""));
    if(model.empty() || model == "DETECTED")
    {
        for(unsigned i = 0; i < g_cpu.original.size() && i < ci.get_cpu_num(); ++i)
            ext::set_cpu_model_all(i, g_cpu.original[i]);
    }
    else
    {
        bool found = false;
        for(const auto &kv : cpu_models())
            if(kv.first == model)
            {
                for(unsigned i = 0; i < ci.get_cpu_num(); ++i)
                    ext::set_cpu_model_all(i, kv.second);
                found = true;
            }
        if(!found)
            throw BadRequest("unknown cpu_model '" + model + "' (GENERIC, GENERIC_FP16, GENERIC_FP16_DOT, A53, A55r0, A55r1, X1, A73)");
    }
    *threads_out = static_cast<int>(Scheduler::get().num_threads());
}
} // namespace ks
