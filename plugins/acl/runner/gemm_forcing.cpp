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
#include <utility>
#include <vector>

#include "acl_version.hpp"
#include "json.hpp"
#include "request.hpp"

using namespace arm_compute;

#if KS_ACL_GEMM_FORCING_ABI

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
    arm_gemm::GemmArgs a(&ci, static_cast<unsigned>(M), static_cast<unsigned>(N), static_cast<unsigned>(K), static_cast<unsigned>(b), static_cast<unsigned>(mu), arm_gemm::Activation(), static_cast<int>(th), nullptr);
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
} // namespace ext
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
#else // not ACL 20.08: no arm_gemm declarations to trust, so no interposition and no forcing

namespace ks
{
namespace ext
{
namespace
{
const std::string g_reason = "the arm_gemm declarations follow ACL 20.08's ABI; this runner is built for ACL " +
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
} // namespace ext
} // namespace ks
#endif // KS_ACL_GEMM_FORCING_ABI
