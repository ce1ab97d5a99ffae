// The single-op actions: "validate" (every method / layout candidate, statically) and "run"
// (configure, fill, time, save) for one conv, fc, deconv, layout permute, quantize or dequantize
// (PROTOCOL.md).
#pragma once

#include <string>

namespace ks
{
struct JVal;

std::string conv_validate(const JVal &req);
std::string conv_run(const JVal &req);
std::string fc_request(const JVal &req, bool run);     // validate (run = false) or run
std::string deconv_request(const JVal &req, bool run); // validate (run = false) or run
std::string permute_run(const JVal &req);
std::string quantize_run(const JVal &req, bool dequantize); // op "quantize" / "dequantize"
} // namespace ks
