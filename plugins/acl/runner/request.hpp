// Request handling basics: the two errors a request can fail with (besides ACL's own exceptions)
// and typed accessors for the fields of a request object.
#pragma once

#include <cstddef>
#include <stdexcept>
#include <string>
#include <vector>

#include "json.hpp"

namespace ks
{
// The request is malformed: answered with "error_kind": "bad_request".
struct BadRequest : std::runtime_error
{
    using std::runtime_error::runtime_error;
};

// The request is well formed but this runner / library cannot do it: "error_kind": "unsupported".
struct Unsupported : std::runtime_error
{
    using std::runtime_error::runtime_error;
};

// Field accessors: a missing or null field gives the default; a field of the wrong type throws
// BadRequest naming it.
const JVal &need(const JVal &obj, const std::string &k);
long long as_int(const JVal &v, const std::string &what);
long long opt_int(const JVal &obj, const std::string &k, long long dflt);
double opt_num(const JVal &obj, const std::string &k, double dflt);
bool opt_bool(const JVal &obj, const std::string &k, bool dflt);
std::string opt_str(const JVal &obj, const std::string &k, const std::string &dflt);
// An object field; an empty object when missing or null.
const JVal &obj_or_empty(const JVal &obj, const std::string &k);
// A list of integers; of exactly n entries unless n == 0.
std::vector<long long> int_list(const JVal &obj, const std::string &k, size_t n, std::vector<long long> dflt);
std::string upper(std::string s);
} // namespace ks
