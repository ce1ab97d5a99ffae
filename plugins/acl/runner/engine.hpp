// Whole-model engine: actions model_load / model_run / model_free (PROTOCOL.md). A graph written by
// kselect becomes a list of configured ACL functions that stays alive between runs; each conv / fc
// keeps its own method, layout, GEMM kernel, CPU model, threads and scheduler.
#pragma once

#include <string>

namespace ks
{
struct JVal;

namespace model
{
std::string load(const JVal &req);
std::string run(const JVal &req);
std::string free_net(const JVal &req);
} // namespace model
} // namespace ks
