// kselect_acl_runner: measurement runner for the Arm Compute Library (NEON backend, v20.08 API).
//
// Protocol (see ../PROTOCOL.md): one JSON request per line on stdin, one JSON result line on
// stdout per request, until EOF. A one-shot invocation is simply a single line followed by EOF.
// Tensors travel as raw little-endian float32 files in logical NCHW / OIHW / (N,K) order.
//
// Build (cross):  aarch64-linux-gnu-g++ -O2 -std=c++14 -I/usr/include/aarch64-linux-gnu
//     kselect_acl_runner.cpp -o kselect_acl_runner -L/usr/lib/aarch64-linux-gnu
//     -larm_compute -larm_compute_core -lpthread
// (plugins/acl/build.py does this and caches the binary.)

#include "arm_compute/core/CPP/CPPTypes.h"
#include "arm_compute/core/Error.h"
#include "arm_compute/core/ITensorInfo.h"
#include "arm_compute/core/TensorInfo.h"
#include "arm_compute/core/Types.h"
#include "arm_compute/core/Version.h"
#include "arm_compute/core/CPP/ICPPKernel.h"
#include "arm_compute/core/ITensorPack.h"
#include "arm_compute/core/Window.h"
#include "arm_compute/runtime/IFunction.h"
#include "arm_compute/runtime/Scheduler.h"
#include "arm_compute/runtime/Tensor.h"
#include "arm_compute/runtime/NEON/functions/NEConvolutionLayer.h"
#include "arm_compute/runtime/NEON/functions/NEDeconvolutionLayer.h"
#include "arm_compute/runtime/NEON/functions/NEDepthwiseConvolutionLayer.h"
#include "arm_compute/runtime/NEON/functions/NEDirectConvolutionLayer.h"
#include "arm_compute/runtime/NEON/functions/NEFFTConvolutionLayer.h"
#include "arm_compute/runtime/NEON/functions/NEFullyConnectedLayer.h"
#include "arm_compute/runtime/NEON/functions/NEGEMMConvolutionLayer.h"
#include "arm_compute/runtime/NEON/functions/NEWinogradConvolutionLayer.h"
#include "arm_compute/runtime/CPP/CPPScheduler.h"
#include "arm_compute/runtime/NEON/functions/NEActivationLayer.h"
#include "arm_compute/runtime/NEON/functions/NEArithmeticAddition.h"
#include "arm_compute/runtime/NEON/functions/NEConcatenateLayer.h"
#include "arm_compute/runtime/NEON/functions/NECopy.h"
#include "arm_compute/runtime/NEON/functions/NEFlattenLayer.h"
#include "arm_compute/runtime/NEON/functions/NEPermute.h"
#include "arm_compute/runtime/NEON/functions/NEPoolingLayer.h"
#include "arm_compute/runtime/NEON/functions/NESoftmaxLayer.h"

#include <dlfcn.h>
#include <pthread.h>
#include <sched.h>

#include <set>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <mutex>
#include <thread>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <fstream>
#include <iostream>
#include <map>
#include <memory>
#include <random>
#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

using namespace arm_compute;

// ---------------------------------------------------------------------------------------------
// arm_gemm internals of ACL v20.08 (not shipped as headers). Declared here to match the 20.08 ABI
// exactly; layout cross-checked against the disassembly of libarm_compute.so.20
// (NEGEMMAssemblyDispatch::configure builds GemmArgs/GemmConfig on its stack) and verified again at
// start-up by ext::check_gemm_abi(). Used only through dlsym'd pointers + one interposed symbol.
// ---------------------------------------------------------------------------------------------
namespace arm_gemm
{
enum class GemmMethod
{
    DEFAULT,
    GEMV_BATCHED,
    GEMV_PRETRANSPOSED,
    GEMV_NATIVE_TRANSPOSED,
    GEMM_NATIVE,
    GEMM_HYBRID,
    GEMM_INTERLEAVED,
    GEMM_INTERLEAVED_2D,
    QUANTIZE_WRAPPER,
    QUANTIZE_WRAPPER_2D,
    GEMM_HYBRID_QUANTIZED
};
struct KernelDescription
{
    GemmMethod  method{ GemmMethod::DEFAULT };
    std::string name{};
    bool        is_default{ false };
    uint64_t    cycle_estimate{ 0 };
};
struct GemmConfig
{
    GemmMethod   method{ GemmMethod::DEFAULT };
    std::string  filter{};
    unsigned int inner_block_size{ 0 };
    unsigned int outer_block_size{ 0 };
};
struct Activation
{
    enum class Type
    {
        None,
        ReLU,
        BoundedReLU
    };
    Type  type{ Type::None };
    float param1{ 0.f };
    float param2{ 0.f };
};
struct GemmArgs
{
    const arm_compute::CPUInfo *_ci;
    unsigned int                _Msize;
    unsigned int                _Nsize;
    unsigned int                _Ksize;
    unsigned int                _nbatches;
    unsigned int                _nmulti;
    Activation                  _act;
    int                         _maxthreads;
    const GemmConfig           *_cfg;
    GemmArgs(const arm_compute::CPUInfo *ci, unsigned int M, unsigned int N, unsigned int K, unsigned int nbatches, unsigned int nmulti, Activation act, int maxthreads, const GemmConfig *cfg)
        : _ci(ci), _Msize(M), _Nsize(N), _Ksize(K), _nbatches(nbatches), _nmulti(nmulti), _act(act), _maxthreads(maxthreads), _cfg(cfg)
    {
    }
};
struct Nothing
{
};
template <typename Top, typename Tret, class OutputStage = Nothing>
KernelDescription get_gemm_method(const GemmArgs &args, const OutputStage & = {});

#if defined(__aarch64__)
// Offsets read off the 20.08 disassembly (LP64).
static_assert(sizeof(KernelDescription) == 56 && offsetof(KernelDescription, name) == 8 && offsetof(KernelDescription, is_default) == 40 && offsetof(KernelDescription, cycle_estimate) == 48,
              "KernelDescription layout");
static_assert(sizeof(GemmConfig) == 48 && offsetof(GemmConfig, filter) == 8 && offsetof(GemmConfig, inner_block_size) == 40, "GemmConfig layout");
static_assert(offsetof(GemmArgs, _Msize) == 8 && offsetof(GemmArgs, _nmulti) == 24 && offsetof(GemmArgs, _act) == 28 && offsetof(GemmArgs, _maxthreads) == 40 && offsetof(GemmArgs, _cfg) == 48 && sizeof(GemmArgs) == 56,
              "GemmArgs layout");
#endif
} // namespace arm_gemm

namespace ks
{
static const int PROTOCOL_VERSION = 1;

// ---------------------------------------------------------------------------------------------
// Minimal JSON reader (objects, arrays, strings, numbers, true/false/null). Enough for the flat
// requests of PROTOCOL.md; rejects malformed input with a message.
// ---------------------------------------------------------------------------------------------
struct JVal
{
    enum Type { NUL, BOOL, NUM, STR, ARR, OBJ } type{ NUL };
    bool   b{ false };
    double n{ 0 };
    std::string s;
    std::vector<JVal> a;
    std::vector<std::pair<std::string, JVal>> o;

    const JVal *get(const std::string &key) const
    {
        if(type != OBJ)
            return nullptr;
        for(const auto &kv : o)
            if(kv.first == key)
                return &kv.second;
        return nullptr;
    }
};

class JParser
{
public:
    explicit JParser(const std::string &text) : _t(text) {}
    JVal parse()
    {
        JVal v = value();
        ws();
        if(_i != _t.size())
            fail("trailing characters");
        return v;
    }

private:
    const std::string &_t;
    size_t             _i{ 0 };

    [[noreturn]] void fail(const std::string &what)
    {
        throw std::runtime_error("JSON parse error at offset " + std::to_string(_i) + ": " + what);
    }
    void ws()
    {
        while(_i < _t.size() && (_t[_i] == ' ' || _t[_i] == '\t' || _t[_i] == '\n' || _t[_i] == '\r'))
            ++_i;
    }
    bool lit(const char *w)
    {
        size_t l = std::strlen(w);
        if(_t.compare(_i, l, w) == 0)
        {
            _i += l;
            return true;
        }
        return false;
    }
    JVal value()
    {
        ws();
        if(_i >= _t.size())
            fail("unexpected end");
        JVal v;
        char c = _t[_i];
        if(c == '{')
        {
            v.type = JVal::OBJ;
            ++_i;
            ws();
            if(_i < _t.size() && _t[_i] == '}')
            {
                ++_i;
                return v;
            }
            for(;;)
            {
                ws();
                if(_i >= _t.size() || _t[_i] != '"')
                    fail("expected key");
                std::string k = str();
                ws();
                if(_i >= _t.size() || _t[_i] != ':')
                    fail("expected ':'");
                ++_i;
                JVal item = value();
                v.o.emplace_back(k, std::move(item));
                ws();
                if(_i < _t.size() && _t[_i] == ',')
                {
                    ++_i;
                    continue;
                }
                if(_i < _t.size() && _t[_i] == '}')
                {
                    ++_i;
                    return v;
                }
                fail("expected ',' or '}'");
            }
        }
        if(c == '[')
        {
            v.type = JVal::ARR;
            ++_i;
            ws();
            if(_i < _t.size() && _t[_i] == ']')
            {
                ++_i;
                return v;
            }
            for(;;)
            {
                v.a.push_back(value());
                ws();
                if(_i < _t.size() && _t[_i] == ',')
                {
                    ++_i;
                    continue;
                }
                if(_i < _t.size() && _t[_i] == ']')
                {
                    ++_i;
                    return v;
                }
                fail("expected ',' or ']'");
            }
        }
        if(c == '"')
        {
            v.type = JVal::STR;
            v.s    = str();
            return v;
        }
        if(lit("true"))
        {
            v.type = JVal::BOOL;
            v.b    = true;
            return v;
        }
        if(lit("false"))
        {
            v.type = JVal::BOOL;
            return v;
        }
        if(lit("null"))
            return v;
        if(c == '-' || (c >= '0' && c <= '9'))
        {
            size_t j = _i;
            while(j < _t.size() && std::strchr("+-0123456789.eE", _t[j]) != nullptr)
                ++j;
            std::string num = _t.substr(_i, j - _i);
            char       *end = nullptr;
            v.type          = JVal::NUM;
            v.n             = std::strtod(num.c_str(), &end);
            if(end == nullptr || *end != '\0')
                fail("bad number '" + num + "'");
            _i = j;
            return v;
        }
        fail(std::string("unexpected character '") + c + "'");
    }
    std::string str()
    {
        ++_i; // opening quote
        std::string out;
        while(_i < _t.size())
        {
            char c = _t[_i++];
            if(c == '"')
                return out;
            if(c != '\\')
            {
                out += c;
                continue;
            }
            if(_i >= _t.size())
                break;
            char e = _t[_i++];
            switch(e)
            {
                case '"': out += '"'; break;
                case '\\': out += '\\'; break;
                case '/': out += '/'; break;
                case 'b': out += '\b'; break;
                case 'f': out += '\f'; break;
                case 'n': out += '\n'; break;
                case 'r': out += '\r'; break;
                case 't': out += '\t'; break;
                case 'u':
                {
                    if(_i + 4 > _t.size())
                        fail("bad \\u escape");
                    unsigned cp = static_cast<unsigned>(std::strtoul(_t.substr(_i, 4).c_str(), nullptr, 16));
                    _i += 4;
                    // BMP only (paths and names are expected to be ASCII/UTF-8 already)
                    if(cp < 0x80)
                        out += static_cast<char>(cp);
                    else if(cp < 0x800)
                    {
                        out += static_cast<char>(0xC0 | (cp >> 6));
                        out += static_cast<char>(0x80 | (cp & 0x3F));
                    }
                    else
                    {
                        out += static_cast<char>(0xE0 | (cp >> 12));
                        out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
                        out += static_cast<char>(0x80 | (cp & 0x3F));
                    }
                    break;
                }
                default: fail("bad escape");
            }
        }
        fail("unterminated string");
    }
};

// ---------------------------------------------------------------------------------------------
// JSON writing helpers
// ---------------------------------------------------------------------------------------------
std::string jstr(const std::string &s)
{
    std::string out = "\"";
    for(unsigned char c : s)
    {
        switch(c)
        {
            case '"': out += "\\\""; break;
            case '\\': out += "\\\\"; break;
            case '\n': out += "\\n"; break;
            case '\r': out += "\\r"; break;
            case '\t': out += "\\t"; break;
            default:
                if(c < 0x20)
                {
                    char buf[8];
                    std::snprintf(buf, sizeof(buf), "\\u%04x", c);
                    out += buf;
                }
                else
                    out += static_cast<char>(c);
        }
    }
    return out + "\"";
}
std::string jnum(double v)
{
    if(!std::isfinite(v))
        return "null";
    char buf[32];
    std::snprintf(buf, sizeof(buf), "%.17g", v);
    return buf;
}
std::string jnum3(double v) // microsecond values: 3 decimals are plenty
{
    char buf[32];
    std::snprintf(buf, sizeof(buf), "%.3f", v);
    return buf;
}
std::string jbool(bool b)
{
    return b ? "true" : "false";
}
template <typename T>
std::string jints(const std::vector<T> &v)
{
    std::string out = "[";
    for(size_t i = 0; i < v.size(); ++i)
        out += (i ? "," : "") + std::to_string(v[i]);
    return out + "]";
}

struct Obj // builds {"k":v,...} with raw (already-encoded) values
{
    std::string body;
    Obj &raw(const std::string &k, const std::string &v)
    {
        body += (body.empty() ? "" : ",") + jstr(k) + ":" + v;
        return *this;
    }
    Obj &str(const std::string &k, const std::string &v) { return raw(k, jstr(v)); }
    Obj &num(const std::string &k, double v) { return raw(k, jnum(v)); }
    Obj &integer(const std::string &k, long long v) { return raw(k, std::to_string(v)); }
    Obj &boolean(const std::string &k, bool v) { return raw(k, jbool(v)); }
    std::string done() const { return "{" + body + "}"; }
};

// ---------------------------------------------------------------------------------------------
// Request accessors
// ---------------------------------------------------------------------------------------------
struct BadRequest : std::runtime_error
{
    using std::runtime_error::runtime_error;
};

const JVal &need(const JVal &obj, const std::string &k)
{
    const JVal *v = obj.get(k);
    if(v == nullptr)
        throw BadRequest("missing field '" + k + "'");
    return *v;
}
long long as_int(const JVal &v, const std::string &what)
{
    if(v.type != JVal::NUM || std::floor(v.n) != v.n)
        throw BadRequest("field '" + what + "' must be an integer");
    return static_cast<long long>(v.n);
}
long long opt_int(const JVal &obj, const std::string &k, long long dflt)
{
    const JVal *v = obj.get(k);
    return (v == nullptr || v->type == JVal::NUL) ? dflt : as_int(*v, k);
}
double opt_num(const JVal &obj, const std::string &k, double dflt)
{
    const JVal *v = obj.get(k);
    if(v == nullptr || v->type == JVal::NUL)
        return dflt;
    if(v->type != JVal::NUM)
        throw BadRequest("field '" + k + "' must be a number");
    return v->n;
}
bool opt_bool(const JVal &obj, const std::string &k, bool dflt)
{
    const JVal *v = obj.get(k);
    if(v == nullptr || v->type == JVal::NUL)
        return dflt;
    if(v->type != JVal::BOOL)
        throw BadRequest("field '" + k + "' must be true/false");
    return v->b;
}
std::string opt_str(const JVal &obj, const std::string &k, const std::string &dflt)
{
    const JVal *v = obj.get(k);
    if(v == nullptr || v->type == JVal::NUL)
        return dflt;
    if(v->type != JVal::STR)
        throw BadRequest("field '" + k + "' must be a string");
    return v->s;
}
std::vector<long long> int_list(const JVal &obj, const std::string &k, size_t n, std::vector<long long> dflt)
{
    const JVal *v = obj.get(k);
    if(v == nullptr || v->type == JVal::NUL)
        return dflt;
    if(v->type != JVal::ARR || (n != 0 && v->a.size() != n))
        throw BadRequest("field '" + k + "' must be a list of " + std::to_string(n) + " integers");
    std::vector<long long> out;
    for(const auto &e : v->a)
        out.push_back(as_int(e, k));
    return out;
}
std::string upper(std::string s)
{
    for(auto &c : s)
        c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
    return s;
}

// ---------------------------------------------------------------------------------------------
// Extensions (phase 2): per-kernel scheduling (recording / workload split) and arm_gemm
// micro-kernel forcing. See FINDINGS.md.
// ---------------------------------------------------------------------------------------------
struct Unsupported : std::runtime_error
{
    using std::runtime_error::runtime_error;
};

namespace ext
{
using Clock = std::chrono::steady_clock;

// ---- per-kernel records ----------------------------------------------------------------------
struct KernelStat
{
    std::string                      name;
    int                              split_dim{ -1 };
    size_t                           iterations{ 0 };
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

double median(std::vector<double> v)
{
    if(v.empty())
        return 0;
    std::sort(v.begin(), v.end());
    return v.size() % 2 ? v[v.size() / 2] : 0.5 * (v[v.size() / 2 - 1] + v[v.size() / 2]);
}

// ---- scheduler that times each kernel and delegates to ACL's CPPScheduler ----------------------
class RecordingScheduler final : public IScheduler
{
public:
    explicit RecordingScheduler(IScheduler &inner) : _inner(inner) {}
    void         set_num_threads(unsigned int n) override { _inner.set_num_threads(n); }
    unsigned int num_threads() const override { return _inner.num_threads(); }
    void         schedule(ICPPKernel *kernel, const Hints &hints) override
    {
        KernelStat *ks = g_rec.slot(kernel->name());
        auto        t0 = Clock::now();
        _inner.schedule(kernel, hints);
        if(ks != nullptr)
            ks->wall_us.push_back(std::chrono::duration<double, std::micro>(Clock::now() - t0).count());
    }
    void schedule_op(ICPPKernel *kernel, const Hints &hints, ITensorPack &tensors) override
    {
        KernelStat *ks = g_rec.slot(kernel->name());
        auto        t0 = Clock::now();
        _inner.schedule_op(kernel, hints, tensors);
        if(ks != nullptr)
            ks->wall_us.push_back(std::chrono::duration<double, std::micro>(Clock::now() - t0).count());
    }
    void run_tagged_workloads(std::vector<Workload> &workloads, const char *tag) override { _inner.run_tagged_workloads(workloads, tag); }

protected:
    void run_workloads(std::vector<Workload> &workloads) override { _inner.run_tagged_workloads(workloads, nullptr); }

private:
    IScheduler &_inner;
};

// ---- scheduler that splits every kernel's window by per-thread ratios --------------------------
cpu_set_t g_main_mask;
bool      g_main_mask_ok = false;
void      restore_main_affinity()
{
    if(g_main_mask_ok)
        pthread_setaffinity_np(pthread_self(), sizeof(g_main_mask), &g_main_mask);
}

class SplitScheduler final : public IScheduler
{
public:
    SplitScheduler(unsigned n, std::vector<double> ratios, std::vector<int> pin) : _ratios(std::move(ratios)), _pin(std::move(pin))
    {
        start(n);
    }
    ~SplitScheduler() override { stop(); }
    void set_num_threads(unsigned int n) override
    {
        stop();
        start(n == 0 ? std::max(1u, std::thread::hardware_concurrency()) : n);
    }
    unsigned int num_threads() const override { return _n; }
    void schedule(ICPPKernel *kernel, const Hints &hints) override { run_kernel(kernel, hints, nullptr); }
    void schedule_op(ICPPKernel *kernel, const Hints &hints, ITensorPack &tensors) override { run_kernel(kernel, hints, &tensors); }

protected:
    void run_workloads(std::vector<Workload> &workloads) override
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

private:
    unsigned                 _n{ 1 };
    std::vector<double>      _ratios; // per thread, normalised at use
    std::vector<int>         _pin;    // cpu per thread (empty: no pinning)
    std::vector<std::thread> _workers;
    std::mutex               _m;
    std::condition_variable  _cv_start, _cv_done;
    unsigned long            _generation{ 0 };
    unsigned                 _pending{ 0 };
    bool                     _stop{ false };
    std::function<void(unsigned)> _job;
    std::exception_ptr       _error;
    bool                     _caller_pinned{ false };

    static void pin_self(int cpu)
    {
        cpu_set_t set;
        CPU_ZERO(&set);
        CPU_SET(cpu, &set);
        pthread_setaffinity_np(pthread_self(), sizeof(set), &set);
    }
    void start(unsigned n)
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
    void stop()
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

public:
    // Stop the workers and unpin the calling thread (idempotent); the object stays valid.
    void shutdown() { stop(); }
    // New per-thread shares for the kernels scheduled from now on (the model engine sets them per op).
    void set_ratios(const std::vector<double> &r) { _ratios = r; }

private:
    void worker(unsigned t)
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
    void parallel(const std::function<void(unsigned)> &fn)
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

    void run_kernel(ICPPKernel *kernel, const Hints &hints, ITensorPack *tensors)
    {
        const Window &maxw   = kernel->window();
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
        }

        KernelStat *ks = g_rec.slot(kernel->name());
        if(ks != nullptr && ks->parts.empty())
        {
            ks->split_dim  = static_cast<int>(dim);
            ks->iterations = static_cast<size_t>(iters);
            for(unsigned t = 0; t < _n; ++t)
                ks->parts.emplace_back(t < n ? b[t] : 0, t < n ? b[t + 1] : 0);
            ks->thread_us.assign(_n, {});
        }
        std::vector<double> tus(_n, 0.0);
        const unsigned      nn = n;
        auto                t0 = Clock::now();
        auto                job = [&](unsigned t) {
            if(t >= nn || b[t] == b[t + 1])
                return;
            Window w = maxw;
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
};

IScheduler                     *g_cpp = nullptr; // ACL's own CPPScheduler instance
std::shared_ptr<IScheduler>     g_custom;
std::shared_ptr<SplitScheduler> g_split;
std::string                     g_mode = "default";
std::vector<double>             g_ratios;

// ---- arm_gemm forcing state ----------------------------------------------------------------------
struct GemmRecord
{
    unsigned    M, N, K, batches, multis;
    int         maxthreads;
    std::string default_name, used_name;
    int         default_method{ 0 }, used_method{ 0 };
    bool        forced{ false };
    std::vector<arm_gemm::KernelDescription> compatible;
};

using GetMethodFn  = arm_gemm::KernelDescription (*)(const arm_gemm::GemmArgs &, const arm_gemm::Nothing &);
using CompatibleFn = std::vector<arm_gemm::KernelDescription> (*)(const arm_gemm::GemmArgs &, const arm_gemm::Nothing &);
const char *SYM_GET_METHOD = "_ZN8arm_gemm15get_gemm_methodIffNS_7NothingEEENS_17KernelDescriptionERKNS_8GemmArgsERKT1_";
const char *SYM_COMPATIBLE = "_ZN8arm_gemm22get_compatible_kernelsIffNS_7NothingEEESt6vectorINS_17KernelDescriptionESaIS3_EERKNS_8GemmArgsERKT1_";

GetMethodFn             g_orig_get_method = nullptr;
CompatibleFn            g_orig_compatible = nullptr;
bool                    g_forcing_ok      = false;
std::string             g_forcing_reason  = "not checked";
std::string             g_force_filter;
bool                    g_recording_gemms = false;
std::vector<GemmRecord> g_gemms;
thread_local bool       g_in_probe = false;

const char *gemm_method_name(int m)
{
    static const char *names[] = { "DEFAULT", "GEMV_BATCHED", "GEMV_PRETRANSPOSED", "GEMV_NATIVE_TRANSPOSED", "GEMM_NATIVE", "GEMM_HYBRID", "GEMM_INTERLEAVED", "GEMM_INTERLEAVED_2D", "QUANTIZE_WRAPPER", "QUANTIZE_WRAPPER_2D", "GEMM_HYBRID_QUANTIZED" };
    return (m >= 0 && m < 11) ? names[m] : "UNKNOWN";
}

std::vector<arm_gemm::KernelDescription> compatible(const arm_gemm::GemmArgs &args)
{
    std::vector<arm_gemm::KernelDescription> v;
    if(g_orig_compatible != nullptr && g_forcing_ok)
    {
        g_in_probe = true;
        try
        {
            v = g_orig_compatible(args, arm_gemm::Nothing{});
        }
        catch(...)
        {
        }
        g_in_probe = false;
    }
    return v;
}

// Called (through the interposed arm_gemm::get_gemm_method<float,float,Nothing>) by
// NEGEMMAssemblyDispatch::configure for every fp32 GEMM that ACL sets up. ACL then passes the
// returned name as GemmConfig::filter to arm_gemm::gemm(), so returning another eligible kernel's
// description makes ACL build that kernel.
arm_gemm::KernelDescription interposed_get_gemm_method(const arm_gemm::GemmArgs &args, const arm_gemm::Nothing &os)
{
    if(g_orig_get_method == nullptr)
    {
        std::fprintf(stderr, "kselect_acl_runner: original arm_gemm::get_gemm_method not found\n");
        std::abort();
    }
    arm_gemm::KernelDescription dflt = g_orig_get_method(args, os);
    if(g_in_probe || !g_recording_gemms)
        return dflt;
    GemmRecord r;
    r.M = args._Msize, r.N = args._Nsize, r.K = args._Ksize, r.batches = args._nbatches, r.multis = args._nmulti, r.maxthreads = args._maxthreads;
    r.default_name   = dflt.name;
    r.default_method = static_cast<int>(dflt.method);
    r.used_name      = dflt.name;
    r.used_method    = r.default_method;
    r.compatible     = compatible(args);
    arm_gemm::KernelDescription result = dflt;
    if(!g_force_filter.empty() && g_forcing_ok)
    {
        arm_gemm::GemmConfig cfg = args._cfg != nullptr ? *args._cfg : arm_gemm::GemmConfig();
        cfg.filter               = g_force_filter;
        arm_gemm::GemmArgs a2    = args;
        a2._cfg                  = &cfg;
        arm_gemm::KernelDescription f = g_orig_get_method(a2, os);
        if(!f.name.empty() && f.name.find(g_force_filter) != std::string::npos)
        {
            result        = f;
            r.used_name   = f.name;
            r.used_method = static_cast<int>(f.method);
            r.forced      = true;
        }
    }
    g_gemms.push_back(std::move(r));
    return result;
}

// Start-up ABI check: the declarations above must match this library build exactly.
void check_gemm_abi()
{
    g_forcing_ok = false;
    void *core   = dlopen("libarm_compute_core.so.20", RTLD_LAZY | RTLD_NOLOAD);
    if(core == nullptr)
        core = dlopen("libarm_compute_core.so", RTLD_LAZY | RTLD_NOLOAD);
    if(core == nullptr)
    {
        g_forcing_reason = "libarm_compute_core not loaded";
        return;
    }
    g_orig_get_method = reinterpret_cast<GetMethodFn>(dlsym(core, SYM_GET_METHOD));
    g_orig_compatible = reinterpret_cast<CompatibleFn>(dlsym(core, SYM_COMPATIBLE));
    if(g_orig_get_method == nullptr || g_orig_compatible == nullptr)
    {
        g_forcing_reason = "arm_gemm symbols not exported by libarm_compute_core";
        return;
    }
    void *global = dlsym(RTLD_DEFAULT, SYM_GET_METHOD);
    if(global == reinterpret_cast<void *>(g_orig_get_method))
    {
        g_forcing_reason = "interposition inactive: get_gemm_method resolves to the library, not the runner";
        return;
    }
    if(std::getenv("KSELECT_ACL_NO_GEMM_FORCING") != nullptr)
    {
        g_forcing_reason = "disabled by KSELECT_ACL_NO_GEMM_FORCING";
        return;
    }
    std::string bi = build_information();
    if(bi.find("arm_compute_version=v20.08") == std::string::npos)
    {
        g_forcing_reason = "declarations are for ACL v20.08; this library is not v20.08";
        return;
    }
    // Probe 1: list for a 64x64x64 GEMM must be sane.
    CPUInfo           &ci = Scheduler::get().cpu_info();
    arm_gemm::GemmArgs a(&ci, 64, 64, 64, 1, 1, arm_gemm::Activation(), 1, nullptr);
    g_forcing_ok = true; // allow compatible() during the probe
    std::vector<arm_gemm::KernelDescription> v = compatible(a);
    g_forcing_ok = false;
    if(v.empty() || v.size() > 64)
    {
        g_forcing_reason = "get_compatible_kernels returned " + std::to_string(v.size()) + " entries";
        return;
    }
    bool has_sgemm = false;
    for(const auto &k : v)
    {
        int m = static_cast<int>(k.method);
        if(m < 0 || m > 10 || k.name.empty() || k.name.size() > 64)
        {
            g_forcing_reason = "implausible KernelDescription (method/name) from get_compatible_kernels";
            return;
        }
        for(char c : k.name)
            if(!(std::isalnum(static_cast<unsigned char>(c)) || c == '_'))
            {
                g_forcing_reason = "implausible kernel name from get_compatible_kernels";
                return;
            }
        if(k.name.find("sgemm_12x8") != std::string::npos)
            has_sgemm = true;
    }
    if(!has_sgemm)
    {
        g_forcing_reason = "sgemm_12x8 not among the fp32 kernels for a 64x64x64 GEMM";
        return;
    }
    // Probe 2: GemmArgs::_cfg / GemmConfig::filter must be honoured for every listed kernel.
    for(const auto &k : v)
    {
        arm_gemm::GemmConfig cfg;
        cfg.filter = k.name;
        arm_gemm::GemmArgs a2(&ci, 64, 64, 64, 1, 1, arm_gemm::Activation(), 1, &cfg);
        arm_gemm::KernelDescription got = g_orig_get_method(a2, arm_gemm::Nothing{});
        if(got.name != k.name)
        {
            g_forcing_reason = "GemmConfig filter '" + k.name + "' not honoured (got '" + got.name + "')";
            return;
        }
    }
    // Probe 3: _Msize must be where we think: M=1 must make sgemv_pretransposed eligible, M=64 not.
    arm_gemm::GemmArgs a1(&ci, 1, 64, 64, 1, 1, arm_gemm::Activation(), 1, nullptr);
    g_forcing_ok = true;
    std::vector<arm_gemm::KernelDescription> v1 = compatible(a1);
    g_forcing_ok = false;
    bool gemv1 = false, gemv64 = false;
    for(const auto &k : v1)
        gemv1 |= k.name == "sgemv_pretransposed";
    for(const auto &k : v)
        gemv64 |= k.name == "sgemv_pretransposed";
    if(!gemv1 || gemv64)
    {
        g_forcing_reason = "sgemv_pretransposed eligibility does not follow M (GemmArgs layout mismatch?)";
        return;
    }
    g_forcing_ok     = true;
    g_forcing_reason = "ok";
}

std::string kernels_json(const std::vector<arm_gemm::KernelDescription> &v)
{
    std::string out = "[";
    for(size_t i = 0; i < v.size(); ++i)
        out += (i ? "," : "") + Obj().str("name", v[i].name).str("method", gemm_method_name(static_cast<int>(v[i].method))).boolean("is_default", v[i].is_default).raw("cycle_estimate", std::to_string(v[i].cycle_estimate)).done();
    return out + "]";
}

// ---- hooks used by the request handlers ------------------------------------------------------------
void startup()
{
    Scheduler::set(Scheduler::Type::CPP);
    g_cpp          = &Scheduler::get();
    g_main_mask_ok = pthread_getaffinity_np(pthread_self(), sizeof(g_main_mask), &g_main_mask) == 0;
    check_gemm_abi();
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
    Scheduler::get().cpu_info().set_cpu_model(cpu, m);
    if(g_cpp != nullptr && g_cpp != &Scheduler::get())
        g_cpp->cpu_info().set_cpu_model(cpu, m);
}

void begin_configure(const JVal &cfg)
{
    g_gemms.clear();
    g_force_filter = opt_str(cfg, "gemm_kernel", "");
    if(!g_force_filter.empty() && !g_forcing_ok)
        throw Unsupported("gemm_kernel forcing unavailable: " + g_forcing_reason);
    g_recording_gemms = true;
}

// Returns the "gemm" JSON section; sets *error when a requested kernel could not be applied.
std::string end_configure(const JVal &cfg, std::string *error)
{
    g_recording_gemms = false;
    const bool strict = opt_bool(cfg, "gemm_kernel_strict", true);
    if(g_gemms.empty() && g_force_filter.empty())
        return "";
    std::string list = "[";
    bool        all_forced = !g_gemms.empty();
    for(size_t i = 0; i < g_gemms.size(); ++i)
    {
        const GemmRecord &r = g_gemms[i];
        all_forced &= r.forced;
        std::string names = "[";
        for(size_t j = 0; j < r.compatible.size(); ++j)
            names += (j ? "," : "") + jstr(r.compatible[j].name);
        names += "]";
        list += (i ? "," : "") + Obj()
                                     .integer("M", r.M)
                                     .integer("N", r.N)
                                     .integer("K", r.K)
                                     .integer("batches", r.batches)
                                     .integer("multis", r.multis)
                                     .integer("maxthreads", r.maxthreads)
                                     .str("default", r.default_name)
                                     .str("default_method", gemm_method_name(r.default_method))
                                     .str("used", r.used_name)
                                     .str("used_method", gemm_method_name(r.used_method))
                                     .boolean("forced", r.forced)
                                     .raw("compatible", names)
                                     .done();
    }
    list += "]";
    if(!g_force_filter.empty() && strict && !all_forced)
        *error = g_gemms.empty() ? "gemm_kernel '" + g_force_filter + "' requested but this op configured no arm_gemm fp32 GEMM" :
                                   "gemm_kernel '" + g_force_filter + "' is not eligible for every GEMM of this op (see gemm.gemms[].compatible)";
    Obj o;
    o.boolean("forcing_available", g_forcing_ok);
    if(!g_force_filter.empty())
        o.str("requested", g_force_filter);
    o.raw("gemms", list);
    return o.done();
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
            o.integer("split_dim", k.split_dim).integer("iterations", static_cast<long long>(k.iterations)).raw("parts", parts + "]").raw("thread_median_us", tus + "]");
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

std::string info_json()
{
    Obj o;
    o.boolean("gemm_forcing", g_forcing_ok).str("gemm_forcing_reason", g_forcing_reason).raw("schedulers", "[\"default\",\"record\",\"split\"]");
    return o.done();
}

// {"action":"gemm_kernels","M":..,"N":..,"K":..,"batches":1,"multis":1,"threads":1}
std::string gemm_kernels(const JVal &req)
{
    if(!g_forcing_ok)
        throw Unsupported("arm_gemm introspection unavailable: " + g_forcing_reason);
    const long long M = opt_int(req, "M", 0), N = opt_int(req, "N", 0), K = opt_int(req, "K", 0);
    if(M <= 0 || N <= 0 || K <= 0)
        throw BadRequest("gemm_kernels needs positive M, N, K");
    const long long b = opt_int(req, "batches", 1), mu = opt_int(req, "multis", 1), th = opt_int(req, "threads", 1);
    CPUInfo        &ci = Scheduler::get().cpu_info();
    arm_gemm::GemmArgs a(&ci, static_cast<unsigned>(M), static_cast<unsigned>(N), static_cast<unsigned>(K), static_cast<unsigned>(b), static_cast<unsigned>(mu), arm_gemm::Activation(), static_cast<int>(th), nullptr);
    std::vector<arm_gemm::KernelDescription> v = compatible(a);
    g_in_probe = true;
    arm_gemm::KernelDescription d = g_orig_get_method(a, arm_gemm::Nothing{});
    g_in_probe = false;
    Obj o;
    o.boolean("ok", true).str("action", "gemm_kernels").str("default", d.name).str("default_method", gemm_method_name(static_cast<int>(d.method))).raw("kernels", kernels_json(v));
    return o.done();
}

void after_request()
{
    g_recording_gemms = false;
    g_force_filter.clear();
    g_rec.reset();
}
} // namespace ext

// ---------------------------------------------------------------------------------------------
// Tensors: logical (NCHW-order) buffers <-> ACL tensors in either layout
// ---------------------------------------------------------------------------------------------
// A mapping says, for each ACL dimension d (0 = innermost), which logical index it holds
// (-1: a size-1 dimension that has no logical counterpart).
struct Mapping
{
    std::vector<size_t> logical_dims; // e.g. {N,C,H,W}
    std::vector<int>    acl_to_logical;

    TensorShape acl_shape() const
    {
        TensorShape s;
        for(size_t d = 0; d < acl_to_logical.size(); ++d)
            s.set(d, acl_to_logical[d] < 0 ? 1 : logical_dims[acl_to_logical[d]], false);
        return s;
    }
    size_t count() const
    {
        size_t n = 1;
        for(auto d : logical_dims)
            n *= d;
        return n;
    }
};

// Activation / weights of rank 4 in logical (A,B,C,D) = (N,C,H,W) or (O,I,H,W)
Mapping map4(const std::vector<size_t> &dims, DataLayout layout)
{
    if(layout == DataLayout::NCHW)
        return Mapping{ dims, { 3, 2, 1, 0 } }; // W,H,C,N
    return Mapping{ dims, { 1, 3, 2, 0 } };     // C,W,H,N
}
// Depthwise weights, logical (O,1,kh,kw): ACL NCHW shape (kw,kh,O), NHWC (O,kw,kh)
Mapping map_dw_weights(const std::vector<size_t> &dims, DataLayout layout)
{
    if(layout == DataLayout::NCHW)
        return Mapping{ dims, { 3, 2, 0 } };
    return Mapping{ dims, { 0, 3, 2 } };
}
Mapping map1(size_t n)
{
    return Mapping{ { n }, { 0 } };
}
Mapping map2(size_t rows, size_t cols) // logical (rows, cols) row-major -> ACL (cols, rows)
{
    return Mapping{ { rows, cols }, { 1, 0 } };
}

// Strides in bytes, per logical index, of an allocated ACL tensor.
std::vector<size_t> logical_strides(const Tensor &t, const Mapping &m)
{
    std::vector<size_t> st(m.logical_dims.size(), 0);
    const Strides     &s = t.info()->strides_in_bytes();
    for(size_t d = 0; d < m.acl_to_logical.size(); ++d)
        if(m.acl_to_logical[d] >= 0)
            st[m.acl_to_logical[d]] = s[d];
    return st;
}

template <bool TO_TENSOR>
void copy_logical(Tensor &t, const Mapping &m, float *logical)
{
    const size_t        rank = m.logical_dims.size();
    std::vector<size_t> st   = logical_strides(t, m);
    std::vector<size_t> dims = m.logical_dims;
    while(dims.size() < 4)
    {
        dims.insert(dims.begin(), 1);
        st.insert(st.begin(), 0);
    }
    (void)rank;
    uint8_t *base = t.buffer() + t.info()->offset_first_element_in_bytes();
    size_t   i    = 0;
    for(size_t a = 0; a < dims[0]; ++a)
        for(size_t b = 0; b < dims[1]; ++b)
            for(size_t c = 0; c < dims[2]; ++c)
            {
                uint8_t *row = base + a * st[0] + b * st[1] + c * st[2];
                for(size_t d = 0; d < dims[3]; ++d, ++i)
                {
                    float *p = reinterpret_cast<float *>(row + d * st[3]);
                    if(TO_TENSOR)
                        *p = logical[i];
                    else
                        logical[i] = *p;
                }
            }
}

std::vector<float> load_or_random(const JVal &req, const std::string &key, size_t count, uint32_t seed)
{
    std::vector<float> v(count);
    std::string        path = opt_str(req, key, "");
    if(path.empty())
    {
        std::mt19937                          gen(seed);
        std::uniform_real_distribution<float> dist(-1.f, 1.f);
        for(auto &x : v)
            x = dist(gen);
        return v;
    }
    std::ifstream f(path, std::ios::binary);
    if(!f)
        throw BadRequest("cannot open " + key + " file '" + path + "'");
    f.seekg(0, std::ios::end);
    std::streamoff size = f.tellg();
    if(size != static_cast<std::streamoff>(count * sizeof(float)))
        throw BadRequest(key + " file '" + path + "' has " + std::to_string(size) + " bytes, expected " + std::to_string(count * sizeof(float)));
    f.seekg(0);
    f.read(reinterpret_cast<char *>(v.data()), static_cast<std::streamsize>(count * sizeof(float)));
    return v;
}

void save(const std::string &path, const std::vector<float> &v)
{
    std::ofstream f(path, std::ios::binary | std::ios::trunc);
    if(!f)
        throw std::runtime_error("cannot write output file '" + path + "'");
    f.write(reinterpret_cast<const char *>(v.data()), static_cast<std::streamsize>(v.size() * sizeof(float)));
    if(!f)
        throw std::runtime_error("short write to output file '" + path + "'");
}

// A run's output, in logical order, to the request's output_path when it names one.
void save_output(const JVal &req, Tensor &t, const Mapping &m)
{
    std::string path = opt_str(req, "output_path", "");
    if(path.empty())
        return;
    std::vector<float> v(m.count());
    copy_logical<false>(t, m, v.data());
    save(path, v);
}

std::string layout_name(DataLayout l)
{
    return l == DataLayout::NHWC ? "NHWC" : "NCHW";
}
DataLayout parse_layout(const std::string &s)
{
    std::string u = upper(s);
    if(u == "NCHW")
        return DataLayout::NCHW;
    if(u == "NHWC")
        return DataLayout::NHWC;
    throw BadRequest("layout must be NCHW or NHWC, got '" + s + "'");
}
// What NEPermute takes to bring a rank-4 tensor from the other layout into `want`.
PermutationVector permutation_to(DataLayout want)
{
    return want == DataLayout::NHWC ? PermutationVector(2U, 0U, 1U) : PermutationVector(1U, 2U, 0U);
}
std::string conv_method_name(ConvolutionMethod m)
{
    switch(m)
    {
        case ConvolutionMethod::GEMM: return "GEMM";
        case ConvolutionMethod::DIRECT: return "DIRECT";
        case ConvolutionMethod::WINOGRAD: return "WINOGRAD";
        case ConvolutionMethod::FFT: return "FFT";
        default: return "UNKNOWN";
    }
}

// ---------------------------------------------------------------------------------------------
// CPU model / threads
// ---------------------------------------------------------------------------------------------
struct CpuState
{
    std::vector<CPUModel> original;
};
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

// ---------------------------------------------------------------------------------------------
// Convolution
// ---------------------------------------------------------------------------------------------
struct ConvSpec
{
    size_t N, C, H, W;      // input
    size_t O, CI, KH, KW;   // weights OIHW (CI = C / group)
    size_t sh, sw;          // stride
    size_t pt, pl, pb, pr;  // pads
    size_t dh, dw;          // dilation
    size_t group;
    bool   has_bias;
    bool   relu;
    ActivationLayerInfo actinfo; // fused activation ("relu": true or an "act" object)
    size_t OH, OW;

    bool depthwise() const { return group > 1 && group == C && O % C == 0 && CI == 1; }
    PadStrideInfo pad_stride() const
    {
        return PadStrideInfo(static_cast<unsigned>(sw), static_cast<unsigned>(sh), static_cast<unsigned>(pl), static_cast<unsigned>(pr), static_cast<unsigned>(pt), static_cast<unsigned>(pb),
                             DimensionRoundingType::FLOOR);
    }
    Size2D dilation() const { return Size2D(dw, dh); }
    ActivationLayerInfo act() const { return actinfo; }
    std::vector<size_t> in_dims() const { return { N, C, H, W }; }
    std::vector<size_t> w_dims() const { return { O, CI, KH, KW }; }
    std::vector<size_t> out_dims() const { return { N, O, OH, OW }; }
};

// A fused activation: "relu": true, or "act": {"fn": "RELU" | "BOUNDED_RELU" | "LU_BOUNDED_RELU" |
// "LEAKY_RELU" | "LOGISTIC" | "TANH", "a": .., "b": ..} (ACL's ActivationLayerInfo parameters).
ActivationLayerInfo act_from(const JVal &a)
{
    using AF               = ActivationLayerInfo::ActivationFunction;
    const std::string fn   = upper(opt_str(a, "fn", ""));
    const float       pa   = static_cast<float>(opt_num(a, "a", 0.0));
    const float       pb   = static_cast<float>(opt_num(a, "b", 0.0));
    static const std::vector<std::pair<std::string, AF>> fns = { { "RELU", AF::RELU }, { "BOUNDED_RELU", AF::BOUNDED_RELU }, { "LU_BOUNDED_RELU", AF::LU_BOUNDED_RELU },
                                                                 { "LEAKY_RELU", AF::LEAKY_RELU }, { "LOGISTIC", AF::LOGISTIC }, { "TANH", AF::TANH } };
    if(fn.empty() || fn == "NONE")
        return ActivationLayerInfo();
    for(const auto &kv : fns)
        if(kv.first == fn)
            return ActivationLayerInfo(kv.second, pa, pb);
    throw BadRequest("unknown activation '" + fn + "' (RELU, BOUNDED_RELU, LU_BOUNDED_RELU, LEAKY_RELU, LOGISTIC, TANH)");
}
ActivationLayerInfo parse_act(const JVal &req, bool relu)
{
    const JVal *a = req.get("act");
    if(a != nullptr && a->type == JVal::OBJ)
        return act_from(*a);
    if(a != nullptr && a->type != JVal::NUL)
        throw BadRequest("'act' must be an object {\"fn\":..,\"a\":..,\"b\":..}");
    return relu ? ActivationLayerInfo(ActivationLayerInfo::ActivationFunction::RELU) : ActivationLayerInfo();
}

ConvSpec parse_conv(const JVal &req)
{
    ConvSpec s{};
    auto     in = int_list(req, "input", 4, {});
    auto     w  = int_list(req, "weights", 4, {});
    if(in.empty() || w.empty())
        throw BadRequest("conv needs 'input' [N,C,H,W] and 'weights' [O,I,KH,KW]");
    for(auto v : in)
        if(v <= 0)
            throw BadRequest("input dims must be positive");
    for(auto v : w)
        if(v <= 0)
            throw BadRequest("weights dims must be positive");
    s.N = in[0], s.C = in[1], s.H = in[2], s.W = in[3];
    s.O = w[0], s.CI = w[1], s.KH = w[2], s.KW = w[3];
    auto st = int_list(req, "stride", 2, { 1, 1 });
    auto pd = int_list(req, "pads", 4, { 0, 0, 0, 0 });
    auto dl = int_list(req, "dilation", 2, { 1, 1 });
    s.sh = st[0], s.sw = st[1];
    s.pt = pd[0], s.pl = pd[1], s.pb = pd[2], s.pr = pd[3];
    s.dh = dl[0], s.dw = dl[1];
    s.group    = static_cast<size_t>(opt_int(req, "group", 1));
    s.has_bias = opt_bool(req, "bias", true);
    s.relu     = opt_bool(req, "relu", false);
    s.actinfo  = parse_act(req, s.relu);
    if(st[0] <= 0 || st[1] <= 0 || dl[0] <= 0 || dl[1] <= 0 || s.group == 0)
        throw BadRequest("stride, dilation and group must be positive");
    for(auto p : pd)
        if(p < 0)
            throw BadRequest("pads must be >= 0");
    if(s.C % s.group != 0 || s.O % s.group != 0 || s.CI * s.group != s.C)
        throw BadRequest("inconsistent group: weights I*group must equal input C and O must divide by group");
    long long eh = static_cast<long long>(s.H + s.pt + s.pb) - static_cast<long long>(s.dh * (s.KH - 1) + 1);
    long long ew = static_cast<long long>(s.W + s.pl + s.pr) - static_cast<long long>(s.dw * (s.KW - 1) + 1);
    if(eh < 0 || ew < 0)
        throw BadRequest("kernel larger than padded input");
    s.OH = static_cast<size_t>(eh) / s.sh + 1;
    s.OW = static_cast<size_t>(ew) / s.sw + 1;
    return s;
}

struct ConvTensors
{
    Mapping    in_m, w_m, b_m, out_m;
    TensorInfo in_i, w_i, b_i, out_i;
};

ConvTensors tensor_infos(const Mapping &in, const Mapping &w, size_t channels, const Mapping &out, DataLayout layout)
{
    ConvTensors t{ in, w, map1(channels), out, {}, {}, {}, {} };
    t.in_i  = TensorInfo(t.in_m.acl_shape(), 1, DataType::F32, layout);
    t.w_i   = TensorInfo(t.w_m.acl_shape(), 1, DataType::F32, layout);
    t.b_i   = TensorInfo(t.b_m.acl_shape(), 1, DataType::F32, layout);
    t.out_i = TensorInfo(t.out_m.acl_shape(), 1, DataType::F32, layout);
    return t;
}

ConvTensors conv_infos(const ConvSpec &s, DataLayout layout, bool depthwise_weights)
{
    return tensor_infos(map4(s.in_dims(), layout), depthwise_weights ? map_dw_weights(s.w_dims(), layout) : map4(s.w_dims(), layout), s.O,
                        map4(s.out_dims(), layout), layout);
}

const std::vector<std::string> &all_methods()
{
    static const std::vector<std::string> m = { "GEMM", "WINOGRAD", "DIRECT", "FFT", "DEPTHWISE", "AUTO" };
    return m;
}

// Static validation of one (method, layout, fast_math) candidate. Returns OK or a reason.
Status validate_conv(const ConvSpec &s, const std::string &method, DataLayout layout, bool fast_math)
{
    const bool  dw     = method == "DEPTHWISE" || (method == "AUTO" && s.depthwise());
    ConvTensors t      = conv_infos(s, layout, dw);
    const auto *bias   = s.has_bias ? &t.b_i : nullptr;
    const bool  dilate = s.dh != 1 || s.dw != 1;
    if(method == "DEPTHWISE")
    {
        if(!s.depthwise())
            return Status(ErrorCode::RUNTIME_ERROR, "DEPTHWISE needs group == input channels (weights [C*m,1,kh,kw])");
        return NEDepthwiseConvolutionLayer::validate(&t.in_i, &t.w_i, bias, &t.out_i, s.pad_stride(), static_cast<unsigned>(s.O / s.C), s.act(), s.dilation());
    }
    if(method == "AUTO")
    {
        if(s.depthwise())
            return NEDepthwiseConvolutionLayer::validate(&t.in_i, &t.w_i, bias, &t.out_i, s.pad_stride(), static_cast<unsigned>(s.O / s.C), s.act(), s.dilation());
        return NEConvolutionLayer::validate(&t.in_i, &t.w_i, bias, &t.out_i, s.pad_stride(), WeightsInfo(), s.dilation(), s.act(), fast_math, static_cast<unsigned>(s.group));
    }
    if(method == "GEMM")
        return NEGEMMConvolutionLayer::validate(&t.in_i, &t.w_i, bias, &t.out_i, s.pad_stride(), WeightsInfo(), s.dilation(), s.act(), static_cast<unsigned>(s.group));
    // The remaining functions take neither groups nor dilation: refuse here rather than
    // silently computing something else.
    if(s.group != 1)
        return Status(ErrorCode::RUNTIME_ERROR, method + " does not support group > 1");
    if(dilate)
        return Status(ErrorCode::RUNTIME_ERROR, method + " does not support dilation");
    if(method == "WINOGRAD")
        return NEWinogradConvolutionLayer::validate(&t.in_i, &t.w_i, bias, &t.out_i, s.pad_stride(), s.act(), fast_math);
    if(method == "DIRECT")
        return NEDirectConvolutionLayer::validate(&t.in_i, &t.w_i, bias, &t.out_i, s.pad_stride(), s.act());
    if(method == "FFT")
    {
        // Measured with ACL 20.08 (see FINDINGS.md): validate() accepts these, but 1x1 kernels give
        // wrong results (at 2 threads always, at 1 thread for some shapes) and batch > 1 throws
        // "Invalid data type" in configure().
        if(s.KH == 1 && s.KW == 1)
            return Status(ErrorCode::RUNTIME_ERROR, "runner: FFT refused for 1x1 kernels (ACL 20.08 returns wrong results)");
        if(s.N > 1)
            return Status(ErrorCode::RUNTIME_ERROR, "runner: FFT refused for batch > 1 (ACL 20.08 configure() fails)");
        return NEFFTConvolutionLayer::validate(&t.in_i, &t.w_i, bias, &t.out_i, s.pad_stride(), s.act());
    }
    return Status(ErrorCode::RUNTIME_ERROR, "unknown method '" + method + "'");
}

Status safe_validate(const ConvSpec &s, const std::string &method, DataLayout layout, bool fast_math)
{
    try
    {
        return validate_conv(s, method, layout, fast_math);
    }
    catch(const std::exception &e)
    {
        return Status(ErrorCode::RUNTIME_ERROR, std::string("validate threw: ") + e.what());
    }
}

// What the library itself would do (NEConvolutionLayer's heuristic).
std::string acl_pick(const ConvSpec &s, DataLayout layout, bool fast_math)
{
    if(s.depthwise())
        return "DEPTHWISE";
    try
    {
        ConvTensors t = conv_infos(s, layout, false);
        if(!bool(NEConvolutionLayer::validate(&t.in_i, &t.w_i, s.has_bias ? &t.b_i : nullptr, &t.out_i, s.pad_stride(), WeightsInfo(), s.dilation(), s.act(), fast_math,
                                              static_cast<unsigned>(s.group))))
            return "NONE";
        return conv_method_name(NEConvolutionLayer::get_convolution_method(&t.in_i, &t.w_i, &t.out_i, s.pad_stride(), WeightsInfo(), s.dilation(), s.act(), fast_math));
    }
    catch(const std::exception &)
    {
        return "NONE";
    }
}

// Configure the ACL function of one conv method (tensors: initialised, not necessarily allocated).
std::unique_ptr<IFunction> make_conv(const ConvSpec &s, const std::string &method, bool fm, ITensor *in, ITensor *w, ITensor *bias, ITensor *out, const ConvTensors &ti, std::string *effective)
{
    const bool dw = method == "DEPTHWISE" || (method == "AUTO" && s.depthwise());
    *effective    = method;
    if(method == "GEMM")
    {
        auto f = std::make_unique<NEGEMMConvolutionLayer>();
        f->configure(in, w, bias, out, s.pad_stride(), WeightsInfo(), s.dilation(), s.act(), static_cast<unsigned>(s.group));
        return std::move(f);
    }
    if(method == "WINOGRAD")
    {
        auto f = std::make_unique<NEWinogradConvolutionLayer>();
        f->configure(in, w, bias, out, s.pad_stride(), s.act(), fm);
        return std::move(f);
    }
    if(method == "DIRECT")
    {
        auto f = std::make_unique<NEDirectConvolutionLayer>();
        f->configure(in, w, bias, out, s.pad_stride(), s.act());
        return std::move(f);
    }
    if(method == "FFT")
    {
        auto f = std::make_unique<NEFFTConvolutionLayer>();
        f->configure(in, w, bias, out, s.pad_stride(), s.act());
        return std::move(f);
    }
    if(dw)
    {
        auto f = std::make_unique<NEDepthwiseConvolutionLayer>();
        f->configure(in, w, bias, out, s.pad_stride(), static_cast<unsigned>(s.O / s.C), s.act(), s.dilation());
        *effective = "DEPTHWISE";
        return std::move(f);
    }
    // AUTO: NEConvolutionLayer, ACL's own choice
    *effective = conv_method_name(NEConvolutionLayer::get_convolution_method(&ti.in_i, &ti.w_i, &ti.out_i, s.pad_stride(), WeightsInfo(), s.dilation(), s.act(), fm));
    auto f     = std::make_unique<NEConvolutionLayer>();
    f->configure(in, w, bias, out, s.pad_stride(), WeightsInfo(), s.dilation(), s.act(), fm, static_cast<unsigned>(s.group));
    return std::move(f);
}

// The arm_gemm GEMMs a method would set up for this conv ("gemm" JSON section, "" if none):
// configures the function on unallocated tensors, nothing is computed.
std::string probe_gemms(const ConvSpec &s, const std::string &method, DataLayout layout, bool fm)
{
    const bool  dw = method == "DEPTHWISE" || (method == "AUTO" && s.depthwise());
    ConvTensors ti = conv_infos(s, layout, dw);
    Tensor      in, w, b, out;
    in.allocator()->init(ti.in_i);
    w.allocator()->init(ti.w_i);
    b.allocator()->init(ti.b_i);
    out.allocator()->init(ti.out_i);
    JVal cfg;
    cfg.type = JVal::OBJ;
    std::string effective, error;
    ext::begin_configure(cfg);
    try
    {
        std::unique_ptr<IFunction> fn = make_conv(s, method, fm, &in, &w, s.has_bias ? &b : nullptr, &out, ti, &effective);
    }
    catch(...)
    {
        ext::end_configure(cfg, &error);
        throw;
    }
    return ext::end_configure(cfg, &error);
}

std::string conv_validate(const JVal &req)
{
    ConvSpec    s          = parse_conv(req);
    const bool  with_gemms = opt_bool(req, "with_gemms", false);
    const JVal *cfg        = req.get("config");
    if(cfg != nullptr && cfg->type == JVal::OBJ)
    {
        int threads = 0;
        apply_cpu_config(*cfg, &threads); // threads / cpu_model shape arm_gemm's choices
    }
    std::string cands   = "[";
    bool        first   = true;
    std::string layouts = "{";
    for(DataLayout layout : { DataLayout::NCHW, DataLayout::NHWC })
    {
        for(const auto &m : all_methods())
        {
            for(bool fm : { false, true })
            {
                if(fm && m != "WINOGRAD" && m != "AUTO")
                    continue;
                Status st = safe_validate(s, m, layout, fm);
                Obj    o;
                o.str("method", m).str("layout", layout_name(layout)).boolean("fast_math", fm).boolean("ok", bool(st));
                if(!bool(st))
                    o.str("reason", st.error_description());
                else if(with_gemms && (m == "GEMM" || m == "WINOGRAD" || m == "AUTO"))
                {
                    try
                    {
                        std::string g = probe_gemms(s, m, layout, fm);
                        if(!g.empty())
                            o.raw("gemm", g);
                    }
                    catch(const std::exception &e)
                    {
                        o.str("gemm_error", e.what());
                    }
                }
                cands += (first ? "" : ",") + o.done();
                first = false;
            }
        }
        Obj pick;
        pick.str("fast_math_false", acl_pick(s, layout, false)).str("fast_math_true", acl_pick(s, layout, true));
        layouts += std::string(layout == DataLayout::NCHW ? "" : ",") + jstr(layout_name(layout)) + ":" + pick.done();
    }
    cands += "]";
    layouts += "}";
    Obj out;
    out.boolean("ok", true)
        .str("action", "validate")
        .str("op", "conv")
        .raw("output", jints(s.out_dims()))
        .boolean("depthwise", s.depthwise())
        .raw("candidates", cands)
        .raw("acl_pick", layouts);
    return out.done();
}

struct Timing
{
    double              configure_us{ 0 };
    double              prepare_us{ 0 };
    std::vector<double> warmup_us;
    std::vector<double> times_us;
};

using Clock = std::chrono::steady_clock;
double us_since(Clock::time_point t0)
{
    return std::chrono::duration<double, std::micro>(Clock::now() - t0).count();
}

// Repeats until min_repeats are done and their sum reaches min_time_ms; then, when stable_within is
// given (> 0), continues until the medians of the first and second half of the samples agree within
// that fraction, or max_time_ms / max_repeats is reached (the same rule as kselect's core).
bool keep_timing(const std::vector<double> &times, double total, long long min_repeats, long long max_repeats, double min_time_us, double max_time_us, double stable)
{
    const long long n = static_cast<long long>(times.size());
    if(n >= max_repeats)
        return false;
    if(n < min_repeats || total < min_time_us)
        return true;
    if(stable <= 0)
        return false;
    if(max_time_us > 0 && total >= max_time_us)
        return false;
    if(n < 4)
        return true;
    const size_t        half = times.size() / 2;
    std::vector<double> a(times.begin(), times.begin() + half), b(times.begin() + half, times.end());
    const double        m = ext::median(times);
    return std::fabs(ext::median(a) - ext::median(b)) > stable * m;
}

void time_function(IFunction &f, const JVal &req, Timing &tm)
{
    const long long warmup      = std::max<long long>(0, opt_int(req, "warmup", 1));
    const long long min_repeats = std::max<long long>(1, opt_int(req, "min_repeats", 5));
    const long long max_repeats = std::max<long long>(min_repeats, opt_int(req, "max_repeats", 100000));
    const double    min_time_us = 1000.0 * opt_num(req, "min_time_ms", 0.0);
    const double    max_time_us = 1000.0 * opt_num(req, "max_time_ms", 0.0);
    const double    stable      = opt_num(req, "stable_within", 0.0);

    auto t0 = Clock::now();
    f.prepare(); // weight transformations: not kernel time of a steady-state inference
    tm.prepare_us = us_since(t0);
    for(long long i = 0; i < warmup; ++i)
    {
        auto t = Clock::now();
        f.run();
        tm.warmup_us.push_back(us_since(t));
    }
    ext::begin_timed_phase();
    double total = 0;
    while(keep_timing(tm.times_us, total, min_repeats, max_repeats, min_time_us, max_time_us, stable))
    {
        ext::begin_run();
        auto t = Clock::now();
        f.run();
        double d = us_since(t);
        tm.times_us.push_back(d);
        total += d;
    }
    ext::end_timed_phase();
}

std::string times_json(const std::vector<double> &v)
{
    std::string out = "[";
    for(size_t i = 0; i < v.size(); ++i)
        out += (i ? "," : "") + jnum3(v[i]);
    return out + "]";
}

void add_timing(Obj &o, const Timing &tm)
{
    std::vector<double> sorted = tm.times_us;
    std::sort(sorted.begin(), sorted.end());
    double median = sorted.empty() ? 0 : (sorted.size() % 2 ? sorted[sorted.size() / 2] : 0.5 * (sorted[sorted.size() / 2 - 1] + sorted[sorted.size() / 2]));
    o.num("configure_us", tm.configure_us)
        .num("prepare_us", tm.prepare_us)
        .raw("warmup_us", times_json(tm.warmup_us))
        .raw("times_us", times_json(tm.times_us))
        .num("median_us", median)
        .num("min_us", sorted.empty() ? 0 : sorted.front());
}

// A configured conv-like function's tensors allocated and filled (files named by the request, else
// seeded random data), the function timed, its output saved: the rest of a conv or deconv "run".
void fill_time_and_save(IFunction &fn, const JVal &req, const ConvTensors &ti, Tensor &in, Tensor &w, Tensor *bias, Tensor &out, Timing &tm)
{
    in.allocator()->allocate();
    w.allocator()->allocate();
    if(bias != nullptr)
        bias->allocator()->allocate();
    out.allocator()->allocate();
    const uint32_t     seed = static_cast<uint32_t>(opt_int(req, "seed", 1));
    std::vector<float> vin  = load_or_random(req, "input_path", ti.in_m.count(), seed);
    std::vector<float> vw   = load_or_random(req, "weights_path", ti.w_m.count(), seed + 1);
    copy_logical<true>(in, ti.in_m, vin.data());
    copy_logical<true>(w, ti.w_m, vw.data());
    if(bias != nullptr)
    {
        std::vector<float> vb = load_or_random(req, "bias_path", ti.b_m.count(), seed + 2);
        copy_logical<true>(*bias, ti.b_m, vb.data());
    }
    time_function(fn, req, tm);
    save_output(req, out, ti.out_m);
}

std::string conv_run(const JVal &req)
{
    ConvSpec    s      = parse_conv(req);
    const JVal *cfgp   = req.get("config");
    JVal        empty;
    empty.type         = JVal::OBJ;
    const JVal &cfg    = cfgp ? *cfgp : empty;
    std::string method = upper(opt_str(cfg, "method", "AUTO"));
    DataLayout  layout = parse_layout(opt_str(cfg, "layout", "NCHW"));
    bool        fm     = opt_bool(cfg, "fast_math", false);
    if(std::find(all_methods().begin(), all_methods().end(), method) == all_methods().end())
        throw BadRequest("unknown method '" + method + "'");

    int threads = 0;
    apply_cpu_config(cfg, &threads);

    Status st = safe_validate(s, method, layout, fm);
    if(!bool(st))
    {
        Obj o;
        o.boolean("ok", false).str("action", "run").str("error_kind", "unsupported").str("error", method + "/" + layout_name(layout) + " rejected by validate(): " + st.error_description());
        return o.done();
    }

    const bool  dw = method == "DEPTHWISE" || (method == "AUTO" && s.depthwise());
    ConvTensors ti = conv_infos(s, layout, dw);
    Tensor      in, w, b, out;
    in.allocator()->init(ti.in_i);
    w.allocator()->init(ti.w_i);
    b.allocator()->init(ti.b_i);
    out.allocator()->init(ti.out_i);
    Tensor *bias = s.has_bias ? &b : nullptr;

    Timing tm;
    std::string effective;
    ext::begin_configure(cfg);
    auto                       t0 = Clock::now();
    std::unique_ptr<IFunction> fn = make_conv(s, method, fm, &in, &w, bias, &out, ti, &effective);
    tm.configure_us = us_since(t0);
    std::string gemm_error;
    std::string configure_ext = ext::end_configure(cfg, &gemm_error);
    if(!gemm_error.empty())
    {
        Obj o;
        o.boolean("ok", false).str("action", "run").str("error_kind", "unsupported").str("error", gemm_error).raw("gemm", configure_ext);
        return o.done();
    }

    fill_time_and_save(*fn, req, ti, in, w, s.has_bias ? &b : nullptr, out, tm);

    Obj o;
    o.boolean("ok", true)
        .str("action", "run")
        .str("op", "conv")
        .str("method", method)
        .str("effective_method", effective)
        .str("layout", layout_name(layout))
        .boolean("fast_math", fm)
        .integer("threads", threads)
        .raw("cpu_models", cpu_models_json())
        .raw("output", jints(s.out_dims()));
    add_timing(o, tm);
    if(!configure_ext.empty())
        o.raw("gemm", configure_ext);
    std::string sched = ext::scheduler_report();
    if(!sched.empty())
        o.raw("scheduler", sched);
    return o.done();
}

// ---------------------------------------------------------------------------------------------
// Layout change: one NEPermute of a rank-4 activation, what the engine inserts where a step needs
// its input in the other layout (Net::get). Input and output files are logical NCHW, as for conv.
// ---------------------------------------------------------------------------------------------
std::string permute_run(const JVal &req)
{
    std::vector<long long> in = int_list(req, "input", 4, {});
    if(in.size() != 4)
        throw BadRequest("permute: 'input' must be [N,C,H,W]");
    std::vector<size_t> dims;
    for(long long d : in)
    {
        if(d <= 0)
            throw BadRequest("permute: 'input' dims must be positive");
        dims.push_back(static_cast<size_t>(d));
    }
    const JVal *cfgp = req.get("config");
    JVal        empty;
    empty.type        = JVal::OBJ;
    const JVal &cfg   = cfgp ? *cfgp : empty;
    DataLayout  from  = parse_layout(opt_str(cfg, "from", "NCHW"));
    DataLayout  to    = parse_layout(opt_str(cfg, "layout", "NHWC"));
    if(from == to)
        throw BadRequest("permute: 'from' and 'layout' are the same layout");
    int threads = 0;
    apply_cpu_config(cfg, &threads);

    Mapping in_m = map4(dims, from), out_m = map4(dims, to);
    Tensor  src, dst;
    src.allocator()->init(TensorInfo(in_m.acl_shape(), 1, DataType::F32, from));
    dst.allocator()->init(TensorInfo(out_m.acl_shape(), 1, DataType::F32, to));
    PermutationVector pv = permutation_to(to);
    Status            st = NEPermute::validate(src.info(), dst.info(), pv);
    if(!bool(st))
    {
        Obj o;
        o.boolean("ok", false).str("action", "run").str("error_kind", "unsupported").str("error", "NEPermute::validate(): " + st.error_description());
        return o.done();
    }
    Timing    tm;
    auto      t0 = Clock::now();
    NEPermute fn;
    fn.configure(&src, &dst, pv);
    tm.configure_us = us_since(t0);
    src.allocator()->allocate();
    dst.allocator()->allocate();
    std::vector<float> vin = load_or_random(req, "input_path", in_m.count(), static_cast<uint32_t>(opt_int(req, "seed", 1)));
    copy_logical<true>(src, in_m, vin.data());
    time_function(fn, req, tm);
    save_output(req, dst, out_m);
    Obj o;
    o.boolean("ok", true).str("action", "run").str("op", "permute").str("from", layout_name(from)).str("layout", layout_name(to)).integer("threads", threads).raw("output", jints(dims));
    add_timing(o, tm);
    return o.done();
}

// ---------------------------------------------------------------------------------------------
// Fully connected: input (N,K), weights (M,K) as in ONNX Gemm(transB=1) / torch Linear, bias (M)
// ---------------------------------------------------------------------------------------------
struct FcSpec
{
    size_t N, K, M;
    bool   has_bias, relu;
};
FcSpec parse_fc(const JVal &req)
{
    auto in = int_list(req, "input", 2, {});
    auto w  = int_list(req, "weights", 2, {});
    if(in.empty() || w.empty())
        throw BadRequest("fc needs 'input' [N,K] and 'weights' [M,K]");
    if(in[1] != w[1])
        throw BadRequest("fc: input K and weights K differ");
    if(in[0] <= 0 || in[1] <= 0 || w[0] <= 0)
        throw BadRequest("fc dims must be positive");
    return FcSpec{ static_cast<size_t>(in[0]), static_cast<size_t>(in[1]), static_cast<size_t>(w[0]), opt_bool(req, "bias", true), opt_bool(req, "relu", false) };
}

std::string fc_request(const JVal &req, bool run)
{
    FcSpec      s      = parse_fc(req);
    const JVal *cfgp   = req.get("config");
    JVal        empty;
    empty.type         = JVal::OBJ;
    const JVal &cfg    = cfgp ? *cfgp : empty;
    Mapping     in_m   = map2(s.N, s.K);
    Mapping     w_m    = map2(s.M, s.K); // ACL shape (K, M): transposed by the function (transpose_weights=true)
    Mapping     b_m    = map1(s.M);
    Mapping     out_m  = map2(s.N, s.M);
    TensorInfo  in_i(in_m.acl_shape(), 1, DataType::F32), w_i(w_m.acl_shape(), 1, DataType::F32), b_i(b_m.acl_shape(), 1, DataType::F32), out_i(out_m.acl_shape(), 1, DataType::F32);
    FullyConnectedLayerInfo fc_info;
    if(s.relu)
        fc_info.activation_info = ActivationLayerInfo(ActivationLayerInfo::ActivationFunction::RELU);
    Status st;
    try
    {
        st = NEFullyConnectedLayer::validate(&in_i, &w_i, s.has_bias ? &b_i : nullptr, &out_i, fc_info);
    }
    catch(const std::exception &e)
    {
        st = Status(ErrorCode::RUNTIME_ERROR, std::string("validate threw: ") + e.what());
    }
    if(!run)
    {
        Obj c;
        c.str("method", "FC").boolean("ok", bool(st));
        if(!bool(st))
            c.str("reason", st.error_description());
        else if(opt_bool(req, "with_gemms", false))
        {
            if(cfgp != nullptr && cfgp->type == JVal::OBJ)
            {
                int threads = 0;
                apply_cpu_config(cfg, &threads);
            }
            Tensor pin, pw, pb, pout;
            pin.allocator()->init(in_i);
            pw.allocator()->init(w_i);
            pb.allocator()->init(b_i);
            pout.allocator()->init(out_i);
            JVal nocfg;
            nocfg.type = JVal::OBJ;
            std::string error;
            ext::begin_configure(nocfg);
            try
            {
                NEFullyConnectedLayer probe;
                probe.configure(&pin, &pw, s.has_bias ? &pb : nullptr, &pout, fc_info);
            }
            catch(const std::exception &e)
            {
                c.str("gemm_error", e.what());
            }
            std::string g = ext::end_configure(nocfg, &error);
            if(!g.empty())
                c.raw("gemm", g);
        }
        Obj o;
        o.boolean("ok", true).str("action", "validate").str("op", "fc").raw("output", jints(std::vector<size_t>{ s.N, s.M })).raw("candidates", "[" + c.done() + "]");
        return o.done();
    }
    int threads = 0;
    apply_cpu_config(cfg, &threads);
    if(!bool(st))
    {
        Obj o;
        o.boolean("ok", false).str("action", "run").str("error_kind", "unsupported").str("error", "NEFullyConnectedLayer::validate(): " + st.error_description());
        return o.done();
    }
    Tensor in, w, b, out;
    in.allocator()->init(in_i);
    w.allocator()->init(w_i);
    b.allocator()->init(b_i);
    out.allocator()->init(out_i);
    Timing tm;
    ext::begin_configure(cfg);
    auto                  t0 = Clock::now();
    NEFullyConnectedLayer fc;
    fc.configure(&in, &w, s.has_bias ? &b : nullptr, &out, fc_info);
    tm.configure_us = us_since(t0);
    std::string gemm_error;
    std::string configure_ext = ext::end_configure(cfg, &gemm_error);
    if(!gemm_error.empty())
    {
        Obj o;
        o.boolean("ok", false).str("action", "run").str("error_kind", "unsupported").str("error", gemm_error).raw("gemm", configure_ext);
        return o.done();
    }
    in.allocator()->allocate();
    w.allocator()->allocate();
    b.allocator()->allocate();
    out.allocator()->allocate();
    const uint32_t     seed = static_cast<uint32_t>(opt_int(req, "seed", 1));
    std::vector<float> vin  = load_or_random(req, "input_path", in_m.count(), seed);
    std::vector<float> vw   = load_or_random(req, "weights_path", w_m.count(), seed + 1);
    copy_logical<true>(in, in_m, vin.data());
    copy_logical<true>(w, w_m, vw.data());
    if(s.has_bias)
    {
        std::vector<float> vb = load_or_random(req, "bias_path", s.M, seed + 2);
        copy_logical<true>(b, b_m, vb.data());
    }
    time_function(fc, req, tm);
    save_output(req, out, out_m);
    Obj o;
    o.boolean("ok", true).str("action", "run").str("op", "fc").str("method", "FC").str("effective_method", "FC").integer("threads", threads).raw("cpu_models", cpu_models_json()).raw("output", jints(std::vector<size_t>{ s.N, s.M }));
    add_timing(o, tm);
    if(!configure_ext.empty())
        o.raw("gemm", configure_ext);
    std::string sched = ext::scheduler_report();
    if(!sched.empty())
        o.raw("scheduler", sched);
    return o.done();
}

// ---------------------------------------------------------------------------------------------
// Transposed convolution (ONNX ConvTranspose) with NEDeconvolutionLayer: "input" [N,C,H,W],
// "weights" [O,C,KH,KW] in ACL's [OFM, IFM] order (the caller transposes ONNX's [C, O, KH, KW]),
// "stride", "pads" [top, left, bottom, right] cropped from the output as in ONNX, "bias".
// ACL 20.08 takes square kernels, no groups, no dilation and no output padding; it picks the
// convolution method itself, so a config is a layout and a schedule.
// ---------------------------------------------------------------------------------------------
struct DeconvSpec
{
    size_t N, C, H, W, O, KH, KW, sh, sw, pt, pl, pb, pr, OH, OW;
    bool   has_bias;

    PadStrideInfo pad_stride() const
    {
        return PadStrideInfo(static_cast<unsigned>(sw), static_cast<unsigned>(sh), static_cast<unsigned>(pl), static_cast<unsigned>(pr), static_cast<unsigned>(pt), static_cast<unsigned>(pb),
                             DimensionRoundingType::FLOOR);
    }
    std::vector<size_t> in_dims() const { return { N, C, H, W }; }
    std::vector<size_t> w_dims() const { return { O, C, KH, KW }; }
    std::vector<size_t> out_dims() const { return { N, O, OH, OW }; }
};

DeconvSpec parse_deconv(const JVal &req)
{
    auto in = int_list(req, "input", 4, {});
    auto w  = int_list(req, "weights", 4, {});
    if(in.empty() || w.empty())
        throw BadRequest("deconv needs 'input' [N,C,H,W] and 'weights' [O,C,KH,KW]");
    for(auto v : in)
        if(v <= 0)
            throw BadRequest("input dims must be positive");
    for(auto v : w)
        if(v <= 0)
            throw BadRequest("weights dims must be positive");
    if(w[1] != in[1])
        throw BadRequest("deconv: weights [O,C,KH,KW] must have the input's C (ACL runs no grouped deconvolution)");
    auto st = int_list(req, "stride", 2, { 1, 1 });
    auto pd = int_list(req, "pads", 4, { 0, 0, 0, 0 });
    if(st[0] <= 0 || st[1] <= 0)
        throw BadRequest("stride must be positive");
    for(auto p : pd)
        if(p < 0)
            throw BadRequest("pads must be >= 0");
    DeconvSpec s{};
    s.N = in[0], s.C = in[1], s.H = in[2], s.W = in[3];
    s.O = w[0], s.KH = w[2], s.KW = w[3];
    s.sh = st[0], s.sw = st[1];
    s.pt = pd[0], s.pl = pd[1], s.pb = pd[2], s.pr = pd[3];
    s.has_bias = opt_bool(req, "bias", true);
    long long oh = static_cast<long long>(s.sh * (s.H - 1) + s.KH) - static_cast<long long>(s.pt + s.pb);
    long long ow = static_cast<long long>(s.sw * (s.W - 1) + s.KW) - static_cast<long long>(s.pl + s.pr);
    if(oh <= 0 || ow <= 0)
        throw BadRequest("deconv: pads larger than the output");
    s.OH = static_cast<size_t>(oh);
    s.OW = static_cast<size_t>(ow);
    return s;
}

ConvTensors deconv_infos(const DeconvSpec &s, DataLayout layout)
{
    return tensor_infos(map4(s.in_dims(), layout), map4(s.w_dims(), layout), s.O, map4(s.out_dims(), layout), layout);
}

Status validate_deconv(const DeconvSpec &s, DataLayout layout)
{
    try
    {
        ConvTensors t = deconv_infos(s, layout);
        return NEDeconvolutionLayer::validate(&t.in_i, &t.w_i, s.has_bias ? &t.b_i : nullptr, &t.out_i, s.pad_stride());
    }
    catch(const std::exception &e)
    {
        return Status(ErrorCode::RUNTIME_ERROR, std::string("validate threw: ") + e.what());
    }
}

std::string deconv_request(const JVal &req, bool run)
{
    DeconvSpec s = parse_deconv(req);
    if(!run)
    {
        std::string cands = "[";
        for(DataLayout layout : { DataLayout::NCHW, DataLayout::NHWC })
        {
            Status st = validate_deconv(s, layout);
            Obj    o;
            o.str("method", "DECONV").str("layout", layout_name(layout)).boolean("fast_math", false).boolean("ok", bool(st));
            if(!bool(st))
                o.str("reason", st.error_description());
            cands += std::string(layout == DataLayout::NCHW ? "" : ",") + o.done();
        }
        Obj out;
        out.boolean("ok", true).str("action", "validate").str("op", "deconv").raw("output", jints(s.out_dims())).boolean("depthwise", false).raw("candidates", cands + "]");
        return out.done();
    }
    const JVal *cfgp    = req.get("config");
    JVal        empty;
    empty.type          = JVal::OBJ;
    const JVal &cfg     = cfgp ? *cfgp : empty;
    DataLayout  layout  = parse_layout(opt_str(cfg, "layout", "NCHW"));
    int         threads = 0;
    apply_cpu_config(cfg, &threads);
    Status st = validate_deconv(s, layout);
    if(!bool(st))
    {
        Obj o;
        o.boolean("ok", false).str("action", "run").str("error_kind", "unsupported").str("error", "NEDeconvolutionLayer/" + layout_name(layout) + " rejected by validate(): " + st.error_description());
        return o.done();
    }
    ConvTensors ti = deconv_infos(s, layout);
    Tensor      in, w, b, out;
    in.allocator()->init(ti.in_i);
    w.allocator()->init(ti.w_i);
    b.allocator()->init(ti.b_i);
    out.allocator()->init(ti.out_i);
    Timing tm;
    ext::begin_configure(cfg);
    auto                 t0 = Clock::now();
    NEDeconvolutionLayer fn;
    fn.configure(&in, &w, s.has_bias ? &b : nullptr, &out, s.pad_stride());
    tm.configure_us = us_since(t0);
    std::string error;
    std::string configure_ext = ext::end_configure(cfg, &error);
    fill_time_and_save(fn, req, ti, in, w, s.has_bias ? &b : nullptr, out, tm);
    Obj o;
    o.boolean("ok", true).str("action", "run").str("op", "deconv").str("method", "DECONV").str("effective_method", "DECONV").str("layout", layout_name(layout)).integer("threads", threads).raw("cpu_models", cpu_models_json()).raw("output", jints(s.out_dims()));
    add_timing(o, tm);
    if(!configure_ext.empty())
        o.raw("gemm", configure_ext);
    std::string sched = ext::scheduler_report();
    if(!sched.empty())
        o.raw("scheduler", sched);
    return o.done();
}

// ---------------------------------------------------------------------------------------------
// Whole-model engine (actions model_load / model_run / model_free; see PROTOCOL.md). A graph
// description written by kselect (nodes in topological order, shapes, weight files, one config per
// conv / fc) becomes a list of configured ACL functions that stays alive between runs. Each conv
// and fc runs with its own method, layout, GEMM kernel, CPU model, threads and scheduler; NEPermute
// steps are inserted where neighbouring ops use different layouts. Other ops run with ACL's
// functions in their input's layout, with the graph's default threads and ACL's scheduler.
// ---------------------------------------------------------------------------------------------
namespace model
{
struct Ctx // how one step is scheduled
{
    bool                        split{ false };
    unsigned                    threads{ 1 };
    std::vector<double>         ratios;
    std::vector<int>            pin;
    std::vector<CPUModel>       models; // per cpu; empty = the detected models
    std::shared_ptr<IScheduler> sched;
    ext::SplitScheduler        *splitter{ nullptr };
    std::string                 key;
};

struct MT // one tensor in one layout
{
    std::string             name;
    std::vector<size_t>     dims; // logical
    DataLayout              layout{ DataLayout::NCHW };
    Mapping                 m;
    std::unique_ptr<Tensor> t;
};

struct Step
{
    std::string                node, op;
    std::unique_ptr<IFunction> fn;
    size_t                     ctx{ 0 };
    std::string                report; // JSON object (conv / fc) or ""
    std::vector<double>        us;     // per timed run (profile)
    // Tensors whose padding this step cannot absorb after its configure(), with the padding it saw
    // ("in" / "out" role); see Net::padding_conflicts().
    std::vector<std::tuple<std::string, MT *, PaddingSize>> watch;
};

struct Constant
{
    MT         *mt;
    std::string path;
    uint32_t    seed;
};

const JVal &obj_or_empty(const JVal &o, const std::string &k)
{
    static JVal empty = [] {
        JVal e;
        e.type = JVal::OBJ;
        return e;
    }();
    const JVal *v = o.get(k);
    if(v == nullptr || v->type == JVal::NUL)
        return empty;
    if(v->type != JVal::OBJ)
        throw BadRequest("'" + k + "' must be an object");
    return *v;
}
std::vector<std::string> str_list(const JVal &o, const std::string &k)
{
    const JVal *v = o.get(k);
    if(v == nullptr || v->type != JVal::ARR)
        throw BadRequest("'" + k + "' must be a list of strings");
    std::vector<std::string> out;
    for(const auto &e : v->a)
    {
        if(e.type != JVal::STR)
            throw BadRequest("'" + k + "' must be a list of strings");
        out.push_back(e.s);
    }
    return out;
}
std::vector<size_t> dims_of(const JVal &o, const std::string &k)
{
    std::vector<size_t> out;
    for(auto v : int_list(o, k, 0, {}))
    {
        if(v <= 0)
            throw BadRequest("'" + k + "' dims must be positive");
        out.push_back(static_cast<size_t>(v));
    }
    if(out.empty())
        throw BadRequest("missing '" + k + "'");
    return out;
}
std::string dims_str(const std::vector<size_t> &d)
{
    std::string s;
    for(size_t i = 0; i < d.size(); ++i)
        s += (i ? "x" : "") + std::to_string(d[i]);
    return s;
}

CPUModel parse_cpu_model(const std::string &name)
{
    std::string u = upper(name);
    for(const auto &kv : cpu_models())
        if(kv.first == u)
            return kv.second;
    throw BadRequest("unknown cpu_model '" + name + "'");
}

class Net
{
public:
    std::vector<std::unique_ptr<MT>>                          tensors;
    std::map<std::string, MT *>                               by_key;   // name|layout
    std::map<std::string, MT *>                               first;    // name -> first version made
    std::vector<Step>                                         steps;
    std::vector<Ctx>                                          ctxs;
    std::map<unsigned, std::shared_ptr<IScheduler>>           cpp;      // ACL CPPScheduler per thread count
    std::map<std::string, std::shared_ptr<ext::SplitScheduler>> splitters; // per thread count + pinning
    std::vector<std::string>                                  inputs, outputs;
    std::vector<Constant>                                     constants;
    size_t                                                    permutes{ 0 }, copies{ 0 };
    double                                                    configure_us{ 0 }, prepare_us{ 0 };
    std::set<std::string>                                     isolate; // "node|in" / "node|out": give the step a private tensor
    std::string                                               base_dir{ "." }; // relative weight paths start here

    std::string resolve(const std::string &path) const
    {
        return path.empty() || path[0] == '/' ? path : base_dir + "/" + path;
    }

    static std::string lkey(const std::string &name, size_t rank, DataLayout l)
    {
        return name + "|" + (rank == 4 ? layout_name(l) : std::string("-"));
    }

    MT &add_tensor(const std::string &name, const std::vector<size_t> &dims, const Mapping &m, DataLayout layout, bool is_constant = false)
    {
        const std::string key = is_constant ? name : lkey(name, dims.size(), layout);
        if(by_key.count(key))
            throw BadRequest("tensor '" + name + "' is produced twice");
        auto mt    = std::make_unique<MT>();
        mt->name   = name;
        mt->dims   = dims;
        mt->layout = layout;
        mt->m      = m;
        mt->t      = std::make_unique<Tensor>();
        mt->t->allocator()->init(TensorInfo(m.acl_shape(), 1, DataType::F32, layout));
        MT *p = mt.get();
        tensors.push_back(std::move(mt));
        by_key[key] = p;
        if(!is_constant && !first.count(name))
            first[name] = p;
        return *p;
    }
    static Mapping map_for(const std::vector<size_t> &dims, DataLayout layout)
    {
        if(dims.size() == 4)
            return map4(dims, layout);
        if(dims.size() == 2)
            return map2(dims[0], dims[1]);
        if(dims.size() == 1)
            return map1(dims[0]);
        throw BadRequest("tensors must have rank 1, 2 or 4 (got " + dims_str(dims) + ")");
    }
    MT &add_activation(const std::string &name, const std::vector<size_t> &dims, DataLayout layout)
    {
        return add_tensor(name, dims, map_for(dims, layout), layout);
    }
    MT &add_const(const std::string &name, const std::vector<size_t> &dims, const Mapping &m, DataLayout layout, const std::string &path, uint32_t seed)
    {
        MT &mt = add_tensor(name, dims, m, layout, true);
        constants.push_back(Constant{ &mt, path, seed });
        return mt;
    }
    MT &any(const std::string &name)
    {
        auto it = first.find(name);
        if(it == first.end())
            throw BadRequest("tensor '" + name + "' is used before it is produced");
        return *it->second;
    }
    // The tensor in the wanted layout; a NEPermute step (run in ctx) makes it when needed.
    MT &get(const std::string &name, DataLayout want, size_t ctx)
    {
        MT &src = any(name);
        if(src.dims.size() != 4)
            return src;
        auto it = by_key.find(lkey(name, 4, want));
        if(it != by_key.end())
            return *it->second;
        MT               &dst = add_tensor(name, src.dims, map4(src.dims, want), want);
        PermutationVector pv  = permutation_to(want);
        Status            st  = NEPermute::validate(src.t->info(), dst.t->info(), pv);
        if(!bool(st))
            throw Unsupported("NEPermute of '" + name + "' rejected: " + st.error_description());
        auto f = std::make_unique<NEPermute>();
        f->configure(src.t.get(), dst.t.get(), pv);
        Step s;
        s.node = "permute:" + name + ":" + layout_name(want);
        s.op   = "permute";
        s.fn   = std::move(f);
        s.ctx  = ctx;
        steps.push_back(std::move(s));
        ++permutes;
        return dst;
    }

    // A private copy of src (NECopy step in ctx), for a step that must not share src's padding.
    MT &private_tensor(const MT &like, const std::string &tag)
    {
        return add_tensor(like.name + "#" + tag, like.dims, like.m, like.layout, true);
    }
    void add_copy(MT &from, MT &to, const std::string &node, size_t ctx)
    {
        Status st = NECopy::validate(from.t->info(), to.t->info());
        if(!bool(st))
            throw Unsupported("NECopy for '" + node + "' rejected: " + st.error_description());
        auto f = std::make_unique<NECopy>();
        f->configure(from.t.get(), to.t.get());
        Step s;
        s.node = "copy:" + node;
        s.op   = "copy";
        s.fn   = std::move(f);
        s.ctx  = ctx;
        steps.push_back(std::move(s));
        ++copies;
    }
    // ACL functions are configured before any tensor is allocated, and a later consumer may extend
    // the padding of a tensor an earlier step was configured with. Most kernels read strides at run
    // time, but a GEMM convolution in NHWC views its (W,H) plane as the GEMM's M rows and goes
    // wrong when padding appears there afterwards. Returns the "node|role" pairs where it did.
    std::set<std::string> padding_conflicts() const
    {
        std::set<std::string> out;
        for(const auto &s : steps)
            for(const auto &w : s.watch)
            {
                const PaddingSize now = std::get<1>(w)->t->info()->padding();
                const PaddingSize then = std::get<2>(w);
                if(now.top != then.top || now.bottom != then.bottom || now.left != then.left || now.right != then.right)
                    out.insert(s.node + "|" + std::get<0>(w));
            }
        return out;
    }

    // -- execution contexts -------------------------------------------------------------------------
    size_t ctx_of(const JVal &cfg, size_t dflt)
    {
        Ctx c;
        const Ctx *base = ctxs.empty() ? nullptr : &ctxs[dflt];
        long long  th   = opt_int(cfg, "threads", base ? static_cast<long long>(base->threads) : 0);
        if(th < 0)
            throw BadRequest("threads must be >= 0");
        c.threads         = th > 0 ? static_cast<unsigned>(th) : std::max(1u, std::thread::hardware_concurrency());
        std::string sched = opt_str(cfg, "scheduler", cfg.get("threads") == nullptr && base ? (base->split ? "split" : "default") : "default");
        if(sched == "split")
        {
            c.split  = true;
            c.ratios = ext::num_list(cfg, "split_ratios");
            if(!c.ratios.empty() && c.ratios.size() != c.threads)
                throw BadRequest("split_ratios needs one entry per thread (" + std::to_string(c.threads) + ")");
            for(double x : c.ratios)
                if(!(x >= 0))
                    throw BadRequest("split_ratios must be >= 0");
            const JVal *p = cfg.get("pin_threads");
            if(p != nullptr && p->type == JVal::BOOL && p->b)
                for(unsigned t = 0; t < c.threads; ++t)
                    c.pin.push_back(static_cast<int>(t));
            else if(p != nullptr && p->type == JVal::ARR)
            {
                for(const auto &e : p->a)
                    c.pin.push_back(static_cast<int>(as_int(e, "pin_threads")));
                if(c.pin.size() != c.threads)
                    throw BadRequest("pin_threads needs one cpu per thread");
            }
        }
        else if(sched != "default")
            throw BadRequest("model steps use scheduler default or split, not '" + sched + "'");
        std::string model = opt_str(cfg, "cpu_model", "");
        if(!model.empty() && upper(model) != "DETECTED")
            c.models.assign(g_cpu.original.size(), parse_cpu_model(model));
        // key
        std::ostringstream k;
        k << (c.split ? "split" : "acl") << "/" << c.threads << "/";
        for(double r : c.ratios)
            k << r << ",";
        k << "/";
        for(int p : c.pin)
            k << p << ",";
        k << "/" << (c.models.empty() ? std::string("detected") : cpu_model_str(c.models[0]));
        c.key = k.str();
        for(size_t i = 0; i < ctxs.size(); ++i)
            if(ctxs[i].key == c.key)
                return i;
        if(c.split)
        {
            std::string sk = std::to_string(c.threads) + "/";
            for(int p : c.pin)
                sk += std::to_string(p) + ",";
            auto it = splitters.find(sk);
            if(it == splitters.end())
                it = splitters.emplace(sk, std::make_shared<ext::SplitScheduler>(c.threads, c.ratios, c.pin)).first;
            c.splitter = it->second.get();
            c.sched    = it->second;
        }
        else
        {
            auto it = cpp.find(c.threads);
            if(it == cpp.end())
            {
                auto s = std::make_shared<CPPScheduler>();
                s->set_num_threads(c.threads);
                it = cpp.emplace(c.threads, s).first;
            }
            c.sched = it->second;
        }
        ctxs.push_back(std::move(c));
        return ctxs.size() - 1;
    }
    void activate(size_t i)
    {
        Ctx &c = ctxs[i];
        if(c.splitter != nullptr)
            c.splitter->set_ratios(c.ratios);
        Scheduler::set(c.sched);
        CPUInfo &ci = c.sched->cpu_info();
        for(unsigned cpu = 0; cpu < ci.get_cpu_num(); ++cpu)
        {
            if(!c.models.empty())
                ci.set_cpu_model(cpu, c.models[0]);
            else if(cpu < g_cpu.original.size())
                ci.set_cpu_model(cpu, g_cpu.original[cpu]);
        }
    }
    std::string ctx_json(size_t i) const
    {
        const Ctx  &c = ctxs[i];
        std::string r = "[";
        for(size_t t = 0; t < c.ratios.size(); ++t)
            r += (t ? "," : "") + jnum(c.ratios[t]);
        Obj o;
        o.integer("threads", c.threads).str("scheduler", c.split ? "split" : "default").raw("split_ratios", r + "]").str("cpu_model", c.models.empty() ? "detected" : cpu_model_str(c.models[0]));
        return o.done();
    }
};

std::map<std::string, std::unique_ptr<Net>> g_nets;

// Leave ACL's global scheduler as the runner's single-op requests expect it.
void release_schedulers()
{
    Scheduler::set(std::make_shared<ext::RecordingScheduler>(*ext::g_cpp)); // drops the reference to a net's scheduler
    Scheduler::set(Scheduler::Type::CPP);
    ext::restore_main_affinity();
}

void add_step(Net &n, const std::string &node, const std::string &op, std::unique_ptr<IFunction> fn, size_t ctx, const std::string &report = "")
{
    Step s;
    s.node   = node;
    s.op     = op;
    s.fn     = std::move(fn);
    s.ctx    = ctx;
    s.report = report;
    n.steps.push_back(std::move(s));
}

void add_act(Net &n, const std::string &node, MT &x, const std::string &out, const ActivationLayerInfo &act, size_t ctx)
{
    MT    &y  = n.add_activation(out, x.dims, x.layout);
    Status st = NEActivationLayer::validate(x.t->info(), y.t->info(), act);
    if(!bool(st))
        throw Unsupported(node + ": NEActivationLayer rejected: " + st.error_description());
    auto f = std::make_unique<NEActivationLayer>();
    f->configure(x.t.get(), y.t.get(), act);
    add_step(n, node, "activation", std::move(f), ctx);
}

void add_conv(Net &n, const JVal &node, const std::string &name, const std::string &in, const std::string &out)
{
    ConvSpec    s      = parse_conv(node);
    const JVal &cfg    = obj_or_empty(node, "config");
    std::string method = upper(opt_str(cfg, "method", "AUTO"));
    DataLayout  layout = parse_layout(opt_str(cfg, "layout", "NCHW"));
    const bool  fm     = opt_bool(cfg, "fast_math", false);
    if(std::find(all_methods().begin(), all_methods().end(), method) == all_methods().end())
        throw BadRequest(name + ": unknown method '" + method + "'");
    const size_t        ctx = n.ctx_of(cfg, 0);
    ActivationLayerInfo act = s.actinfo;
    bool                separate_act = false;
    Status              st           = safe_validate(s, method, layout, fm);
    if(!bool(st) && act.enabled())
    {
        ConvSpec plain = s;
        plain.actinfo  = ActivationLayerInfo();
        if(bool(safe_validate(plain, method, layout, fm)))
        {
            s            = plain;
            separate_act = true;
            st           = Status{};
        }
    }
    if(!bool(st))
        throw Unsupported(name + ": " + method + "/" + layout_name(layout) + " rejected by validate(): " + st.error_description());
    MT *xp = &n.get(in, layout, ctx);
    if(xp->dims != s.in_dims())
        throw BadRequest(name + ": input " + in + " is " + dims_str(xp->dims) + ", the conv expects " + dims_str(s.in_dims()));
    const bool own_in = n.isolate.count(name + "|in") > 0;
    if(own_in)
    {
        MT &own = n.private_tensor(*xp, "in:" + name);
        n.add_copy(*xp, own, name, ctx);
        xp = &own;
    }
    MT &x = *xp;
    const bool  dw = method == "DEPTHWISE" || (method == "AUTO" && s.depthwise());
    ConvTensors ti = conv_infos(s, layout, dw);
    MT         &w  = n.add_const(name + "#weights", s.w_dims(), ti.w_m, layout, n.resolve(opt_str(node, "weights_path", "")), 2);
    MT         *b  = s.has_bias ? &n.add_const(name + "#bias", { s.O }, ti.b_m, layout, n.resolve(opt_str(node, "bias_path", "")), 3) : nullptr;
    MT         &yt = n.add_tensor(separate_act ? out + "#conv" : out, s.out_dims(), ti.out_m, layout);
    const bool  own_out = n.isolate.count(name + "|out") > 0;
    MT         &y  = own_out ? n.private_tensor(yt, "out:" + name) : yt;
    n.activate(ctx); // functions read the active scheduler's thread count and CPU model at configure
    std::string effective, error, gemm;
    ext::begin_configure(cfg);
    std::unique_ptr<IFunction> fn;
    try
    {
        fn = make_conv(s, method, fm, x.t.get(), w.t.get(), b ? b->t.get() : nullptr, y.t.get(), ti, &effective);
    }
    catch(...)
    {
        ext::end_configure(cfg, &error);
        throw;
    }
    gemm = ext::end_configure(cfg, &error);
    if(!error.empty())
        throw Unsupported(name + ": " + error);
    Obj o;
    o.str("node", name).str("op", "conv").str("method", method).str("effective_method", effective).str("layout", layout_name(layout)).boolean("fast_math", fm).boolean("fused_activation", act.enabled() && !separate_act).raw("schedule", n.ctx_json(ctx));
    if(own_in || own_out)
        o.boolean("private_input", own_in).boolean("private_output", own_out);
    if(!gemm.empty())
        o.raw("gemm", gemm);
    add_step(n, name, "conv", std::move(fn), ctx, o.done());
    if(effective == "GEMM" && layout == DataLayout::NHWC)
    {
        n.steps.back().watch.emplace_back("in", &x, x.t->info()->padding());
        n.steps.back().watch.emplace_back("out", &y, y.t->info()->padding());
    }
    if(own_out)
        n.add_copy(y, yt, name, ctx);
    if(separate_act)
        add_act(n, name + "#act", yt, out, act, ctx);
}

void add_deconv(Net &n, const JVal &node, const std::string &name, const std::string &in, const std::string &out)
{
    DeconvSpec          s      = parse_deconv(node);
    const JVal         &cfg    = obj_or_empty(node, "config");
    DataLayout          layout = parse_layout(opt_str(cfg, "layout", "NCHW"));
    const size_t        ctx    = n.ctx_of(cfg, 0);
    ActivationLayerInfo act    = parse_act(node, false); // NEDeconvolutionLayer fuses none: a step of its own
    Status              st     = validate_deconv(s, layout);
    if(!bool(st))
        throw Unsupported(name + ": NEDeconvolutionLayer/" + layout_name(layout) + " rejected by validate(): " + st.error_description());
    MT &x = n.get(in, layout, ctx);
    if(x.dims != s.in_dims())
        throw BadRequest(name + ": input " + in + " is " + dims_str(x.dims) + ", the deconv expects " + dims_str(s.in_dims()));
    ConvTensors ti = deconv_infos(s, layout);
    MT         &w  = n.add_const(name + "#weights", s.w_dims(), ti.w_m, layout, n.resolve(opt_str(node, "weights_path", "")), 2);
    MT         *b  = s.has_bias ? &n.add_const(name + "#bias", { s.O }, ti.b_m, layout, n.resolve(opt_str(node, "bias_path", "")), 3) : nullptr;
    MT         &y  = n.add_tensor(act.enabled() ? out + "#deconv" : out, s.out_dims(), ti.out_m, layout);
    n.activate(ctx);
    std::string error;
    ext::begin_configure(cfg);
    auto fn = std::make_unique<NEDeconvolutionLayer>();
    try
    {
        fn->configure(x.t.get(), w.t.get(), b ? b->t.get() : nullptr, y.t.get(), s.pad_stride());
    }
    catch(...)
    {
        ext::end_configure(cfg, &error);
        throw;
    }
    ext::end_configure(cfg, &error);
    Obj o;
    o.str("node", name).str("op", "deconv").str("method", "DECONV").str("layout", layout_name(layout)).raw("schedule", n.ctx_json(ctx));
    add_step(n, name, "deconv", std::move(fn), ctx, o.done());
    if(act.enabled())
        add_act(n, name + "#act", y, out, act, ctx);
}

void add_fc(Net &n, const JVal &node, const std::string &name, const std::string &in, const std::string &out)
{
    FcSpec      s   = parse_fc(node);
    const JVal &cfg = obj_or_empty(node, "config");
    const size_t ctx = n.ctx_of(cfg, 0);
    MT          &x   = n.get(in, DataLayout::NCHW, ctx);
    if(x.dims != std::vector<size_t>{ s.N, s.K })
        throw BadRequest(name + ": input " + in + " is " + dims_str(x.dims) + ", the fc expects " + std::to_string(s.N) + "x" + std::to_string(s.K));
    FullyConnectedLayerInfo info;
    info.activation_info = parse_act(node, s.relu);
    MT &w = n.add_const(name + "#weights", { s.M, s.K }, map2(s.M, s.K), DataLayout::NCHW, n.resolve(opt_str(node, "weights_path", "")), 2);
    MT *b = s.has_bias ? &n.add_const(name + "#bias", { s.M }, map1(s.M), DataLayout::NCHW, n.resolve(opt_str(node, "bias_path", "")), 3) : nullptr;
    MT &y = n.add_activation(out, { s.N, s.M }, DataLayout::NCHW);
    Status st = NEFullyConnectedLayer::validate(x.t->info(), w.t->info(), b ? b->t->info() : nullptr, y.t->info(), info);
    if(!bool(st))
        throw Unsupported(name + ": NEFullyConnectedLayer::validate(): " + st.error_description());
    n.activate(ctx);
    std::string error, gemm;
    ext::begin_configure(cfg);
    auto f = std::make_unique<NEFullyConnectedLayer>();
    try
    {
        f->configure(x.t.get(), w.t.get(), b ? b->t.get() : nullptr, y.t.get(), info);
    }
    catch(...)
    {
        ext::end_configure(cfg, &error);
        throw;
    }
    gemm = ext::end_configure(cfg, &error);
    if(!error.empty())
        throw Unsupported(name + ": " + error);
    Obj o;
    o.str("node", name).str("op", "fc").raw("schedule", n.ctx_json(ctx));
    if(!gemm.empty())
        o.raw("gemm", gemm);
    add_step(n, name, "fc", std::move(f), ctx, o.done());
}

void add_pool(Net &n, const JVal &node, const std::string &name, const std::string &in, const std::string &out, bool global)
{
    MT               &x    = n.any(in);
    const std::string type = upper(opt_str(node, "type", "MAX"));
    if(x.dims.size() != 4)
        throw BadRequest(name + ": pooling needs a 4-D input");
    PoolingType pt = type == "MAX" ? PoolingType::MAX : type == "AVG" ? PoolingType::AVG : throw BadRequest(name + ": pool type must be MAX or AVG");
    std::vector<size_t> od = { x.dims[0], x.dims[1], 1, 1 };
    PoolingLayerInfo    info(pt, x.layout);
    if(!global)
    {
        auto k  = int_list(node, "kernel", 2, {});
        auto st = int_list(node, "stride", 2, { 1, 1 });
        auto pd = int_list(node, "pads", 4, { 0, 0, 0, 0 });
        if(k.empty())
            throw BadRequest(name + ": pooling needs 'kernel'");
        long long oh = (static_cast<long long>(x.dims[2]) + pd[0] + pd[2] - k[0]) / st[0] + 1;
        long long ow = (static_cast<long long>(x.dims[3]) + pd[1] + pd[3] - k[1]) / st[1] + 1;
        if(oh <= 0 || ow <= 0)
            throw BadRequest(name + ": pooling window larger than the padded input");
        od[2] = static_cast<size_t>(oh);
        od[3] = static_cast<size_t>(ow);
        info  = PoolingLayerInfo(pt, Size2D(static_cast<size_t>(k[1]), static_cast<size_t>(k[0])), x.layout,
                                PadStrideInfo(static_cast<unsigned>(st[1]), static_cast<unsigned>(st[0]), static_cast<unsigned>(pd[1]), static_cast<unsigned>(pd[3]), static_cast<unsigned>(pd[0]),
                                              static_cast<unsigned>(pd[2]), DimensionRoundingType::FLOOR),
                                !opt_bool(node, "count_include_pad", false));
    }
    MT    &y  = n.add_activation(out, od, x.layout);
    Status st = NEPoolingLayer::validate(x.t->info(), y.t->info(), info);
    if(!bool(st))
        throw Unsupported(name + ": NEPoolingLayer rejected: " + st.error_description());
    auto f = std::make_unique<NEPoolingLayer>();
    f->configure(x.t.get(), y.t.get(), info);
    add_step(n, name, global ? "global_pool" : "pool", std::move(f), 0);
}

void build_node(Net &n, const JVal &node)
{
    const std::string              name = opt_str(node, "name", "?");
    const std::string              op   = opt_str(node, "op", "");
    const std::vector<std::string> ins  = str_list(node, "inputs");
    const std::string              out  = opt_str(node, "output", "");
    if(ins.empty() || out.empty())
        throw BadRequest(name + ": a node needs 'inputs' and 'output'");
    if(op == "conv")
        return add_conv(n, node, name, ins[0], out);
    if(op == "deconv")
        return add_deconv(n, node, name, ins[0], out);
    if(op == "fc")
        return add_fc(n, node, name, ins[0], out);
    if(op == "pool" || op == "global_pool")
        return add_pool(n, node, name, ins[0], out, op == "global_pool");
    if(op == "activation")
    {
        MT &x = n.any(ins[0]);
        return add_act(n, name, x, out, act_from(obj_or_empty(node, "act")), 0);
    }
    if(op == "add")
    {
        if(ins.size() != 2)
            throw BadRequest(name + ": add needs two inputs");
        MT &a = n.any(ins[0]);
        MT &b = n.get(ins[1], a.layout, 0);
        if(a.dims != b.dims)
            throw BadRequest(name + ": add of " + dims_str(a.dims) + " and " + dims_str(b.dims) + " (no broadcasting)");
        MT    &y  = n.add_activation(out, a.dims, a.layout);
        Status st = NEArithmeticAddition::validate(a.t->info(), b.t->info(), y.t->info(), ConvertPolicy::SATURATE);
        if(!bool(st))
            throw Unsupported(name + ": NEArithmeticAddition rejected: " + st.error_description());
        auto f = std::make_unique<NEArithmeticAddition>();
        f->configure(a.t.get(), b.t.get(), y.t.get(), ConvertPolicy::SATURATE);
        return add_step(n, name, "add", std::move(f), 0);
    }
    if(op == "concat")
    {
        MT &a = n.any(ins[0]);
        if(a.dims.size() != 4 || opt_int(node, "axis", 1) != 1)
            throw BadRequest(name + ": concat is supported along the channels of 4-D tensors");
        std::vector<const ITensor *>     srcs;
        std::vector<const ITensorInfo *> infos;
        std::vector<size_t>              od = a.dims;
        od[1]                              = 0;
        for(const auto &i : ins)
        {
            MT &t = n.get(i, a.layout, 0);
            if(t.dims[0] != a.dims[0] || t.dims[2] != a.dims[2] || t.dims[3] != a.dims[3])
                throw BadRequest(name + ": concat inputs differ outside the channel axis");
            od[1] += t.dims[1];
            srcs.push_back(t.t.get());
            infos.push_back(t.t->info());
        }
        MT          &y    = n.add_activation(out, od, a.layout);
        const size_t axis = a.layout == DataLayout::NCHW ? 2 : 0;
        Status       st   = NEConcatenateLayer::validate(infos, y.t->info(), axis);
        if(!bool(st))
            throw Unsupported(name + ": NEConcatenateLayer rejected: " + st.error_description());
        auto f = std::make_unique<NEConcatenateLayer>();
        f->configure(srcs, y.t.get(), axis);
        return add_step(n, name, "concat", std::move(f), 0);
    }
    if(op == "flatten")
    {
        MT &a = n.any(ins[0]);
        if(a.dims.size() != 4)
            throw BadRequest(name + ": flatten needs a 4-D input");
        // ONNX flattens in NCHW order; with a 1x1 spatial size both layouts agree.
        MT    &x  = (a.dims[2] * a.dims[3] == 1) ? a : n.get(ins[0], DataLayout::NCHW, 0);
        MT    &y  = n.add_activation(out, { x.dims[0], x.dims[1] * x.dims[2] * x.dims[3] }, DataLayout::NCHW);
        Status st = NEFlattenLayer::validate(x.t->info(), y.t->info());
        if(!bool(st))
            throw Unsupported(name + ": NEFlattenLayer rejected: " + st.error_description());
        auto f = std::make_unique<NEFlattenLayer>();
        f->configure(x.t.get(), y.t.get());
        return add_step(n, name, "flatten", std::move(f), 0);
    }
    if(op == "softmax")
    {
        MT &x = n.any(ins[0]);
        if(x.dims.size() != 2)
            throw BadRequest(name + ": softmax is supported on 2-D tensors (over the last axis)");
        MT    &y  = n.add_activation(out, x.dims, DataLayout::NCHW);
        Status st = NESoftmaxLayer::validate(x.t->info(), y.t->info(), 1.0f, 0);
        if(!bool(st))
            throw Unsupported(name + ": NESoftmaxLayer rejected: " + st.error_description());
        auto f = std::make_unique<NESoftmaxLayer>();
        f->configure(x.t.get(), y.t.get(), 1.0f, 0);
        return add_step(n, name, "softmax", std::move(f), 0);
    }
    throw BadRequest(name + ": unknown op '" + op + "' (conv, fc, pool, global_pool, activation, add, concat, flatten, softmax)");
}

Net &find_net(const JVal &req)
{
    auto it = g_nets.find(opt_str(req, "model_id", ""));
    if(it == g_nets.end())
        throw BadRequest("no model loaded with model_id '" + opt_str(req, "model_id", "") + "'");
    return *it->second;
}

// Configure every step of the graph (nothing allocated yet).
std::unique_ptr<Net> build(const JVal &g, const std::set<std::string> &isolate, const std::string &base_dir)
{
    auto net     = std::make_unique<Net>();
    Net &n       = *net;
    n.isolate    = isolate;
    n.base_dir   = base_dir;
    n.ctx_of(obj_or_empty(g, "default_config"), 0); // ctx 0: the graph's default
    const JVal *inputs = g.get("inputs");
    if(inputs == nullptr || inputs->type != JVal::ARR || inputs->a.empty())
        throw BadRequest("graph needs 'inputs': [{\"name\":..,\"shape\":[..]}]");
    for(const auto &i : inputs->a)
    {
        std::string name = opt_str(i, "name", "");
        n.add_activation(name, dims_of(i, "shape"), DataLayout::NCHW);
        n.inputs.push_back(name);
    }
    n.outputs         = str_list(g, "outputs");
    const JVal *nodes = g.get("nodes");
    if(nodes == nullptr || nodes->type != JVal::ARR)
        throw BadRequest("graph needs 'nodes'");
    for(const auto &node : nodes->a)
    {
        build_node(n, node);
        const JVal *shape = node.get("shape");
        if(shape != nullptr && shape->type == JVal::ARR)
        {
            std::vector<size_t> want = dims_of(node, "shape");
            MT                 &got  = n.any(opt_str(node, "output", ""));
            if(got.dims != want)
                throw BadRequest(opt_str(node, "name", "?") + ": output is " + dims_str(got.dims) + ", the graph says " + dims_str(want));
        }
    }
    for(const auto &o : n.outputs)
        n.any(o);
    return net;
}

std::string load(const JVal &req)
{
    const std::string id   = opt_str(req, "model_id", "");
    const std::string path = opt_str(req, "graph_path", "");
    if(id.empty() || path.empty())
        throw BadRequest("model_load needs 'model_id' and 'graph_path'");
    std::ifstream f(path);
    if(!f)
        throw BadRequest("cannot open graph file '" + path + "'");
    std::stringstream text;
    text << f.rdbuf();
    JVal g = JParser(text.str()).parse();
    g_nets.erase(id);
    std::unique_ptr<Net> net;
    int                  builds = 0;
    try
    {
        auto                  t0 = Clock::now();
        std::set<std::string> isolate;
        for(;;)
        {
            const size_t slash = path.find_last_of('/');
            net                = build(g, isolate, slash == std::string::npos ? std::string(".") : path.substr(0, slash));
            ++builds;
            std::set<std::string> conflicts = net->padding_conflicts();
            size_t                before    = isolate.size();
            isolate.insert(conflicts.begin(), conflicts.end());
            if(conflicts.empty())
                break;
            if(isolate.size() == before || builds >= 4)
                throw Unsupported("could not isolate tensors whose padding changed after configure (" + *conflicts.begin() + ")");
            net.reset(); // configure again, with private tensors where needed
        }
        Net &n = *net;
        for(auto &t : n.tensors)
            t->t->allocator()->allocate();
        for(const auto &c : n.constants)
        {
            JVal r; // {"path": c.path}; an absent path means seeded random values
            r.type = JVal::OBJ;
            JVal p;
            p.type = JVal::STR;
            p.s    = c.path;
            r.o.emplace_back("path", p);
            std::vector<float> v = load_or_random(r, "path", c.mt->m.count(), c.seed);
            copy_logical<true>(*c.mt->t, c.mt->m, v.data());
        }
        n.configure_us = us_since(t0);
        auto t1        = Clock::now();
        for(auto &s : n.steps)
        {
            n.activate(s.ctx);
            s.fn->prepare();
        }
        n.prepare_us = us_since(t1);
    }
    catch(...)
    {
        net.reset();
        release_schedulers();
        throw;
    }
    release_schedulers();
    Net        &n       = *net;
    std::string reports = "[";
    bool        firstr  = true;
    std::map<std::string, int> ops;
    for(const auto &s : n.steps)
    {
        ops[s.op]++;
        if(!s.report.empty())
        {
            reports += (firstr ? "" : ",") + s.report;
            firstr = false;
        }
    }
    std::string counts = "{";
    for(auto it = ops.begin(); it != ops.end(); ++it)
        counts += (it == ops.begin() ? "" : ",") + jstr(it->first) + ":" + std::to_string(it->second);
    Obj o;
    o.boolean("ok", true)
        .str("action", "model_load")
        .str("model_id", id)
        .integer("steps", static_cast<long long>(n.steps.size()))
        .integer("permutes", static_cast<long long>(n.permutes))
        .integer("copies", static_cast<long long>(n.copies))
        .integer("builds", builds)
        .raw("ops", counts + "}")
        .integer("schedules", static_cast<long long>(n.ctxs.size()))
        .num("configure_us", n.configure_us)
        .num("prepare_us", n.prepare_us)
        .raw("nodes", reports + "]");
    g_nets[id] = std::move(net);
    return o.done();
}

std::string run(const JVal &req)
{
    Net        &n      = find_net(req);
    const JVal &ipaths = obj_or_empty(req, "input_paths");
    for(const auto &name : n.inputs)
    {
        const JVal *p = ipaths.get(name);
        if(p == nullptr)
        {
            if(opt_bool(req, "reuse_input", false))
                continue;
            throw BadRequest("input_paths lacks graph input '" + name + "'");
        }
        MT                &t = n.any(name);
        std::vector<float> v = load_or_random(ipaths, name, t.m.count(), 1);
        copy_logical<true>(*t.t, t.m, v.data());
    }
    const long long warmup      = std::max<long long>(0, opt_int(req, "warmup", 0));
    const long long min_repeats = std::max<long long>(1, opt_int(req, "min_repeats", 1));
    const long long max_repeats = std::max<long long>(min_repeats, opt_int(req, "max_repeats", 100000));
    const double    min_time_us = 1000.0 * opt_num(req, "min_time_ms", 0.0);
    const double    max_time_us = 1000.0 * opt_num(req, "max_time_ms", 0.0);
    const double    stable      = opt_num(req, "stable_within", 0.0);
    const bool      profile     = opt_bool(req, "profile", false);
    std::vector<double> times;
    double              total = 0;
    try
    {
        for(auto &s : n.steps)
            s.us.clear();
        auto one = [&](bool timed) {
            size_t cur = SIZE_MAX;
            for(auto &s : n.steps)
            {
                if(s.ctx != cur)
                {
                    n.activate(s.ctx);
                    cur = s.ctx;
                }
                if(profile && timed)
                {
                    auto t = Clock::now();
                    s.fn->run();
                    s.us.push_back(us_since(t));
                }
                else
                    s.fn->run();
            }
        };
        for(long long i = 0; i < warmup; ++i)
            one(false);
        while(keep_timing(times, total, min_repeats, max_repeats, min_time_us, max_time_us, stable))
        {
            auto t = Clock::now();
            one(true);
            double d = us_since(t);
            times.push_back(d);
            total += d;
        }
    }
    catch(...)
    {
        release_schedulers();
        throw;
    }
    release_schedulers();
    const JVal &opaths = obj_or_empty(req, "output_paths");
    for(const auto &name : n.outputs)
    {
        const JVal *p = opaths.get(name);
        if(p == nullptr || p->type != JVal::STR)
            continue;
        MT                &t = n.any(name);
        std::vector<float> v(t.m.count());
        copy_logical<false>(*t.t, t.m, v.data());
        save(p->s, v);
    }
    std::string outs = "{";
    for(size_t i = 0; i < n.outputs.size(); ++i)
        outs += (i ? "," : "") + jstr(n.outputs[i]) + ":" + jints(n.any(n.outputs[i]).dims);
    Obj o;
    o.boolean("ok", true).str("action", "model_run").str("model_id", opt_str(req, "model_id", "")).raw("outputs", outs + "}");
    Timing tm;
    tm.times_us = times;
    tm.configure_us = n.configure_us;
    tm.prepare_us   = n.prepare_us;
    add_timing(o, tm);
    if(profile)
    {
        std::string steps = "[";
        for(size_t i = 0; i < n.steps.size(); ++i)
            steps += (i ? "," : "") + Obj().str("node", n.steps[i].node).str("op", n.steps[i].op).integer("schedule", static_cast<long long>(n.steps[i].ctx)).num("median_us", ext::median(n.steps[i].us)).done();
        o.raw("profile", steps + "]");
    }
    return o.done();
}

std::string free_net(const JVal &req)
{
    const std::string id = opt_str(req, "model_id", "");
    const bool        had = g_nets.erase(id) > 0;
    release_schedulers();
    return Obj().boolean("ok", true).str("action", "model_free").str("model_id", id).boolean("freed", had).done();
}
} // namespace model

// ---------------------------------------------------------------------------------------------
// "v20.08" from build_information() ("arm_compute_version=v20.08 Build options: ...")
std::string acl_version()
{
    std::string bi  = build_information();
    std::string key = "arm_compute_version=";
    size_t      p   = bi.find(key);
    if(p == std::string::npos)
        return "unknown";
    p += key.size();
    size_t e = bi.find_first_of(" \n", p);
    return bi.substr(p, e == std::string::npos ? std::string::npos : e - p);
}

std::string info()
{
    CPUInfo    &ci = Scheduler::get().cpu_info();
    std::string detected = "[";
    for(size_t i = 0; i < g_cpu.original.size(); ++i)
        detected += (i ? "," : "") + jstr(cpu_model_str(g_cpu.original[i]));
    detected += "]";
    std::string models = "[";
    for(size_t i = 0; i < cpu_models().size(); ++i)
        models += (i ? "," : "") + jstr(cpu_model_str(cpu_models()[i].second));
    models += "]";
    std::string methods = "[";
    for(size_t i = 0; i < all_methods().size(); ++i)
        methods += (i ? "," : "") + jstr(all_methods()[i]);
    methods += "]";
    Obj o;
    o.boolean("ok", true)
        .str("action", "info")
        .integer("protocol", PROTOCOL_VERSION)
        .str("acl_version", acl_version())
        .str("build_information", build_information())
        .integer("cpu_num", ci.get_cpu_num())
        .raw("detected_cpu_models", detected)
        .raw("cpu_models", models)
        .boolean("has_fp16", ci.has_fp16())
        .boolean("has_dotprod", ci.has_dotprod())
        .integer("default_threads", Scheduler::get().num_threads())
        .raw("methods", methods)
        .raw("ops", "[\"conv\",\"fc\",\"permute\"]")
        .raw("actions", "[\"info\",\"validate\",\"run\",\"gemm_kernels\",\"model_load\",\"model_run\",\"model_free\"]")
        .raw("extensions", ext::info_json());
    return o.done();
}

std::string handle(const std::string &line)
{
    JVal req = JParser(line).parse();
    if(req.type != JVal::OBJ)
        throw BadRequest("request must be a JSON object");
    std::string action = opt_str(req, "action", "run");
    if(action == "info")
        return info();
    if(action == "gemm_kernels")
    {
        const JVal *cfg = req.get("config");
        if(cfg != nullptr && cfg->type == JVal::OBJ)
        {
            int threads = 0;
            apply_cpu_config(*cfg, &threads); // cpu_model changes arm_gemm's candidates/default
        }
        return ext::gemm_kernels(req);
    }
    if(action == "model_load")
        return model::load(req);
    if(action == "model_run")
        return model::run(req);
    if(action == "model_free")
        return model::free_net(req);
    std::string op = opt_str(req, "op", "");
    if(action != "validate" && action != "run")
        throw BadRequest("unknown action '" + action + "' (info, validate, run, gemm_kernels, model_load, model_run, model_free)");
    if(op == "conv")
        return action == "validate" ? conv_validate(req) : conv_run(req);
    if(op == "fc")
        return fc_request(req, action == "run");
    if(op == "deconv")
        return deconv_request(req, action == "run");
    if(op == "permute" && action == "run")
        return permute_run(req);
    throw BadRequest("unknown op '" + op + "' (conv, fc; permute for run)");
}

std::string with_id(const std::string &response, const std::string &line)
{
    // Echo the request's "id" (if any) so that a client can pair requests and answers.
    try
    {
        JVal        req = JParser(line).parse();
        const JVal *id  = req.get("id");
        if(id == nullptr)
            return response;
        std::string idv = id->type == JVal::STR ? jstr(id->s) : id->type == JVal::NUM ? jnum(id->n) : "null";
        return "{\"id\":" + idv + "," + response.substr(1);
    }
    catch(...)
    {
        return response;
    }
}
} // namespace ks

// The interposed symbol: libarm_compute.so calls arm_gemm::get_gemm_method<float,float,Nothing>
// through its PLT; the executable's definition comes first in the global lookup scope.
namespace arm_gemm
{
template <>
KernelDescription get_gemm_method<float, float, Nothing>(const GemmArgs &args, const Nothing &os)
{
    return ks::ext::interposed_get_gemm_method(args, os);
}
} // namespace arm_gemm

int main(int argc, char **argv)
{
    for(int i = 1; i < argc; ++i)
    {
        std::string a = argv[i];
        if(a == "--help" || a == "-h")
        {
            std::printf("usage: kselect_acl_runner < requests.jsonl   (one JSON request per line, one JSON result per line; see PROTOCOL.md)\n");
            return 0;
        }
        if(a == "--version")
        {
            std::printf("kselect_acl_runner protocol %d, ACL %s\n", ks::PROTOCOL_VERSION, ks::acl_version().c_str());
            return 0;
        }
    }
    std::ios::sync_with_stdio(false);
    {
        CPUInfo &ci = Scheduler::get().cpu_info();
        for(unsigned i = 0; i < ci.get_cpu_num(); ++i)
            ks::g_cpu.original.push_back(ci.get_cpu_model(i));
    }
    ks::ext::startup();
    std::string line;
    while(std::getline(std::cin, line))
    {
        if(line.find_first_not_of(" \t\r\n") == std::string::npos)
            continue;
        std::string resp;
        try
        {
            resp = ks::handle(line);
        }
        catch(const ks::Unsupported &e)
        {
            resp = ks::Obj().boolean("ok", false).str("error_kind", "unsupported").str("error", e.what()).done();
        }
        catch(const ks::BadRequest &e)
        {
            resp = ks::Obj().boolean("ok", false).str("error_kind", "bad_request").str("error", e.what()).done();
        }
        catch(const std::exception &e)
        {
            resp = ks::Obj().boolean("ok", false).str("error_kind", "acl_error").str("error", e.what()).done();
        }
        catch(...)
        {
            resp = ks::Obj().boolean("ok", false).str("error_kind", "acl_error").str("error", "unknown exception").done();
        }
        ks::ext::after_request();
        std::cout << ks::with_id(resp, line) << "\n";
        std::cout.flush();
    }
    return 0;
}
