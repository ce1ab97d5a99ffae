// Tensors: logical (NCHW-order) float32 buffers <-> ACL tensors in either layout, the raw data
// files requests name, and layout helpers. Quantized ops (a request's "quant") move their data as
// raw 8-bit / 32-bit integers instead (the *_typed functions).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "arm_compute/core/Types.h"

namespace arm_compute
{
class Tensor;
} // namespace arm_compute

namespace ks
{
struct JVal;

// A mapping says, for each ACL dimension d (0 = innermost), which logical index it holds
// (-1: a size-1 dimension that has no logical counterpart).
struct Mapping
{
    std::vector<size_t> logical_dims; // e.g. {N,C,H,W}
    std::vector<int>    acl_to_logical;

    arm_compute::TensorShape acl_shape() const
    {
        arm_compute::TensorShape s;
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
Mapping map4(const std::vector<size_t> &dims, arm_compute::DataLayout layout);
// Depthwise weights, logical (O,1,kh,kw): ACL NCHW shape (kw,kh,O), NHWC (O,kw,kh)
Mapping map_dw_weights(const std::vector<size_t> &dims, arm_compute::DataLayout layout);
Mapping map1(size_t n);
Mapping map2(size_t rows, size_t cols); // logical (rows, cols) row-major -> ACL (cols, rows)

// Copies between an allocated ACL tensor and a logical buffer: into the tensor when TO_TENSOR.
// (Instantiated for true and false in tensors.cpp.)
template <bool TO_TENSOR>
void copy_logical(arm_compute::Tensor &t, const Mapping &m, float *logical);
// The same for elements of type T (uint8_t, int8_t, int32_t: quantized data and S32 biases).
template <typename T, bool TO_TENSOR>
void copy_logical_typed(arm_compute::Tensor &t, const Mapping &m, T *logical);

// count floats from the raw little-endian file the request's field `key` names, or seeded
// uniform(-1, 1) values when the field is absent.
std::vector<float> load_or_random(const JVal &req, const std::string &key, size_t count, uint32_t seed);
void save(const std::string &path, const std::vector<float> &v);
// A run's output, in logical order, to the request's output_path when it names one.
void save_output(const JVal &req, arm_compute::Tensor &t, const Mapping &m);

// count elements of type T (uint8_t, int8_t, int32_t) from the raw little-endian file the field
// `key` names, or seeded uniform integers in [lo, hi] when the field is absent.
template <typename T>
std::vector<T> load_or_random_typed(const JVal &req, const std::string &key, size_t count, uint32_t seed, int lo, int hi);
// A quantized run's output (elements of type T, logical order) to the request's output_path.
template <typename T>
void save_output_typed(const JVal &req, arm_compute::Tensor &t, const Mapping &m);

std::string layout_name(arm_compute::DataLayout l);
arm_compute::DataLayout parse_layout(const std::string &s);
// What NEPermute takes to bring a rank-4 tensor from the other layout into `want`.
arm_compute::PermutationVector permutation_to(arm_compute::DataLayout want);
} // namespace ks
