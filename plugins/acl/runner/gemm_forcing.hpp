// arm_gemm micro-kernel forcing and introspection (ACL 20.08 and 24.11; compiled out for other
// releases): the runner interposes the arm_gemm function through which ACL picks an fp32 GEMM's
// kernel (20.08: get_gemm_method<float,float,Nothing>; 24.11: gemm<float,float,float,Nothing>) so
// that a config's "gemm_kernel" makes ACL build that kernel, and records every fp32 GEMM an op
// configures. See FINDINGS.md.
#pragma once

#include <string>
#include <vector>

namespace ks
{
struct JVal;

namespace ext
{
// Start-up ABI check (after scheduler_startup()): forcing is available only when it passes.
void               check_gemm_abi();
bool               gemm_forcing_ok();
const std::string &gemm_forcing_reason(); // "ok", or why forcing is unavailable

// Around the configure() of an op: begin_configure takes the config's gemm_kernel (throws
// Unsupported when one is asked for and forcing is unavailable); end_configure returns the "gemm"
// JSON section ("" if the op set up no GEMM and none was asked for) and sets *error when the
// requested kernel could not be applied (gemm_kernel_strict, default true).
void        begin_configure(const JVal &cfg);
std::string end_configure(const JVal &cfg, std::string *error);

// {"action":"gemm_kernels","M":..,"N":..,"K":..,"batches":1,"multis":1,"threads":1}
std::string gemm_kernels(const JVal &req);

void reset_gemm_forcing(); // after every request

// The fp32 GEMM kernels arm_gemm lists for a GEMM with fast mode on and not without (24.11: its bf16
// kernels, where this build has them and the CPU has BF16); empty where forcing is unavailable.
std::vector<std::string> fast_mode_kernels();
} // namespace ext
} // namespace ks
