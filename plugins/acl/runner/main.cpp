// kselect_acl_runner: measurement runner for the Arm Compute Library (NEON backend, the APIs of 20.08 and 24.11).
//
// Protocol (see ../PROTOCOL.md): one JSON request per line on stdin, one JSON result line on
// stdout per request, until EOF. A one-shot invocation is simply a single line followed by EOF.
// Tensors travel as raw little-endian float32 files in logical NCHW / OIHW / (N,K) order.
//
// This file: start-up, the request loop and the dispatch of actions. The other runner/*.cpp files
// (listed in ../README.md) hold the parts; plugins/acl/build.py compiles them all in one go:
//     aarch64-linux-gnu-g++ -O2 -std=c++14 -Wall -I/usr/include/aarch64-linux-gnu runner/*.cpp
//     -o kselect_acl_runner -L/usr/lib/aarch64-linux-gnu -larm_compute -larm_compute_core -lpthread -ldl
// (natively with g++ on an aarch64 host) and caches the binary.

#include "arm_compute/core/CPP/CPPTypes.h"
#include "arm_compute/core/Version.h"
#include "arm_compute/core/TensorInfo.h"
#include "arm_compute/runtime/NEON/functions/NECast.h"
#include "arm_compute/runtime/NEON/functions/NEDepthwiseConvolutionLayer.h"
#include "arm_compute/runtime/NEON/functions/NEFullyConnectedLayer.h"
#include "arm_compute/runtime/NEON/functions/NEGEMMConvolutionLayer.h"
#include "arm_compute/runtime/Scheduler.h"

#include <cstddef>
#include <cstdio>
#include <exception>
#include <functional>
#include <iostream>
#include <string>

#include "acl_version.hpp"
#include "engine.hpp"
#include "gemm_forcing.hpp"
#include "json.hpp"
#include "ops.hpp"
#include "request.hpp"
#include "scheduler.hpp"
#include "single_op.hpp"

using namespace arm_compute;

namespace ks
{
static const int PROTOCOL_VERSION = 1;

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

namespace ext
{
// Knobs of 24.11 that 20.08 lacks and the runner does not offer yet, each with what ACL says about
// it here: whether this build and CPU have it (*present) and why it is not a candidate.

// Fixed-format weights (WeightsInfo's WeightFormat: arm_gemm's "ff" kernels read weights the caller
// laid out in a blocked format), asked of ACL for a small fp32 NHWC conv.
std::string fixed_format_reason(bool *present)
{
#if KS_ACL_24
    TensorInfo src(TensorShape(16U, 8U, 8U, 1U), 1, DataType::F32), weights(TensorShape(16U, 3U, 3U, 16U), 1, DataType::F32), dst(TensorShape(16U, 8U, 8U, 1U), 1, DataType::F32);
    for(TensorInfo *t : { &src, &weights, &dst })
        t->set_data_layout(DataLayout::NHWC);
    arm_compute::WeightFormat expected = arm_compute::WeightFormat::UNSPECIFIED;
    Status                    status   = NEGEMMConvolutionLayer::has_opt_impl(expected, &src, &weights, nullptr, &dst, PadStrideInfo(1, 1, 1, 1),
                                                                   WeightsInfo(false, 3, 3, 16, false, arm_compute::WeightFormat::ANY));
    *present = bool(status);
    if(!*present)
        return "no fixed-format kernels in this ACL build (NEGEMMConvolutionLayer::has_opt_impl with WeightFormat::ANY: " + status.error_description() + ")";
    return "this ACL build has fixed-format kernels (a 3x3 conv's asks for OHWIo" + std::to_string(interleave_by(expected)) + "i" + std::to_string(block_by(expected)) +
           (is_fixed_format_fast_math(expected) ? "_bf16" : "") + " weights); kselect does not offer them yet";
#else
    *present = false;
    return "ACL 20.08 has no fixed-format weights (WeightFormat and has_opt_impl came in later releases)";
#endif
}

// Fast math for a GEMM convolution: 24.11 then runs fp32 GEMMs on its bf16 kernels where the CPU
// has BF16; the runner validates and runs it there (gemm_fast_math_here()).
std::string gemm_fast_math_reason(bool *present)
{
#if KS_ACL_24
    *present = gemm_fast_math_here();
    if(*present)
    {
        std::string names;
        for(const std::string &name : fast_mode_kernels())
            names += (names.empty() ? "" : ", ") + name;
        return "ok: ACL 24.11 runs a GEMM conv with fast math on its bf16 kernels on this CPU (" + names + ")";
    }
    if(!Scheduler::get().cpu_info().has_bf16())
        return "ACL 24.11 runs a GEMM with fast math on its bf16 kernels, which need BF16: CPUInfo::has_bf16 is false on this CPU";
    if(!gemm_forcing_ok())
        return "this CPU has BF16, but whether this ACL build has fast-mode kernels cannot be asked (arm_gemm introspection unavailable: " + gemm_forcing_reason() + ")";
    return "this CPU has BF16, but this ACL build has no fast-mode (bf16) kernels for an fp32 GEMM: arm_gemm lists the same kernels with fast mode on, so fast math would change nothing";
#else
    *present = false;
    return "ACL 20.08's GEMM convolution takes no fast-math flag (only its Winograd convolution does)";
#endif
}

// The "extensions" section of info.
std::string info_json()
{
    bool              fixed_format = false, gemm_fast_math = false;
    const std::string fixed_format_why = fixed_format_reason(&fixed_format), gemm_fast_math_why = gemm_fast_math_reason(&gemm_fast_math);
    Obj               o;
    o.boolean("gemm_forcing", gemm_forcing_ok())
        .str("gemm_forcing_reason", gemm_forcing_reason())
        .boolean("cpu_model_hint", KS_ACL_CPU_MODEL_HINT)
        .boolean("fixed_format", fixed_format)
        .str("fixed_format_reason", fixed_format_why)
        .boolean("gemm_fast_math", gemm_fast_math)
        .str("gemm_fast_math_reason", gemm_fast_math_why)
        .raw("schedulers", "[\"default\",\"record\",\"split\"]");
    std::string own = "[";
    for(size_t i = 0; i < kernels_splitting_by_thread_id().size(); ++i)
        own += (i ? "," : "") + jstr(kernels_splitting_by_thread_id()[i]);
    o.raw("kernels_splitting_by_thread_id", own + "]");
    return o.done();
}
} // namespace ext

// Whether this ACL build computes in F16 here, asked of ACL itself: validate() of a small F16 conv
// (GEMM method), depthwise conv and fc, and of the F32 -> F16 cast around them. Each is "ok" or
// ACL's reason. A build compiled for plain Armv8-a (Debian's 20.08: arch=arm64-v8a) refuses F16
// ("This CPU architecture does not support F16 data type, you need v8.2 or above") even where
// CPUInfo::has_fp16() is true; 24.11 compiles its F16 kernels apart and enables them on CPUs with
// FP16 arithmetic.
std::string f16_support_json()
{
    const DataType F16 = DataType::F16;
    auto           answer = [](const std::function<Status()> &validate) -> std::string {
        try
        {
            const Status st = validate();
            return st.error_code() == ErrorCode::OK ? "ok" : st.error_description();
        }
        catch(const std::exception &e)
        {
            return e.what();
        }
    };
    // NCHW shapes in ACL's order (W, H, C, N): 8x8x4 input, 3x3 kernels, no padding
    TensorInfo conv_in(TensorShape(8U, 8U, 4U, 1U), 1, F16), conv_w(TensorShape(3U, 3U, 4U, 8U), 1, F16), conv_b(TensorShape(8U), 1, F16),
        conv_out(TensorShape(6U, 6U, 8U, 1U), 1, F16);
    TensorInfo dw_w(TensorShape(3U, 3U, 4U), 1, F16), dw_b(TensorShape(4U), 1, F16), dw_out(TensorShape(6U, 6U, 4U, 1U), 1, F16);
    // fc: input (K=16, N=1), weights (K, M=8)
    TensorInfo fc_in(TensorShape(16U, 1U), 1, F16), fc_w(TensorShape(16U, 8U), 1, F16), fc_b(TensorShape(8U), 1, F16), fc_out(TensorShape(8U, 1U), 1, F16);
    TensorInfo cast_in(TensorShape(8U, 8U, 4U, 1U), 1, DataType::F32), cast_out(TensorShape(8U, 8U, 4U, 1U), 1, F16);
    const PadStrideInfo no_pad(1, 1, 0, 0);
    Obj                 o;
    o.str("conv", answer([&] { return NEGEMMConvolutionLayer::validate(&conv_in, &conv_w, &conv_b, &conv_out, no_pad); }))
        .str("depthwise", answer([&] { return NEDepthwiseConvolutionLayer::validate(&conv_in, &dw_w, &dw_b, &dw_out, no_pad); }))
        .str("fc", answer([&] { return NEFullyConnectedLayer::validate(&fc_in, &fc_w, &fc_b, &fc_out); }))
        .str("cast", answer([&] { return NECast::validate(&cast_in, &cast_out, ConvertPolicy::SATURATE); }));
    return o.done();
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
        .raw("f16_support", f16_support_json())
        .integer("default_threads", Scheduler::get().num_threads())
        .raw("methods", methods)
        .raw("ops", "[\"conv\",\"fc\",\"deconv\",\"permute\",\"quantize\",\"dequantize\"]")
        .raw("precisions", "[\"fp32\",\"int8\"]") // int8: a conv / fc request's "quant" (PROTOCOL.md)
        .raw("actions", "[\"info\",\"validate\",\"run\",\"gemm_kernels\",\"model_load\",\"model_run\",\"model_free\"]")
        .raw("extensions", ext::info_json());
    return o.done();
}

std::string handle(const std::string &line)
{
    JVal req = parse_json(line);
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
    if((op == "quantize" || op == "dequantize") && action == "run")
        return quantize_run(req, op == "dequantize");
    throw BadRequest("unknown op '" + op + "' (conv, fc, deconv; permute, quantize, dequantize for run)");
}

std::string with_id(const std::string &response, const std::string &line)
{
    // Echo the request's "id" (if any) so that a client can pair requests and answers.
    try
    {
        JVal        req = parse_json(line);
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
    ks::ext::scheduler_startup();
    ks::ext::check_gemm_abi();
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
        ks::ext::reset_gemm_forcing();
        ks::ext::reset_kernel_records();
        std::cout << ks::with_id(resp, line) << "\n";
        std::cout.flush();
    }
    return 0;
}
