// Logical buffers <-> ACL tensors, data files, layouts (tensors.hpp).
#include "tensors.hpp"

#include "arm_compute/core/ITensorInfo.h"
#include "arm_compute/runtime/Tensor.h"

#include <fstream>
#include <random>
#include <stdexcept>

#include "request.hpp"

using namespace arm_compute;

namespace ks
{
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

template <typename T, bool TO_TENSOR>
void copy_logical_typed(Tensor &t, const Mapping &m, T *logical)
{
    std::vector<size_t> st   = logical_strides(t, m);
    std::vector<size_t> dims = m.logical_dims;
    while(dims.size() < 4)
    {
        dims.insert(dims.begin(), 1);
        st.insert(st.begin(), 0);
    }
    uint8_t *base = t.buffer() + t.info()->offset_first_element_in_bytes();
    size_t   i    = 0;
    for(size_t a = 0; a < dims[0]; ++a)
        for(size_t b = 0; b < dims[1]; ++b)
            for(size_t c = 0; c < dims[2]; ++c)
            {
                uint8_t *row = base + a * st[0] + b * st[1] + c * st[2];
                for(size_t d = 0; d < dims[3]; ++d, ++i)
                {
                    T *p = reinterpret_cast<T *>(row + d * st[3]);
                    if(TO_TENSOR)
                        *p = logical[i];
                    else
                        logical[i] = *p;
                }
            }
}

template <bool TO_TENSOR>
void copy_logical(Tensor &t, const Mapping &m, float *logical)
{
    copy_logical_typed<float, TO_TENSOR>(t, m, logical);
}

template void copy_logical<true>(Tensor &t, const Mapping &m, float *logical);
template void copy_logical<false>(Tensor &t, const Mapping &m, float *logical);
template void copy_logical_typed<uint8_t, true>(Tensor &t, const Mapping &m, uint8_t *logical);
template void copy_logical_typed<uint8_t, false>(Tensor &t, const Mapping &m, uint8_t *logical);
template void copy_logical_typed<int8_t, true>(Tensor &t, const Mapping &m, int8_t *logical);
template void copy_logical_typed<int8_t, false>(Tensor &t, const Mapping &m, int8_t *logical);
template void copy_logical_typed<int32_t, true>(Tensor &t, const Mapping &m, int32_t *logical);
template void copy_logical_typed<int32_t, false>(Tensor &t, const Mapping &m, int32_t *logical);

// The ``count`` values of type T a request's ``key`` file holds (its size checked).
template <typename T>
std::vector<T> read_exact(const std::string &path, const std::string &key, size_t count)
{
    std::vector<T> v(count);
    std::ifstream f(path, std::ios::binary);
    if(!f)
        throw BadRequest("cannot open " + key + " file '" + path + "'");
    f.seekg(0, std::ios::end);
    std::streamoff size = f.tellg();
    if(size != static_cast<std::streamoff>(count * sizeof(T)))
        throw BadRequest(key + " file '" + path + "' has " + std::to_string(size) + " bytes, expected " + std::to_string(count * sizeof(T)));
    f.seekg(0);
    f.read(reinterpret_cast<char *>(v.data()), static_cast<std::streamsize>(count * sizeof(T)));
    return v;
}

std::vector<float> load_or_random(const JVal &req, const std::string &key, size_t count, uint32_t seed)
{
    std::string path = opt_str(req, key, "");
    if(path.empty())
    {
        std::vector<float>                    v(count);
        std::mt19937                          gen(seed);
        std::uniform_real_distribution<float> dist(-1.f, 1.f);
        for(auto &x : v)
            x = dist(gen);
        return v;
    }
    return read_exact<float>(path, key, count);
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

template <typename T>
std::vector<T> load_or_random_typed(const JVal &req, const std::string &key, size_t count, uint32_t seed, int lo, int hi)
{
    std::string path = opt_str(req, key, "");
    if(path.empty())
    {
        std::vector<T>                     v(count);
        std::mt19937                       gen(seed);
        std::uniform_int_distribution<int> dist(lo, hi);
        for(auto &x : v)
            x = static_cast<T>(dist(gen));
        return v;
    }
    return read_exact<T>(path, key, count);
}

template <typename T>
void save_output_typed(const JVal &req, Tensor &t, const Mapping &m)
{
    std::string path = opt_str(req, "output_path", "");
    if(path.empty())
        return;
    std::vector<T> v(m.count());
    copy_logical_typed<T, false>(t, m, v.data());
    std::ofstream f(path, std::ios::binary | std::ios::trunc);
    if(!f)
        throw std::runtime_error("cannot write output file '" + path + "'");
    f.write(reinterpret_cast<const char *>(v.data()), static_cast<std::streamsize>(v.size() * sizeof(T)));
    if(!f)
        throw std::runtime_error("short write to output file '" + path + "'");
}

template std::vector<uint8_t> load_or_random_typed<uint8_t>(const JVal &, const std::string &, size_t, uint32_t, int, int);
template std::vector<int8_t> load_or_random_typed<int8_t>(const JVal &, const std::string &, size_t, uint32_t, int, int);
template std::vector<int32_t> load_or_random_typed<int32_t>(const JVal &, const std::string &, size_t, uint32_t, int, int);
template void save_output_typed<uint8_t>(const JVal &, Tensor &, const Mapping &);
template void save_output_typed<int8_t>(const JVal &, Tensor &, const Mapping &);

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
} // namespace ks
