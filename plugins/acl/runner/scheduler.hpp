// Thread control: the CPU models and thread count a config asks for, and the schedulers ACL's
// kernels run under: ACL's CPPScheduler ("default"), the same with every kernel timed ("record"),
// or the runner's own pool that splits every kernel's window by per-thread ratios ("split").
// See FINDINGS.md.
#pragma once

#include <condition_variable>
#include <exception>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "arm_compute/core/CPP/CPPTypes.h"
#include "arm_compute/core/Window.h"
#include "arm_compute/runtime/IScheduler.h"

#include "acl_version.hpp"

namespace ks
{
struct JVal;

// ---- CPU models / threads -------------------------------------------------------------------------
struct CpuState
{
    std::vector<arm_compute::CPUModel> original; // the detected model of every cpu (main() fills it)
};
extern CpuState g_cpu;

const std::vector<std::pair<std::string, arm_compute::CPUModel>> &cpu_models();
std::string cpu_model_str(arm_compute::CPUModel m);
std::string cpu_models_json(); // the active scheduler's model per cpu
// The CPU model hint of one cpu (ACL 20.08). Later releases' CPUInfo is read-only: there only the
// detected model is accepted, anything else throws Unsupported.
void set_cpu_model(arm_compute::CPUInfo &ci, unsigned cpu, arm_compute::CPUModel m);
// Apply the config's scheduler, threads and cpu_model (or restore the detected models); the thread
// count in effect goes to *threads_out.
void apply_cpu_config(const JVal &cfg, int *threads_out);

namespace ext
{
// ---- scheduler that times each kernel and delegates to ACL's CPPScheduler ----------------------
class RecordingScheduler final : public arm_compute::IScheduler
{
public:
    explicit RecordingScheduler(arm_compute::IScheduler &inner);
    void         set_num_threads(unsigned int n) override;
    unsigned int num_threads() const override;
    void         schedule(arm_compute::ICPPKernel *kernel, const Hints &hints) override;
#if KS_ACL_24 // the operator passes the window to run
    void schedule_op(arm_compute::ICPPKernel *kernel, const Hints &hints, const arm_compute::Window &window, arm_compute::ITensorPack &tensors) override;
#else
    void schedule_op(arm_compute::ICPPKernel *kernel, const Hints &hints, arm_compute::ITensorPack &tensors) override;
#endif
    void         run_tagged_workloads(std::vector<Workload> &workloads, const char *tag) override;

protected:
    void run_workloads(std::vector<Workload> &workloads) override;

private:
    arm_compute::IScheduler &_inner;
};

// ---- scheduler that splits every kernel's window by per-thread ratios --------------------------
class SplitScheduler final : public arm_compute::IScheduler
{
public:
    SplitScheduler(unsigned n, std::vector<double> ratios, std::vector<int> pin);
    ~SplitScheduler() override;
    void         set_num_threads(unsigned int n) override;
    unsigned int num_threads() const override;
    void         schedule(arm_compute::ICPPKernel *kernel, const Hints &hints) override;
#if KS_ACL_24 // the operator passes the window to run
    void schedule_op(arm_compute::ICPPKernel *kernel, const Hints &hints, const arm_compute::Window &window, arm_compute::ITensorPack &tensors) override;
#else
    void schedule_op(arm_compute::ICPPKernel *kernel, const Hints &hints, arm_compute::ITensorPack &tensors) override;
#endif

    // Stop the workers and unpin the calling thread (idempotent); the object stays valid.
    void shutdown();
    // New per-thread shares for the kernels scheduled from now on (the model engine sets them per op).
    void set_ratios(const std::vector<double> &r);

protected:
    void run_workloads(std::vector<Workload> &workloads) override;

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

    static void pin_self(int cpu);
    void        start(unsigned n);
    void        stop();
    void        worker(unsigned t);
    // Run fn(t) for t in [0, n): t = 0 on the calling thread, the others on the workers.
    void parallel(const std::function<void(unsigned)> &fn);
    void run_kernel(arm_compute::ICPPKernel *kernel, const Hints &hints, const arm_compute::Window &window, arm_compute::ITensorPack *tensors);
};

extern arm_compute::IScheduler *g_cpp; // ACL's own CPPScheduler instance

// At start-up: ACL's CPPScheduler becomes the global scheduler (g_cpp); the main thread's affinity
// is remembered for restore_main_affinity().
// The ACL kernels that divide their work by thread id themselves (scheduler.cpp says which and why).
const std::vector<std::string> &kernels_splitting_by_thread_id();
void scheduler_startup();
void restore_main_affinity();

std::vector<double> num_list(const JVal &cfg, const std::string &k);

// Hooks around the timed runs of a single-op request (per-kernel records in record / split mode).
void        begin_run();
void        begin_timed_phase();
void        end_timed_phase();
std::string scheduler_report(); // the "scheduler" JSON section, "" in default mode
void        reset_kernel_records(); // after every request
} // namespace ext
} // namespace ks
