// Conv / deconv / fc specs, validation and configuration (ops.hpp).
#include "ops.hpp"

#include "arm_compute/runtime/IFunction.h"
#include "arm_compute/runtime/NEON/functions/NEConvolutionLayer.h"
#include "arm_compute/runtime/NEON/functions/NEDeconvolutionLayer.h"
#include "arm_compute/runtime/NEON/functions/NEDepthwiseConvolutionLayer.h"
#include "arm_compute/runtime/NEON/functions/NEDirectConvolutionLayer.h"
#include "arm_compute/runtime/NEON/functions/NEFFTConvolutionLayer.h"
#include "arm_compute/runtime/NEON/functions/NEGEMMConvolutionLayer.h"
#include "arm_compute/runtime/NEON/functions/NEWinogradConvolutionLayer.h"

#include <algorithm>
#include <cmath>
#include <exception>
#include <utility>

#include "arm_compute/runtime/Scheduler.h"

#include "acl_version.hpp"
#include "gemm_forcing.hpp"
#include "request.hpp"

using namespace arm_compute;

// 24.11's NEGEMMConvolutionLayer takes enable_fast_math before num_groups (20.08: no such argument;
// a group count passed in its place would silently turn into fast math). With it, arm_gemm may run
// the fp32 GEMM on its bf16 kernels where the CPU has BF16 (gemm_fast_math_here()).
#if KS_ACL_24
#define GEMM_FAST_MATH(fm) fm,
#else
#define GEMM_FAST_MATH(fm)
#endif

namespace ks
{
std::string conv_method_name(ConvolutionMethod m)
{
    switch(m)
    {
        case ConvolutionMethod::GEMM: return "GEMM";
        case ConvolutionMethod::DIRECT: return "DIRECT";
        case ConvolutionMethod::WINOGRAD: return "WINOGRAD";
        case ConvolutionMethod::FFT: return "FFT";
#if KS_ACL_24
        case ConvolutionMethod::GEMM_CONV2D: return "GEMM_CONV2D";
        case ConvolutionMethod::INDIRECT: return "INDIRECT";
#endif
        default: return "UNKNOWN";
    }
}


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

// ---------------------------------------------------------------------------------------------
// Quantized data
// ---------------------------------------------------------------------------------------------
std::string data_type_name(DataType t)
{
    switch(t)
    {
        case DataType::F32: return "F32";
        case DataType::QASYMM8: return "QASYMM8";
        case DataType::QASYMM8_SIGNED: return "QASYMM8_SIGNED";
        case DataType::QSYMM8_PER_CHANNEL: return "QSYMM8_PER_CHANNEL";
        case DataType::S32: return "S32";
        default: return "OTHER";
    }
}

QuantizationInfo QuantSpec::input_info() const
{
    return QuantizationInfo(x_scale, x_zero_point);
}
QuantizationInfo QuantSpec::weights_info() const
{
    if(weights == DataType::QSYMM8_PER_CHANNEL)
        return QuantizationInfo(w_scales);
    return QuantizationInfo(w_scales.at(0), w_zero_point);
}
QuantizationInfo QuantSpec::output_info() const
{
    return QuantizationInfo(y_scale, y_zero_point);
}

ActivationLayerInfo QuantSpec::clamp(const ActivationLayerInfo &act) const
{
    using AF = ActivationLayerInfo::ActivationFunction;
    if(!enabled || !act.enabled() || (act.activation() != AF::BOUNDED_RELU && act.activation() != AF::LU_BOUNDED_RELU))
        return act;
    const int   qmin = data == DataType::QASYMM8 ? 0 : -128, qmax = data == DataType::QASYMM8 ? 255 : 127;
    const float lo = static_cast<float>(qmin - y_zero_point) * y_scale, hi = static_cast<float>(qmax - y_zero_point) * y_scale;
    const float a = std::min(act.a(), hi);
    if(act.activation() == AF::BOUNDED_RELU)
        return ActivationLayerInfo(AF::BOUNDED_RELU, a);
    return ActivationLayerInfo(AF::LU_BOUNDED_RELU, a, std::min(std::max(act.b(), lo), a));
}

static int zero_point_in_range(const JVal &q, const std::string &key, DataType t)
{
    const long long zp = opt_int(q, key, 0);
    const long long lo = t == DataType::QASYMM8 ? 0 : -128, hi = t == DataType::QASYMM8 ? 255 : 127;
    if(zp < lo || zp > hi)
        throw BadRequest("quant." + key + " " + std::to_string(zp) + " is outside " + data_type_name(t) + "'s range [" + std::to_string(lo) + ", " + std::to_string(hi) + "]");
    return static_cast<int>(zp);
}

static float positive_scale(const JVal &q, const std::string &key)
{
    const double v = opt_num(q, key, 1.0);
    if(!(v > 0) || !std::isfinite(v))
        throw BadRequest("quant." + key + " must be a positive number");
    return static_cast<float>(v);
}

QuantSpec parse_quant(const JVal &req, size_t channels)
{
    QuantSpec   q;
    const JVal *j = req.get("quant");
    if(j == nullptr || j->type == JVal::NUL)
        return q;
    if(j->type != JVal::OBJ)
        throw BadRequest("'quant' must be an object {\"input\":..,\"weights\":..,...}");
    q.enabled             = true;
    const std::string in  = upper(opt_str(*j, "input", "QASYMM8_SIGNED"));
    const std::string wts = upper(opt_str(*j, "weights", "QSYMM8_PER_CHANNEL"));
    if(in == "QASYMM8")
        q.data = DataType::QASYMM8;
    else if(in == "QASYMM8_SIGNED")
        q.data = DataType::QASYMM8_SIGNED;
    else
        throw BadRequest("quant.input must be QASYMM8 or QASYMM8_SIGNED, got '" + in + "'");
    if(wts == "QSYMM8_PER_CHANNEL")
        q.weights = DataType::QSYMM8_PER_CHANNEL;
    else if(wts == "QASYMM8")
        q.weights = DataType::QASYMM8;
    else if(wts == "QASYMM8_SIGNED")
        q.weights = DataType::QASYMM8_SIGNED;
    else
        throw BadRequest("quant.weights must be QSYMM8_PER_CHANNEL, QASYMM8 or QASYMM8_SIGNED, got '" + wts + "'");
    q.x_scale      = positive_scale(*j, "x_scale");
    q.x_zero_point = zero_point_in_range(*j, "x_zero_point", q.data);
    q.y_scale      = positive_scale(*j, "y_scale");
    q.y_zero_point = zero_point_in_range(*j, "y_zero_point", q.data);
    const bool   per_channel = q.weights == DataType::QSYMM8_PER_CHANNEL;
    const size_t want        = per_channel ? channels : 1;
    const JVal  *ws          = j->get("w_scales");
    if(ws == nullptr || ws->type == JVal::NUL)
        q.w_scales.assign(want, 1.f);
    else
    {
        if(ws->type != JVal::ARR || ws->a.size() != want)
            throw BadRequest("quant.w_scales must be a list of " + std::to_string(want) + (per_channel ? " scales (one per output channel)" : " scale (per-tensor weights)"));
        for(const auto &v : ws->a)
        {
            if(v.type != JVal::NUM || !(v.n > 0) || !std::isfinite(v.n))
                throw BadRequest("quant.w_scales must be positive numbers");
            q.w_scales.push_back(static_cast<float>(v.n));
        }
    }
    if(per_channel)
    {
        if(opt_int(*j, "w_zero_point", 0) != 0)
            throw BadRequest("quant.w_zero_point must be 0 for QSYMM8_PER_CHANNEL weights");
    }
    else
        q.w_zero_point = zero_point_in_range(*j, "w_zero_point", q.weights);
    return q;
}

std::string quant_fields(const QuantSpec &q)
{
    if(!q.enabled)
        return "";
    Obj o;
    o.str("data_type", data_type_name(q.data)).str("weights_type", data_type_name(q.weights)).str("bias_type", "S32");
    return o.body;
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
    s.quant   = parse_quant(req, s.O);
    s.actinfo = s.quant.clamp(s.actinfo);
    return s;
}

ConvTensors tensor_infos(const Mapping &in, const Mapping &w, size_t channels, const Mapping &out, DataLayout layout, const QuantSpec &q = QuantSpec())
{
    ConvTensors t{ in, w, map1(channels), out, {}, {}, {}, {} };
    if(!q.enabled)
    {
        t.in_i  = TensorInfo(t.in_m.acl_shape(), 1, DataType::F32, layout);
        t.w_i   = TensorInfo(t.w_m.acl_shape(), 1, DataType::F32, layout);
        t.b_i   = TensorInfo(t.b_m.acl_shape(), 1, DataType::F32, layout);
        t.out_i = TensorInfo(t.out_m.acl_shape(), 1, DataType::F32, layout);
        return t;
    }
    t.in_i  = TensorInfo(t.in_m.acl_shape(), 1, q.data, q.input_info());
    t.w_i   = TensorInfo(t.w_m.acl_shape(), 1, q.weights, q.weights_info());
    t.b_i   = TensorInfo(t.b_m.acl_shape(), 1, DataType::S32);
    t.out_i = TensorInfo(t.out_m.acl_shape(), 1, q.data, q.output_info());
    for(TensorInfo *i : { &t.in_i, &t.w_i, &t.b_i, &t.out_i })
        i->set_data_layout(layout);
    return t;
}

ConvTensors conv_infos(const ConvSpec &s, DataLayout layout, bool depthwise_weights)
{
    return tensor_infos(map4(s.in_dims(), layout), depthwise_weights ? map_dw_weights(s.w_dims(), layout) : map4(s.w_dims(), layout), s.O,
                        map4(s.out_dims(), layout), layout, s.quant);
}

const std::vector<std::string> &all_methods()
{
    static const std::vector<std::string> m = { "GEMM", "WINOGRAD", "DIRECT", "FFT", "DEPTHWISE", "AUTO" };
    return m;
}

bool gemm_fast_math_here()
{
#if KS_ACL_24
    // asked on first use, after the start-up ABI check that fast_mode_kernels() relies on
    static const bool here = Scheduler::get().cpu_info().has_bf16() && !ext::fast_mode_kernels().empty();
    return here;
#else
    return false;
#endif
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
    {
        if(fast_math && !gemm_fast_math_here())
            return Status(ErrorCode::RUNTIME_ERROR, "GEMM fast math needs ACL 24.11 and a CPU with BF16");
        return NEGEMMConvolutionLayer::validate(&t.in_i, &t.w_i, bias, &t.out_i, s.pad_stride(), WeightsInfo(), s.dilation(), s.act(), GEMM_FAST_MATH(fast_math) static_cast<unsigned>(s.group));
    }
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
        if(fm && !gemm_fast_math_here())
            throw Unsupported("GEMM fast math needs ACL 24.11 and a CPU with BF16");
        f->configure(in, w, bias, out, s.pad_stride(), WeightsInfo(), s.dilation(), s.act(), GEMM_FAST_MATH(fm) static_cast<unsigned>(s.group));
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
    FcSpec s{ static_cast<size_t>(in[0]), static_cast<size_t>(in[1]), static_cast<size_t>(w[0]), opt_bool(req, "bias", true), opt_bool(req, "relu", false), {}, {} };
    s.act   = parse_act(req, s.relu);
    s.quant = parse_quant(req, s.M);
    s.act   = s.quant.clamp(s.act);
    return s;
}

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
} // namespace ks
