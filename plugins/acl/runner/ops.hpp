// Single-op builders shared by the single-op requests and the model engine: the conv, deconv and fc
// specs parsed from a request or graph node, their static validation per method / layout, and the
// configure() of the ACL function a conv method names.
#pragma once

#include <cstddef>
#include <memory>
#include <string>
#include <vector>

#include "arm_compute/core/Error.h"
#include "arm_compute/core/TensorInfo.h"
#include "arm_compute/core/Types.h"

#include "tensors.hpp"

namespace arm_compute
{
class IFunction;
class ITensor;
} // namespace arm_compute

namespace ks
{
struct JVal;

// ---------------------------------------------------------------------------------------------
// Quantized data (a conv / fc request's "quant", PROTOCOL.md "int8"): activations (input and
// output) QASYMM8 or QASYMM8_SIGNED, weights QSYMM8_PER_CHANNEL (one scale per output channel,
// zero point 0) or QASYMM8 / QASYMM8_SIGNED (one scale and zero point), bias S32 (scale
// x_scale * w_scale of its channel). Zero points are in the range of their own type.
// ---------------------------------------------------------------------------------------------
struct QuantSpec
{
    bool                  enabled = false;
    arm_compute::DataType data    = arm_compute::DataType::F32; // input and output
    arm_compute::DataType weights = arm_compute::DataType::F32;
    float                 x_scale = 1.f;
    int                   x_zero_point = 0;
    std::vector<float>    w_scales; // one per output channel (QSYMM8_PER_CHANNEL) or one
    int                   w_zero_point = 0;
    float                 y_scale      = 1.f;
    int                   y_zero_point = 0;

    arm_compute::QuantizationInfo input_info() const;
    arm_compute::QuantizationInfo weights_info() const;
    arm_compute::QuantizationInfo output_info() const;
    // A fused (LU_)BOUNDED_RELU's bounds clamped to the range the output can represent (values
    // beyond it saturate anyway; ACL would quantize e.g. FLT_MAX into an overflowing integer).
    arm_compute::ActivationLayerInfo clamp(const arm_compute::ActivationLayerInfo &act) const;
};
// The request's "quant" object for an op of `channels` output channels; disabled when absent.
QuantSpec          parse_quant(const JVal &req, size_t channels);
std::string        data_type_name(arm_compute::DataType t);
// "data_type" / "weights_type" / "bias_type" fields of an answer ("" when not quantized).
std::string        quant_fields(const QuantSpec &q);

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
    arm_compute::ActivationLayerInfo actinfo; // fused activation ("relu": true or an "act" object)
    size_t OH, OW;
    QuantSpec quant; // int8: quantized tensors (absent: F32)

    bool depthwise() const { return group > 1 && group == C && O % C == 0 && CI == 1; }
    arm_compute::PadStrideInfo pad_stride() const
    {
        return arm_compute::PadStrideInfo(static_cast<unsigned>(sw), static_cast<unsigned>(sh), static_cast<unsigned>(pl), static_cast<unsigned>(pr), static_cast<unsigned>(pt), static_cast<unsigned>(pb),
                                          arm_compute::DimensionRoundingType::FLOOR);
    }
    arm_compute::Size2D dilation() const { return arm_compute::Size2D(dw, dh); }
    arm_compute::ActivationLayerInfo act() const { return actinfo; }
    std::vector<size_t> in_dims() const { return { N, C, H, W }; }
    std::vector<size_t> w_dims() const { return { O, CI, KH, KW }; }
    std::vector<size_t> out_dims() const { return { N, O, OH, OW }; }
};

// A fused activation: "relu": true, or "act": {"fn": "RELU" | "BOUNDED_RELU" | "LU_BOUNDED_RELU" |
// "LEAKY_RELU" | "LOGISTIC" | "TANH", "a": .., "b": ..} (ACL's ActivationLayerInfo parameters).
arm_compute::ActivationLayerInfo act_from(const JVal &a);
arm_compute::ActivationLayerInfo parse_act(const JVal &req, bool relu);
ConvSpec parse_conv(const JVal &req);

struct ConvTensors
{
    Mapping                 in_m, w_m, b_m, out_m;
    arm_compute::TensorInfo in_i, w_i, b_i, out_i;
};
ConvTensors conv_infos(const ConvSpec &s, arm_compute::DataLayout layout, bool depthwise_weights);

// Whether a GEMM conv can run with fast math here (ACL 24.11 on a CPU with BF16, in a build with
// arm_gemm's fast-mode bf16 kernels); where not, fast math is refused for the GEMM method rather
// than ignored.
bool gemm_fast_math_here();

// GEMM, WINOGRAD, DIRECT, FFT, DEPTHWISE, AUTO
const std::vector<std::string> &all_methods();
// Static validation of one (method, layout, fast_math) candidate: OK or a reason (never throws).
arm_compute::Status safe_validate(const ConvSpec &s, const std::string &method, arm_compute::DataLayout layout, bool fast_math);
// What the library itself would do (NEConvolutionLayer's heuristic).
std::string acl_pick(const ConvSpec &s, arm_compute::DataLayout layout, bool fast_math);
// Configure the ACL function of one conv method (tensors: initialised, not necessarily allocated).
std::unique_ptr<arm_compute::IFunction> make_conv(const ConvSpec &s, const std::string &method, bool fm, arm_compute::ITensor *in, arm_compute::ITensor *w, arm_compute::ITensor *bias,
                                                  arm_compute::ITensor *out, const ConvTensors &ti, std::string *effective);

// ---------------------------------------------------------------------------------------------
// Fully connected: input (N,K), weights (M,K) as in ONNX Gemm(transB=1) / torch Linear, bias (M)
// ---------------------------------------------------------------------------------------------
struct FcSpec
{
    size_t N, K, M;
    bool   has_bias, relu;
    arm_compute::ActivationLayerInfo act;   // "relu": true or an "act" object
    QuantSpec                        quant; // int8: quantized tensors (absent: F32)
};
FcSpec parse_fc(const JVal &req);

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

    arm_compute::PadStrideInfo pad_stride() const
    {
        return arm_compute::PadStrideInfo(static_cast<unsigned>(sw), static_cast<unsigned>(sh), static_cast<unsigned>(pl), static_cast<unsigned>(pr), static_cast<unsigned>(pt), static_cast<unsigned>(pb),
                                          arm_compute::DimensionRoundingType::FLOOR);
    }
    std::vector<size_t> in_dims() const { return { N, C, H, W }; }
    std::vector<size_t> w_dims() const { return { O, C, KH, KW }; }
    std::vector<size_t> out_dims() const { return { N, O, OH, OW }; }
};
DeconvSpec          parse_deconv(const JVal &req);
ConvTensors         deconv_infos(const DeconvSpec &s, arm_compute::DataLayout layout);
arm_compute::Status validate_deconv(const DeconvSpec &s, arm_compute::DataLayout layout); // never throws
} // namespace ks
