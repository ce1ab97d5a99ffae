// Whole-model engine (engine.hpp).
#include "engine.hpp"

#include "arm_compute/core/CPP/CPPTypes.h"
#include "arm_compute/core/Error.h"
#include "arm_compute/core/TensorInfo.h"
#include "arm_compute/core/Types.h"
#include "arm_compute/runtime/IFunction.h"
#include "arm_compute/runtime/Scheduler.h"
#include "arm_compute/runtime/Tensor.h"
#include "arm_compute/runtime/CPP/CPPScheduler.h"
#include "arm_compute/runtime/NEON/functions/NEActivationLayer.h"
#include "arm_compute/runtime/NEON/functions/NEArithmeticAddition.h"
#include "arm_compute/runtime/NEON/functions/NEConcatenateLayer.h"
#include "arm_compute/runtime/NEON/functions/NECopy.h"
#include "arm_compute/runtime/NEON/functions/NEDeconvolutionLayer.h"
#include "arm_compute/runtime/NEON/functions/NEDequantizationLayer.h"
#include "arm_compute/runtime/NEON/functions/NEFlattenLayer.h"
#include "arm_compute/runtime/NEON/functions/NEFullyConnectedLayer.h"
#include "arm_compute/runtime/NEON/functions/NEPermute.h"
#include "arm_compute/runtime/NEON/functions/NEPoolingLayer.h"
#include "arm_compute/runtime/NEON/functions/NEQuantizationLayer.h"
#include "arm_compute/runtime/NEON/functions/NESoftmaxLayer.h"

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <fstream>
#include <map>
#include <memory>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <tuple>
#include <utility>
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
// ---------------------------------------------------------------------------------------------
// Whole-model engine (actions model_load / model_run / model_free; see PROTOCOL.md). A graph
// description written by kselect (nodes in topological order, shapes, weight files, one config per
// conv / fc) becomes a list of configured ACL functions that stays alive between runs. Each conv
// and fc runs with its own method, layout, GEMM kernel, CPU model, threads and scheduler; NEPermute
// steps are inserted where neighbouring ops use different layouts. Other ops run with ACL's
// functions in their input's layout, with the graph's default threads and ACL's scheduler.
// int8 conv / fc nodes ("quant") read and write quantized tensors: a tensor passing between a
// float op and an int8 op is converted by an NEQuantizationLayer / NEDequantizationLayer step
// (once per form), and int8 ops that agree on a tensor's quantization share it as it is.
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

struct MT // one tensor in one form: layout, data type and quantization
{
    std::string             name;
    std::vector<size_t>     dims; // logical
    DataLayout              layout{ DataLayout::NCHW };
    Mapping                 m;
    std::unique_ptr<Tensor> t;
    DataType                type{ DataType::F32 };
    QuantizationInfo        q;

    bool quantized() const { return type == DataType::QASYMM8 || type == DataType::QASYMM8_SIGNED; }
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
    std::map<std::string, MT *>                               by_key;   // name|layout[|type@scale/zero point]
    std::map<std::string, MT *>                               first;    // name -> first version made
    std::map<std::string, std::vector<MT *>>                  versions; // name -> every version made
    std::vector<Step>                                         steps;
    std::vector<Ctx>                                          ctxs;
    std::map<unsigned, std::shared_ptr<IScheduler>>           cpp;      // ACL CPPScheduler per thread count
    std::map<std::string, std::shared_ptr<ext::SplitScheduler>> splitters; // per thread count + pinning
    std::vector<std::string>                                  inputs, outputs;
    std::vector<Constant>                                     constants;
    size_t                                                    permutes{ 0 }, copies{ 0 }, quantizes{ 0 }, dequantizes{ 0 };
    double                                                    configure_us{ 0 }, prepare_us{ 0 };
    std::set<std::string>                                     isolate; // "node|in" / "node|out": give the step a private tensor
    std::string                                               base_dir{ "." }; // relative weight paths start here

    std::string resolve(const std::string &path) const
    {
        return path.empty() || path[0] == '/' ? path : base_dir + "/" + path;
    }

    // Float versions keep the key "name|layout"; quantized ones add "|type@scale/zero point".
    static std::string lkey(const std::string &name, size_t rank, DataLayout l, DataType type = DataType::F32, const QuantizationInfo &q = QuantizationInfo())
    {
        std::string key = name + "|" + (rank == 4 ? layout_name(l) : std::string("-"));
        if(type != DataType::F32)
            key += "|" + data_type_name(type) + "@" + jnum(q.uniform().scale) + "/" + std::to_string(q.uniform().offset);
        return key;
    }

    MT &add_tensor(const std::string &name, const std::vector<size_t> &dims, const Mapping &m, DataLayout layout, bool is_constant = false,
                   DataType type = DataType::F32, const QuantizationInfo &q = QuantizationInfo())
    {
        const std::string key = is_constant ? name : lkey(name, dims.size(), layout, type, q);
        if(by_key.count(key))
            throw BadRequest("tensor '" + name + "' is produced twice");
        auto mt    = std::make_unique<MT>();
        mt->name   = name;
        mt->dims   = dims;
        mt->layout = layout;
        mt->m      = m;
        mt->type   = type;
        mt->q      = q;
        mt->t      = std::make_unique<Tensor>();
        TensorInfo info(m.acl_shape(), 1, type, q);
        info.set_data_layout(layout);
        mt->t->allocator()->init(info);
        MT *p = mt.get();
        tensors.push_back(std::move(mt));
        by_key[key] = p;
        if(!is_constant)
        {
            if(!first.count(name))
                first[name] = p;
            versions[name].push_back(p);
        }
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
    MT &add_const(const std::string &name, const std::vector<size_t> &dims, const Mapping &m, DataLayout layout, const std::string &path, uint32_t seed,
                  const TensorInfo *typed = nullptr)
    {
        MT &mt = typed ? add_tensor(name, dims, m, layout, true, typed->data_type(), typed->quantization_info()) : add_tensor(name, dims, m, layout, true);
        constants.push_back(Constant{ &mt, path, seed });
        return mt;
    }
    // The first version of a tensor, whatever its form (its dims, or the graph's float input).
    MT &version(const std::string &name)
    {
        auto it = first.find(name);
        if(it == first.end())
            throw BadRequest("tensor '" + name + "' is used before it is produced");
        return *it->second;
    }
    // The tensor in float, in the layout of its first float version; an NEDequantizationLayer
    // step (run in ctx) makes one when only int8 ops wrote it.
    MT &any(const std::string &name, size_t ctx = 0)
    {
        MT &src = version(name);
        if(!src.quantized())
            return src;
        for(MT *v : versions[name])
            if(!v->quantized())
                return *v;
        MT    &dst = add_tensor(name, src.dims, src.m, src.layout);
        Status st  = NEDequantizationLayer::validate(src.t->info(), dst.t->info());
        if(!bool(st))
            throw Unsupported("NEDequantizationLayer of '" + name + "' rejected: " + st.error_description());
        auto f = std::make_unique<NEDequantizationLayer>();
        f->configure(src.t.get(), dst.t.get());
        add_conversion(std::move(f), "dequantize:" + name, "dequantize", ctx);
        ++dequantizes;
        return dst;
    }
    // The tensor in float in the wanted layout; a NEPermute step (run in ctx) makes it when needed.
    MT &get(const std::string &name, DataLayout want, size_t ctx)
    {
        MT &src = any(name, ctx);
        if(src.dims.size() != 4)
            return src;
        auto it = by_key.find(lkey(name, 4, want));
        if(it != by_key.end())
            return *it->second;
        return permuted(src, want, ctx);
    }
    // The tensor quantized as (type, q) in the wanted layout (int8 conv / fc inputs): the version
    // an int8 op wrote in that form, else that version permuted, else an NEQuantizationLayer
    // step from another quantized version (a requantization, e.g. QASYMM8 to QASYMM8_SIGNED;
    // permuted first when it is in the other layout), else from the float tensor.
    MT &get_quantized(const std::string &name, DataLayout want, DataType type, const QuantizationInfo &q, size_t ctx)
    {
        const size_t rank = version(name).dims.size();
        auto         it   = by_key.find(lkey(name, rank, want, type, q));
        if(it != by_key.end())
            return *it->second;
        if(rank == 4)
        {
            const DataLayout other = want == DataLayout::NCHW ? DataLayout::NHWC : DataLayout::NCHW;
            it                     = by_key.find(lkey(name, 4, other, type, q));
            if(it != by_key.end())
                return permuted(*it->second, want, ctx);
        }
        MT *src = nullptr;
        for(MT *v : versions[name])
            if(v->quantized() && (src == nullptr || (rank == 4 && v->layout == want)))
                src = v;
        if(src != nullptr && rank == 4 && src->layout != want)
            src = &permuted(*src, want, ctx);
        if(src == nullptr)
            src = &get(name, want, ctx);
        MT    &dst = add_tensor(name, src->dims, src->m, src->layout, false, type, q);
        Status st  = NEQuantizationLayer::validate(src->t->info(), dst.t->info());
        if(!bool(st))
            throw Unsupported("NEQuantizationLayer of '" + name + "' rejected: " + st.error_description());
        auto f = std::make_unique<NEQuantizationLayer>();
        f->configure(src->t.get(), dst.t.get());
        add_conversion(std::move(f), "quantize:" + name + ":" + data_type_name(type), "quantize", ctx);
        ++quantizes;
        return dst;
    }
    MT &permuted(MT &src, DataLayout want, size_t ctx)
    {
        MT               &dst = add_tensor(src.name, src.dims, map4(src.dims, want), want, false, src.type, src.q);
        PermutationVector pv  = permutation_to(want);
        Status            st  = NEPermute::validate(src.t->info(), dst.t->info(), pv);
        if(!bool(st))
            throw Unsupported("NEPermute of '" + src.name + "' rejected: " + st.error_description());
        auto f = std::make_unique<NEPermute>();
        f->configure(src.t.get(), dst.t.get(), pv);
        add_conversion(std::move(f), "permute:" + src.name + ":" + layout_name(want), "permute", ctx);
        ++permutes;
        return dst;
    }
    void add_conversion(std::unique_ptr<IFunction> fn, const std::string &node, const std::string &op, size_t ctx)
    {
        Step s;
        s.node = node;
        s.op   = op;
        s.fn   = std::move(fn);
        s.ctx  = ctx;
        steps.push_back(std::move(s));
    }

    // A private copy of src (NECopy step in ctx), for a step that must not share src's padding.
    MT &private_tensor(const MT &like, const std::string &tag)
    {
        return add_tensor(like.name + "#" + tag, like.dims, like.m, like.layout, true, like.type, like.q);
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
                set_cpu_model(ci, cpu, c.models[0]);
            else if(cpu < g_cpu.original.size())
                set_cpu_model(ci, cpu, g_cpu.original[cpu]);
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

// A weight or bias from its file (element type of the tensor: float, 8-bit weights, S32 bias),
// or seeded random values when the path is empty.
void load_constant(MT &c, const JVal &r, uint32_t seed)
{
    const size_t count = c.m.count();
    if(c.type == DataType::QASYMM8)
    {
        std::vector<uint8_t> v = load_or_random_typed<uint8_t>(r, "path", count, seed, 1, 255);
        copy_logical_typed<uint8_t, true>(*c.t, c.m, v.data());
    }
    else if(c.type == DataType::QASYMM8_SIGNED || c.type == DataType::QSYMM8_PER_CHANNEL)
    {
        std::vector<int8_t> v = load_or_random_typed<int8_t>(r, "path", count, seed, -127, 127);
        copy_logical_typed<int8_t, true>(*c.t, c.m, v.data());
    }
    else if(c.type == DataType::S32)
    {
        std::vector<int32_t> v = load_or_random_typed<int32_t>(r, "path", count, seed, -1000, 1000);
        copy_logical_typed<int32_t, true>(*c.t, c.m, v.data());
    }
    else
    {
        std::vector<float> v = load_or_random(r, "path", count, seed);
        copy_logical<true>(*c.t, c.m, v.data());
    }
}

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

// arm_gemm kernel forcing covers fp32 GEMMs only: an int8 node asking for a kernel is refused.
void refuse_int8_forcing(const std::string &name, const QuantSpec &q, const JVal &cfg)
{
    if(q.enabled && !opt_str(cfg, "gemm_kernel", "").empty())
        throw Unsupported(name + ": runner: gemm_kernel forcing covers fp32 GEMMs only, not quantized ones");
}

void add_conv(Net &n, const JVal &node, const std::string &name, const std::string &in, const std::string &out)
{
    ConvSpec    s      = parse_conv(node);
    const bool  quant  = s.quant.enabled;
    const JVal &cfg    = obj_or_empty(node, "config");
    std::string method = upper(opt_str(cfg, "method", "AUTO"));
    DataLayout  layout = parse_layout(opt_str(cfg, "layout", "NCHW"));
    const bool  fm     = opt_bool(cfg, "fast_math", false);
    if(std::find(all_methods().begin(), all_methods().end(), method) == all_methods().end())
        throw BadRequest(name + ": unknown method '" + method + "'");
    refuse_int8_forcing(name, s.quant, cfg);
    const size_t        ctx = n.ctx_of(cfg, 0);
    ActivationLayerInfo act = s.actinfo;
    bool                separate_act = false;
    Status              st           = safe_validate(s, method, layout, fm);
    // int8: only the output stage's clamp is an int8 conv's activation (the plugin sends no other)
    if(!bool(st) && act.enabled() && !quant)
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
    MT *xp = quant ? &n.get_quantized(in, layout, s.quant.data, s.quant.input_info(), ctx) : &n.get(in, layout, ctx);
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
    MT         &w  = n.add_const(name + "#weights", s.w_dims(), ti.w_m, layout, n.resolve(opt_str(node, "weights_path", "")), 2, &ti.w_i);
    MT         *b  = s.has_bias ? &n.add_const(name + "#bias", { s.O }, ti.b_m, layout, n.resolve(opt_str(node, "bias_path", "")), 3, &ti.b_i) : nullptr;
    MT         &yt = n.add_tensor(separate_act ? out + "#conv" : out, s.out_dims(), ti.out_m, layout, false, ti.out_i.data_type(), ti.out_i.quantization_info());
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
    if(quant)
        o.body += "," + quant_fields(s.quant);
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
    FcSpec           s     = parse_fc(node);
    const QuantSpec &q     = s.quant;
    const JVal      &cfg   = obj_or_empty(node, "config");
    refuse_int8_forcing(name, q, cfg);
    const size_t ctx = n.ctx_of(cfg, 0);
    MT          &x   = q.enabled ? n.get_quantized(in, DataLayout::NCHW, q.data, q.input_info(), ctx) : n.get(in, DataLayout::NCHW, ctx);
    if(x.dims != std::vector<size_t>{ s.N, s.K })
        throw BadRequest(name + ": input " + in + " is " + dims_str(x.dims) + ", the fc expects " + std::to_string(s.N) + "x" + std::to_string(s.K));
    FullyConnectedLayerInfo info;
    info.activation_info = s.act; // int8: clamped to what the output can represent (QuantSpec::clamp)
    const TensorInfo w_i(TensorShape(s.K, s.M), 1, q.enabled ? q.weights : DataType::F32, q.enabled ? q.weights_info() : QuantizationInfo());
    const TensorInfo b_i(TensorShape(s.M), 1, q.enabled ? DataType::S32 : DataType::F32);
    MT &w = n.add_const(name + "#weights", { s.M, s.K }, map2(s.M, s.K), DataLayout::NCHW, n.resolve(opt_str(node, "weights_path", "")), 2, &w_i);
    MT *b = s.has_bias ? &n.add_const(name + "#bias", { s.M }, map1(s.M), DataLayout::NCHW, n.resolve(opt_str(node, "bias_path", "")), 3, &b_i) : nullptr;
    MT &y = q.enabled ? n.add_tensor(out, { s.N, s.M }, map2(s.N, s.M), DataLayout::NCHW, false, q.data, q.output_info())
                      : n.add_activation(out, { s.N, s.M }, DataLayout::NCHW);
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
    if(q.enabled)
        o.body += "," + quant_fields(q);
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
            MT                 &got  = n.version(opt_str(node, "output", ""));
            if(got.dims != want)
                throw BadRequest(opt_str(node, "name", "?") + ": output is " + dims_str(got.dims) + ", the graph says " + dims_str(want));
        }
    }
    for(const auto &o : n.outputs)
        n.any(o); // in float: int8 ops' outputs dequantized
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
    JVal g = parse_json(text.str());
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
            load_constant(*c.mt, r, c.seed);
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
        .integer("quantizes", static_cast<long long>(n.quantizes))
        .integer("dequantizes", static_cast<long long>(n.dequantizes))
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
            steps += (i ? "," : "") + Obj().str("node", n.steps[i].node).str("op", n.steps[i].op).integer("schedule", static_cast<long long>(n.steps[i].ctx)).num("median_us", median(n.steps[i].us)).done();
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
} // namespace ks
