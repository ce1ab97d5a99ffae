// Single-op validate / run actions (single_op.hpp).
#include "single_op.hpp"

#include "arm_compute/core/Error.h"
#include "arm_compute/core/TensorInfo.h"
#include "arm_compute/core/Types.h"
#include "arm_compute/runtime/IFunction.h"
#include "arm_compute/runtime/Tensor.h"
#include "arm_compute/runtime/NEON/functions/NEDeconvolutionLayer.h"
#include "arm_compute/runtime/NEON/functions/NEDequantizationLayer.h"
#include "arm_compute/runtime/NEON/functions/NEFullyConnectedLayer.h"
#include "arm_compute/runtime/NEON/functions/NEPermute.h"
#include "arm_compute/runtime/NEON/functions/NEQuantizationLayer.h"

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <memory>
#include <vector>

#include "gemm_forcing.hpp"
#include "json.hpp"
#include "ops.hpp"
#include "request.hpp"
#include "scheduler.hpp"
#include "tensors.hpp"
#include "timing.hpp"

using namespace arm_compute;

namespace ks
{
// An answer's fields for quantized data ("data_type", "weights_type", "bias_type"), if any.
static void add_quant_fields(Obj &o, const QuantSpec &q)
{
    const std::string fields = quant_fields(q);
    if(!fields.empty())
        o.body += (o.body.empty() ? "" : ",") + fields;
}

// arm_gemm kernel forcing covers the fp32 GEMMs only (gemm_forcing.cpp): a quantized op that asks
// for a kernel is refused rather than silently run with the default one.
static std::string refuse_forcing_of_int8(const QuantSpec &q, const JVal &cfg)
{
    if(!q.enabled || opt_str(cfg, "gemm_kernel", "").empty())
        return "";
    Obj o;
    o.boolean("ok", false).str("action", "run").str("error_kind", "unsupported").str("error", "runner: gemm_kernel forcing covers fp32 GEMMs only, not quantized ones");
    return o.done();
}

// A quantized op's data loaded (files of its element types, PROTOCOL.md) or drawn from `seed`
// into its allocated tensors: input of the activation type, weights of the weights type, S32 bias.
static void fill_quantized(const JVal &req, const QuantSpec &q, Tensor &in, const Mapping &in_m, Tensor &w, const Mapping &w_m, Tensor *bias, const Mapping &b_m)
{
    const uint32_t seed = static_cast<uint32_t>(opt_int(req, "seed", 1));
    if(q.data == DataType::QASYMM8)
    {
        std::vector<uint8_t> v = load_or_random_typed<uint8_t>(req, "input_path", in_m.count(), seed, 0, 255);
        copy_logical_typed<uint8_t, true>(in, in_m, v.data());
    }
    else
    {
        std::vector<int8_t> v = load_or_random_typed<int8_t>(req, "input_path", in_m.count(), seed, -128, 127);
        copy_logical_typed<int8_t, true>(in, in_m, v.data());
    }
    if(q.weights == DataType::QASYMM8)
    {
        std::vector<uint8_t> v = load_or_random_typed<uint8_t>(req, "weights_path", w_m.count(), seed + 1, 1, 255);
        copy_logical_typed<uint8_t, true>(w, w_m, v.data());
    }
    else
    {
        std::vector<int8_t> v = load_or_random_typed<int8_t>(req, "weights_path", w_m.count(), seed + 1, -127, 127);
        copy_logical_typed<int8_t, true>(w, w_m, v.data());
    }
    if(bias != nullptr)
    {
        std::vector<int32_t> v = load_or_random_typed<int32_t>(req, "bias_path", b_m.count(), seed + 2, -1000, 1000);
        copy_logical_typed<int32_t, true>(*bias, b_m, v.data());
    }
}

static void save_quantized_output(const JVal &req, const QuantSpec &q, Tensor &out, const Mapping &out_m)
{
    if(q.data == DataType::QASYMM8)
        save_output_typed<uint8_t>(req, out, out_m);
    else
        save_output_typed<int8_t>(req, out, out_m);
}

// ---------------------------------------------------------------------------------------------
// Convolution
// ---------------------------------------------------------------------------------------------
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
                if(fm && m != "WINOGRAD" && m != "AUTO" && !(m == "GEMM" && gemm_fast_math_here()))
                    continue;
                Status st = safe_validate(s, m, layout, fm);
                Obj    o;
                o.str("method", m).str("layout", layout_name(layout)).boolean("fast_math", fm).boolean("ok", bool(st));
                if(!bool(st))
                    o.str("reason", st.error_description());
                else if(with_gemms && !s.quant.enabled && (m == "GEMM" || m == "WINOGRAD" || m == "AUTO"))
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
    add_quant_fields(out, s.quant);
    return out.done();
}

// prepare() (timed apart: prepare_us), warm-up runs, then timed runs while keep_timing() says so;
// the scheduler's per-kernel records cover the timed runs only.
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

// A configured conv-like function's tensors allocated and filled (files named by the request, else
// seeded random data), the function timed, its output saved: the rest of a conv or deconv "run".
void fill_time_and_save(IFunction &fn, const JVal &req, const ConvTensors &ti, Tensor &in, Tensor &w, Tensor *bias, Tensor &out, Timing &tm,
                        const QuantSpec &q = QuantSpec())
{
    in.allocator()->allocate();
    w.allocator()->allocate();
    if(bias != nullptr)
        bias->allocator()->allocate();
    out.allocator()->allocate();
    if(q.enabled)
    {
        fill_quantized(req, q, in, ti.in_m, w, ti.w_m, bias, ti.b_m);
        time_function(fn, req, tm);
        save_quantized_output(req, q, out, ti.out_m);
        return;
    }
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
    const JVal &cfg    = obj_or_empty(req, "config");
    std::string method = upper(opt_str(cfg, "method", "AUTO"));
    DataLayout  layout = parse_layout(opt_str(cfg, "layout", "NCHW"));
    bool        fm     = opt_bool(cfg, "fast_math", false);
    if(std::find(all_methods().begin(), all_methods().end(), method) == all_methods().end())
        throw BadRequest("unknown method '" + method + "'");

    int threads = 0;
    apply_cpu_config(cfg, &threads);
    const std::string refused = refuse_forcing_of_int8(s.quant, cfg);
    if(!refused.empty())
        return refused;

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

    fill_time_and_save(*fn, req, ti, in, w, s.has_bias ? &b : nullptr, out, tm, s.quant);

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
    add_quant_fields(o, s.quant);
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
    const JVal &cfg   = obj_or_empty(req, "config");
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
// Precision change: one NEQuantizationLayer (float -> "quant.input" type, op "quantize") or
// NEDequantizationLayer (back to float, op "dequantize") of a tensor, what the engine inserts
// where a tensor passes between a float op and an int8 op. Files are logical order: float32 and
// 8-bit integers of the quantized type.
// ---------------------------------------------------------------------------------------------
std::string quantize_run(const JVal &req, bool dequantize)
{
    const std::string   op = dequantize ? "dequantize" : "quantize";
    std::vector<size_t> dims;
    const JVal         *in = req.get("input");
    if(in == nullptr || in->type != JVal::ARR || in->a.empty() || in->a.size() > 4 || in->a.size() == 3)
        throw BadRequest(op + ": 'input' must be the dims of a rank 1, 2 or 4 tensor");
    for(const auto &d : in->a)
    {
        const long long v = as_int(d, "input");
        if(v <= 0)
            throw BadRequest(op + ": 'input' dims must be positive");
        dims.push_back(static_cast<size_t>(v));
    }
    const QuantSpec q = parse_quant(req, 1);
    if(!q.enabled)
        throw BadRequest(op + " needs 'quant': {\"input\": QASYMM8 | QASYMM8_SIGNED, \"x_scale\", \"x_zero_point\"}");
    const JVal &cfg    = obj_or_empty(req, "config");
    DataLayout  layout = parse_layout(opt_str(cfg, "layout", "NCHW"));
    int         threads = 0;
    apply_cpu_config(cfg, &threads);

    Mapping m = dims.size() == 4 ? map4(dims, layout) : dims.size() == 2 ? map2(dims[0], dims[1]) : map1(dims[0]);
    TensorInfo f_i(m.acl_shape(), 1, DataType::F32), q_i(m.acl_shape(), 1, q.data, q.input_info());
    f_i.set_data_layout(layout);
    q_i.set_data_layout(layout);
    Tensor src, dst;
    src.allocator()->init(dequantize ? q_i : f_i);
    dst.allocator()->init(dequantize ? f_i : q_i);
    Status st = dequantize ? NEDequantizationLayer::validate(src.info(), dst.info()) : NEQuantizationLayer::validate(src.info(), dst.info());
    if(!bool(st))
    {
        Obj o;
        o.boolean("ok", false).str("action", "run").str("error_kind", "unsupported").str("error", (dequantize ? "NEDequantizationLayer" : "NEQuantizationLayer") + std::string("::validate(): ") + st.error_description());
        return o.done();
    }
    Timing                     tm;
    auto                       t0 = Clock::now();
    std::unique_ptr<IFunction> fn;
    if(dequantize)
    {
        auto f = std::make_unique<NEDequantizationLayer>();
        f->configure(&src, &dst);
        fn = std::move(f);
    }
    else
    {
        auto f = std::make_unique<NEQuantizationLayer>();
        f->configure(&src, &dst);
        fn = std::move(f);
    }
    tm.configure_us = us_since(t0);
    src.allocator()->allocate();
    dst.allocator()->allocate();
    const uint32_t seed = static_cast<uint32_t>(opt_int(req, "seed", 1));
    if(!dequantize)
    {
        std::vector<float> v = load_or_random(req, "input_path", m.count(), seed);
        copy_logical<true>(src, m, v.data());
    }
    else if(q.data == DataType::QASYMM8)
    {
        std::vector<uint8_t> v = load_or_random_typed<uint8_t>(req, "input_path", m.count(), seed, 0, 255);
        copy_logical_typed<uint8_t, true>(src, m, v.data());
    }
    else
    {
        std::vector<int8_t> v = load_or_random_typed<int8_t>(req, "input_path", m.count(), seed, -128, 127);
        copy_logical_typed<int8_t, true>(src, m, v.data());
    }
    time_function(*fn, req, tm);
    if(dequantize)
        save_output(req, dst, m);
    else
        save_quantized_output(req, q, dst, m);
    Obj o;
    o.boolean("ok", true).str("action", "run").str("op", op).str("layout", layout_name(layout)).integer("threads", threads).raw("output", jints(dims)).str("data_type", data_type_name(q.data));
    add_timing(o, tm);
    return o.done();
}

// ---------------------------------------------------------------------------------------------
// Fully connected: input (N,K), weights (M,K) as in ONNX Gemm(transB=1) / torch Linear, bias (M)
// ---------------------------------------------------------------------------------------------
std::string fc_request(const JVal &req, bool run)
{
    FcSpec      s      = parse_fc(req);
    const JVal &cfg    = obj_or_empty(req, "config");
    Mapping     in_m   = map2(s.N, s.K);
    Mapping     w_m    = map2(s.M, s.K); // ACL shape (K, M): transposed by the function (transpose_weights=true)
    Mapping     b_m    = map1(s.M);
    Mapping     out_m  = map2(s.N, s.M);
    TensorInfo  in_i(in_m.acl_shape(), 1, DataType::F32), w_i(w_m.acl_shape(), 1, DataType::F32), b_i(b_m.acl_shape(), 1, DataType::F32), out_i(out_m.acl_shape(), 1, DataType::F32);
    const QuantSpec &q = s.quant;
    if(q.enabled)
    {
        in_i  = TensorInfo(in_m.acl_shape(), 1, q.data, q.input_info());
        w_i   = TensorInfo(w_m.acl_shape(), 1, q.weights, q.weights_info());
        b_i   = TensorInfo(b_m.acl_shape(), 1, DataType::S32);
        out_i = TensorInfo(out_m.acl_shape(), 1, q.data, q.output_info());
    }
    FullyConnectedLayerInfo fc_info;
    fc_info.activation_info = s.act; // "relu": true (fp32 requests) or "act"
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
        else if(opt_bool(req, "with_gemms", false) && !q.enabled)
        {
            if(req.get("config") != nullptr && req.get("config")->type == JVal::OBJ)
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
        add_quant_fields(o, q);
        return o.done();
    }
    int threads = 0;
    apply_cpu_config(cfg, &threads);
    const std::string refused = refuse_forcing_of_int8(q, cfg);
    if(!refused.empty())
        return refused;
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
    if(q.enabled)
    {
        fill_quantized(req, q, in, in_m, w, w_m, s.has_bias ? &b : nullptr, b_m);
        time_function(fc, req, tm);
        save_quantized_output(req, q, out, out_m);
    }
    else
    {
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
    }
    Obj o;
    o.boolean("ok", true).str("action", "run").str("op", "fc").str("method", "FC").str("effective_method", "FC").integer("threads", threads).raw("cpu_models", cpu_models_json()).raw("output", jints(std::vector<size_t>{ s.N, s.M }));
    add_quant_fields(o, q);
    add_timing(o, tm);
    if(!configure_ext.empty())
        o.raw("gemm", configure_ext);
    std::string sched = ext::scheduler_report();
    if(!sched.empty())
        o.raw("scheduler", sched);
    return o.done();
}

// ---------------------------------------------------------------------------------------------
// Transposed convolution (ONNX ConvTranspose) with NEDeconvolutionLayer; see ops.hpp.
// ---------------------------------------------------------------------------------------------
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
    const JVal &cfg     = obj_or_empty(req, "config");
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
} // namespace ks
