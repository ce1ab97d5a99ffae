// arm_gemm kernel forcing (gemm_forcing.hpp).
#include "gemm_forcing.hpp"

#include "arm_compute/core/CPP/CPPTypes.h"
#include "arm_compute/core/Version.h"
#include "arm_compute/runtime/Scheduler.h"

#include <dlfcn.h>

#include <cctype>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "acl_version.hpp"
#include "json.hpp"
#include "request.hpp"

using namespace arm_compute;

#if KS_ACL_GEMM_FORCING_ABI

// ---------------------------------------------------------------------------------------------
// arm_gemm internals (not shipped as headers), declared here to match the ABI of the one release
// they are written for exactly, and verified again at start-up by ext::check_gemm_abi(). Used only
// through dlsym'd pointers and one interposed symbol.
//  - 20.08: layout cross-checked against the disassembly of libarm_compute.so.20
//    (NEGEMMAssemblyDispatch::configure builds GemmArgs/GemmConfig on its stack).
//  - 24.11: layout as in 24.11's src/cpu/kernels/assembly/arm_gemm.hpp (offsets checked by
//    compiling against that header for aarch64: GemmArgs 64 bytes, _cfg at 56; GemmConfig 56,
//    weight_format at 48; KernelDescription 56).
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
#if KS_ACL_GEMM_ABI_24_11
enum class WeightFormat // only the two values kselect passes on; the blocked formats are not used
{
    UNSPECIFIED = 0x1,
    ANY         = 0x2
};
#endif
struct GemmConfig
{
    GemmMethod   method{ GemmMethod::DEFAULT };
    std::string  filter{};
    unsigned int inner_block_size{ 0 };
    unsigned int outer_block_size{ 0 };
#if KS_ACL_GEMM_ABI_24_11
    WeightFormat weight_format{ WeightFormat::ANY };
#endif
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
#if KS_ACL_GEMM_ABI_20_08
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
#else
struct GemmArgs
{
    const arm_compute::CPUInfo *_ci;
    unsigned int                _Msize;
    unsigned int                _Nsize;
    unsigned int                _Ksize;
    unsigned int                _Ksections;
    unsigned int                _nbatches;
    unsigned int                _nmulti;
    bool                        _indirect_input;
    Activation                  _act;
    int                         _maxthreads;
    bool                        _fixed_format;
    bool                        _fast_mode;
    bool                        _accumulate;
    const GemmConfig           *_cfg;
    GemmArgs(const arm_compute::CPUInfo *ci, unsigned int M, unsigned int N, unsigned int K, unsigned int Ksections, unsigned int nbatches, unsigned int nmulti, bool indirect_input, Activation act,
             int maxthreads, bool fixed_format, bool fast_mode, bool accumulate, const GemmConfig *cfg)
        : _ci(ci), _Msize(M), _Nsize(N), _Ksize(K), _Ksections(Ksections), _nbatches(nbatches), _nmulti(nmulti), _indirect_input(indirect_input), _act(act), _maxthreads(maxthreads),
          _fixed_format(fixed_format), _fast_mode(fast_mode), _accumulate(accumulate), _cfg(cfg)
    {
    }
};
#endif
struct Nothing
{
};

#if KS_ACL_GEMM_ABI_20_08
// 20.08's NEGEMMAssemblyDispatch asks get_gemm_method for the kernel, then passes its name to
// arm_gemm::gemm() as GemmConfig::filter: the runner interposes get_gemm_method.
template <typename Top, typename Tret, class OutputStage = Nothing>
KernelDescription get_gemm_method(const GemmArgs &args, const OutputStage & = {});
#else
// 24.11's Fallback::configure calls arm_gemm::gemm() with an empty filter and arm_gemm picks the
// kernel inside: the runner interposes gemm() itself and passes the config on with the filter set.
// GemmCommon stays incomplete: the runner only hands the pointer back.
template <typename Tlop, typename Trop, typename Tret>
class GemmCommon;
template <typename Tlop, typename Trop, typename Tret, class OutputStage = Nothing>
std::unique_ptr<GemmCommon<Tlop, Trop, Tret>> gemm(const GemmArgs &args, const OutputStage & = {});
#endif
} // namespace arm_gemm

#if KS_ACL_GEMM_ABI_24_11
// unique_ptr's destructor needs a deleter of the incomplete GemmCommon even where it is never run
// on a live pointer: every GemmCommon the runner receives goes straight back to ACL, which deletes
// it with its own. An empty deleter has the layout of std's own, so the unique_ptr's is unchanged.
namespace std
{
template <>
struct default_delete<arm_gemm::GemmCommon<float, float, float>>
{
    void operator()(arm_gemm::GemmCommon<float, float, float> *) const noexcept
    {
        std::fprintf(stderr, "kselect_acl_runner: a GemmCommon was to be deleted by the runner, which does not own one\n");
        std::abort();
    }
};
} // namespace std
#endif

namespace arm_gemm
{

#if defined(__aarch64__)
static_assert(sizeof(KernelDescription) == 56 && offsetof(KernelDescription, name) == 8 && offsetof(KernelDescription, is_default) == 40 && offsetof(KernelDescription, cycle_estimate) == 48,
              "KernelDescription layout");
#if KS_ACL_GEMM_ABI_20_08
// Offsets read off the 20.08 disassembly (LP64).
static_assert(sizeof(GemmConfig) == 48 && offsetof(GemmConfig, filter) == 8 && offsetof(GemmConfig, inner_block_size) == 40, "GemmConfig layout");
static_assert(offsetof(GemmArgs, _Msize) == 8 && offsetof(GemmArgs, _nmulti) == 24 && offsetof(GemmArgs, _act) == 28 && offsetof(GemmArgs, _maxthreads) == 40 && offsetof(GemmArgs, _cfg) == 48 && sizeof(GemmArgs) == 56,
              "GemmArgs layout");
#else
// Offsets of 24.11's header (LP64).
static_assert(sizeof(GemmConfig) == 56 && offsetof(GemmConfig, filter) == 8 && offsetof(GemmConfig, inner_block_size) == 40 && offsetof(GemmConfig, weight_format) == 48, "GemmConfig layout");
static_assert(offsetof(GemmArgs, _Msize) == 8 && offsetof(GemmArgs, _Ksections) == 20 && offsetof(GemmArgs, _nmulti) == 28 && offsetof(GemmArgs, _indirect_input) == 32 &&
                  offsetof(GemmArgs, _act) == 36 && offsetof(GemmArgs, _maxthreads) == 48 && offsetof(GemmArgs, _fixed_format) == 52 && offsetof(GemmArgs, _accumulate) == 54 &&
                  offsetof(GemmArgs, _cfg) == 56 && sizeof(GemmArgs) == 64,
              "GemmArgs layout");
#endif
#endif
} // namespace arm_gemm

namespace ks
{
namespace ext
{
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

#if KS_ACL_GEMM_ABI_20_08
const char *const ACL_RELEASE    = "v20.08";
const char *const LIBRARIES[]    = { "libarm_compute_core.so.20", "libarm_compute_core.so" }; // arm_gemm lives in the core library
const char *const SYM_GET_METHOD = "_ZN8arm_gemm15get_gemm_methodIffNS_7NothingEEENS_17KernelDescriptionERKNS_8GemmArgsERKT1_";
const char *const SYM_COMPATIBLE = "_ZN8arm_gemm22get_compatible_kernelsIffNS_7NothingEEESt6vectorINS_17KernelDescriptionESaIS3_EERKNS_8GemmArgsERKT1_";
const char *const SYM_INTERPOSED = SYM_GET_METHOD;
const char *const PLAIN_KERNEL   = "sgemm_12x8"; // arm_gemm's interleaved fp32 kernel, eligible for any GEMM
#else
using GemmFn                     = std::unique_ptr<arm_gemm::GemmCommon<float, float, float>> (*)(const arm_gemm::GemmArgs &, const arm_gemm::Nothing &);
const char *const ACL_RELEASE    = "v24.11";
const char *const LIBRARIES[]    = { "libarm_compute.so.43", "libarm_compute.so" };
const char *const SYM_GET_METHOD = "_ZN8arm_gemm15get_gemm_methodIfffNS_7NothingEEENS_17KernelDescriptionERKNS_8GemmArgsERKT2_";
const char *const SYM_COMPATIBLE = "_ZN8arm_gemm22get_compatible_kernelsIfffNS_7NothingEEESt6vectorINS_17KernelDescriptionESaIS3_EERKNS_8GemmArgsERKT2_";
const char *const SYM_GEMM       = "_ZN8arm_gemm4gemmIfffNS_7NothingEEESt10unique_ptrINS_10GemmCommonIT_T0_T1_EESt14default_deleteIS7_EERKNS_8GemmArgsERKT2_";
const char *const SYM_INTERPOSED = SYM_GEMM;
const char *const PLAIN_KERNEL   = "a64_sgemm_8x12";
GemmFn            g_orig_gemm    = nullptr;
#endif

GetMethodFn             g_orig_get_method = nullptr;
CompatibleFn            g_orig_compatible = nullptr;
bool                    g_forcing_ok      = false;
std::string             g_forcing_reason  = "not checked";
std::string             g_force_filter;
bool                    g_recording_gemms = false;
std::vector<GemmRecord> g_gemms;
thread_local bool       g_in_probe = false;

// A plain fp32 GEMM's arguments (no activation, one K section, direct input).
arm_gemm::GemmArgs plain_args(const arm_compute::CPUInfo *ci, unsigned M, unsigned N, unsigned K, unsigned batches, unsigned multis, int threads, const arm_gemm::GemmConfig *cfg)
{
#if KS_ACL_GEMM_ABI_20_08
    return arm_gemm::GemmArgs(ci, M, N, K, batches, multis, arm_gemm::Activation(), threads, cfg);
#else
    return arm_gemm::GemmArgs(ci, M, N, K, 1, batches, multis, false, arm_gemm::Activation(), threads, false, false, false, cfg);
#endif
}

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

// Records a GEMM that ACL sets up (arm_gemm's own pick: dflt) and, when a kernel is being forced
// and arm_gemm would build it for these arguments, returns the config that names it in *forced_cfg
// (true) so that the caller passes it on.
bool record_gemm(const arm_gemm::GemmArgs &args, const arm_gemm::KernelDescription &dflt, arm_gemm::GemmConfig *forced_cfg, arm_gemm::KernelDescription *forced)
{
    GemmRecord r;
    r.M = args._Msize, r.N = args._Nsize, r.K = args._Ksize, r.batches = args._nbatches, r.multis = args._nmulti, r.maxthreads = args._maxthreads;
    r.default_name   = dflt.name;
    r.default_method = static_cast<int>(dflt.method);
    r.used_name      = dflt.name;
    r.used_method    = r.default_method;
    r.compatible     = compatible(args);
    if(!g_force_filter.empty() && g_forcing_ok)
    {
        *forced_cfg               = args._cfg != nullptr ? *args._cfg : arm_gemm::GemmConfig();
        forced_cfg->filter        = g_force_filter;
        arm_gemm::GemmArgs filtered = args;
        filtered._cfg             = forced_cfg;
        g_in_probe                = true;
        arm_gemm::KernelDescription f = g_orig_get_method(filtered, arm_gemm::Nothing{});
        g_in_probe                = false;
        // arm_gemm matches the filter as a substring: only the kernel of that very name counts
        if(f.name == g_force_filter)
        {
            *forced       = f;
            r.used_name   = f.name;
            r.used_method = static_cast<int>(f.method);
            r.forced      = true;
        }
    }
    const bool was_forced = r.forced;
    g_gemms.push_back(std::move(r));
    return was_forced;
}

#if KS_ACL_GEMM_ABI_20_08
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
    arm_gemm::GemmConfig        cfg;
    arm_gemm::KernelDescription forced;
    return record_gemm(args, dflt, &cfg, &forced) ? forced : dflt;
}
#else
// Called (through the interposed arm_gemm::gemm<float,float,float,Nothing>) by
// CpuGemmAssemblyDispatch's Fallback::configure for every fp32 GEMM that ACL sets up (GEMM,
// GEMM_CONV2D's indirect GEMM, Winograd's batched GEMMs, fully connected): with the filter set in
// the config it passes on, arm_gemm builds the forced kernel.
std::unique_ptr<arm_gemm::GemmCommon<float, float, float>> interposed_gemm(const arm_gemm::GemmArgs &args, const arm_gemm::Nothing &os)
{
    if(g_orig_gemm == nullptr || g_orig_get_method == nullptr)
    {
        std::fprintf(stderr, "kselect_acl_runner: original arm_gemm::gemm not found\n");
        std::abort();
    }
    if(g_in_probe || !g_recording_gemms)
        return g_orig_gemm(args, os);
    arm_gemm::KernelDescription dflt = g_orig_get_method(args, os);
    arm_gemm::GemmConfig        cfg;
    arm_gemm::KernelDescription forced;
    arm_gemm::GemmArgs          passed = args;
    if(record_gemm(args, dflt, &cfg, &forced))
        passed._cfg = &cfg;
    return g_orig_gemm(passed, os);
}
#endif

// Start-up ABI check: the declarations above must match this library build exactly.
void check_gemm_abi()
{
    g_forcing_ok = false;
    void *lib    = nullptr;
    for(const char *name : LIBRARIES)
        if(lib == nullptr)
            lib = dlopen(name, RTLD_LAZY | RTLD_NOLOAD);
    if(lib == nullptr)
    {
        g_forcing_reason = std::string(LIBRARIES[0]) + " not loaded";
        return;
    }
    g_orig_get_method = reinterpret_cast<GetMethodFn>(dlsym(lib, SYM_GET_METHOD));
    g_orig_compatible = reinterpret_cast<CompatibleFn>(dlsym(lib, SYM_COMPATIBLE));
    void *interposed  = dlsym(lib, SYM_INTERPOSED);
#if KS_ACL_GEMM_ABI_24_11
    g_orig_gemm = reinterpret_cast<GemmFn>(interposed);
#endif
    if(g_orig_get_method == nullptr || g_orig_compatible == nullptr || interposed == nullptr)
    {
        g_forcing_reason = std::string("arm_gemm symbols not exported by ") + LIBRARIES[0];
        return;
    }
    if(dlsym(RTLD_DEFAULT, SYM_INTERPOSED) == interposed)
    {
        g_forcing_reason = "interposition inactive: the interposed arm_gemm symbol resolves to the library, not the runner";
        return;
    }
    if(std::getenv("KSELECT_ACL_NO_GEMM_FORCING") != nullptr)
    {
        g_forcing_reason = "disabled by KSELECT_ACL_NO_GEMM_FORCING";
        return;
    }
    std::string bi = build_information();
    if(bi.find(std::string("arm_compute_version=") + ACL_RELEASE) == std::string::npos)
    {
        g_forcing_reason = std::string("declarations are for ACL ") + ACL_RELEASE + "; this library is not " + ACL_RELEASE;
        return;
    }
    // Probe 1: the list for a 64x64x64 GEMM must be sane.
    CPUInfo           &ci = Scheduler::get().cpu_info();
    arm_gemm::GemmArgs a  = plain_args(&ci, 64, 64, 64, 1, 1, 1, nullptr);
    g_forcing_ok          = true; // allow compatible() during the probe
    std::vector<arm_gemm::KernelDescription> v = compatible(a);
    g_forcing_ok = false;
    if(v.empty() || v.size() > 64)
    {
        g_forcing_reason = "get_compatible_kernels returned " + std::to_string(v.size()) + " entries";
        return;
    }
    bool has_plain = false;
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
        if(k.name.find(PLAIN_KERNEL) != std::string::npos)
            has_plain = true;
    }
    if(!has_plain)
    {
        g_forcing_reason = std::string(PLAIN_KERNEL) + " not among the fp32 kernels for a 64x64x64 GEMM";
        return;
    }
    // Probe 2: GemmArgs::_cfg / GemmConfig::filter must be honoured for every listed kernel.
    for(const auto &k : v)
    {
        arm_gemm::GemmConfig cfg;
        cfg.filter                      = k.name;
        arm_gemm::GemmArgs          a2  = plain_args(&ci, 64, 64, 64, 1, 1, 1, &cfg);
        arm_gemm::KernelDescription got = g_orig_get_method(a2, arm_gemm::Nothing{});
        if(got.name != k.name)
        {
            g_forcing_reason = "GemmConfig filter '" + k.name + "' not honoured (got '" + got.name + "')";
            return;
        }
    }
    // Probe 3: the sizes must be where we think: a kernel whose eligibility depends on M (and, on
    // 24.11, on the batch count and K) must come and go with them.
    auto eligible = [&](unsigned M, unsigned N, unsigned K, unsigned batches, const std::string &name) {
        g_forcing_ok = true;
        std::vector<arm_gemm::KernelDescription> list = compatible(plain_args(&ci, M, N, K, batches, 1, 1, nullptr));
        g_forcing_ok = false;
        for(const auto &k : list)
            if(k.name == name)
                return true;
        return false;
    };
#if KS_ACL_GEMM_ABI_20_08
    const bool sizes_follow = eligible(1, 64, 64, 1, "sgemv_pretransposed") && !eligible(64, 64, 64, 1, "sgemv_pretransposed");
#else
    const bool sizes_follow = eligible(1, 64, 64, 2, "gemv_batched") && !eligible(64, 64, 64, 2, "gemv_batched") && !eligible(1, 64, 64, 1, "gemv_batched") &&
                              eligible(64, 64, 8, 1, "a64_smallK_hybrid_fp32_mla_8x4") && !eligible(64, 64, 64, 1, "a64_smallK_hybrid_fp32_mla_8x4") &&
                              !eligible(64, 62, 8, 1, "a64_smallK_hybrid_fp32_mla_8x4");
#endif
    if(!sizes_follow)
    {
        g_forcing_reason = "kernel eligibility does not follow the GEMM's sizes (GemmArgs layout mismatch?)";
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

bool gemm_forcing_ok()
{
    return g_forcing_ok;
}
const std::string &gemm_forcing_reason()
{
    return g_forcing_reason;
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
    arm_gemm::GemmArgs a  = plain_args(&ci, static_cast<unsigned>(M), static_cast<unsigned>(N), static_cast<unsigned>(K), static_cast<unsigned>(b), static_cast<unsigned>(mu), static_cast<int>(th), nullptr);
    std::vector<arm_gemm::KernelDescription> v = compatible(a);
    g_in_probe = true;
    arm_gemm::KernelDescription d = g_orig_get_method(a, arm_gemm::Nothing{});
    g_in_probe = false;
    Obj o;
    o.boolean("ok", true).str("action", "gemm_kernels").str("default", d.name).str("default_method", gemm_method_name(static_cast<int>(d.method))).raw("kernels", kernels_json(v));
    return o.done();
}

void reset_gemm_forcing()
{
    g_recording_gemms = false;
    g_force_filter.clear();
}

std::vector<std::string> fast_mode_kernels()
{
    std::vector<std::string> extra;
#if KS_ACL_GEMM_ABI_24_11
    if(!g_forcing_ok)
        return extra;
    CPUInfo           &ci    = Scheduler::get().cpu_info();
    arm_gemm::GemmArgs plain = plain_args(&ci, 64, 64, 64, 1, 1, 1, nullptr);
    arm_gemm::GemmArgs fast  = plain;
    fast._fast_mode          = true;
    const std::vector<arm_gemm::KernelDescription> without = compatible(plain);
    for(const auto &k : compatible(fast))
    {
        bool listed = false;
        for(const auto &w : without)
            listed |= w.name == k.name;
        if(!listed)
            extra.push_back(k.name);
    }
#endif
    return extra;
}
} // namespace ext
} // namespace ks

// The interposed symbol: libarm_compute calls it through its PLT, and the executable's definition
// comes first in the global lookup scope (build.py exports it from the executable).
namespace arm_gemm
{
#if KS_ACL_GEMM_ABI_20_08
template <>
KernelDescription get_gemm_method<float, float, Nothing>(const GemmArgs &args, const Nothing &os)
{
    return ks::ext::interposed_get_gemm_method(args, os);
}
#else
template <>
std::unique_ptr<GemmCommon<float, float, float>> gemm<float, float, float, Nothing>(const GemmArgs &args, const Nothing &os)
{
    return ks::ext::interposed_gemm(args, os);
}
#endif
} // namespace arm_gemm
#else // neither 20.08 nor 24.11: no arm_gemm declarations to trust, so no interposition and no forcing

namespace ks
{
namespace ext
{
namespace
{
const std::string g_reason = "the arm_gemm declarations follow the ABIs of ACL 20.08 and 24.11; this runner is built for ACL " +
                             std::to_string(KSELECT_ACL_VERSION_MAJOR) + "." + (KSELECT_ACL_VERSION_MINOR < 10 ? "0" : "") +
                             std::to_string(KSELECT_ACL_VERSION_MINOR) + ", whose arm_gemm ABI is not verified";
}

void check_gemm_abi()
{
}
bool gemm_forcing_ok()
{
    return false;
}
const std::string &gemm_forcing_reason()
{
    return g_reason;
}
void begin_configure(const JVal &cfg)
{
    if(!opt_str(cfg, "gemm_kernel", "").empty())
        throw Unsupported("gemm_kernel forcing unavailable: " + g_reason);
}
std::string end_configure(const JVal &, std::string *)
{
    return "";
}
std::string gemm_kernels(const JVal &)
{
    throw Unsupported("arm_gemm introspection unavailable: " + g_reason);
}
void reset_gemm_forcing()
{
}
std::vector<std::string> fast_mode_kernels()
{
    return {};
}
} // namespace ext
} // namespace ks
#endif // KS_ACL_GEMM_FORCING_ABI
