// JSON for the runner: a value type, a minimal parser (objects, arrays, strings, numbers,
// true/false/null; enough for the flat requests of PROTOCOL.md) and the helpers answers are
// written with.
#pragma once

#include <string>
#include <utility>
#include <vector>

namespace ks
{
struct JVal
{
    enum Type { NUL, BOOL, NUM, STR, ARR, OBJ } type{ NUL };
    bool   b{ false };
    double n{ 0 };
    std::string s;
    std::vector<JVal> a;
    std::vector<std::pair<std::string, JVal>> o;

    const JVal *get(const std::string &key) const
    {
        if(type != OBJ)
            return nullptr;
        for(const auto &kv : o)
            if(kv.first == key)
                return &kv.second;
        return nullptr;
    }
};

// Parses one JSON text; throws std::runtime_error("JSON parse error at offset ...") when malformed.
JVal parse_json(const std::string &text);

// ---------------------------------------------------------------------------------------------
// JSON writing helpers
// ---------------------------------------------------------------------------------------------
std::string jstr(const std::string &s);
std::string jnum(double v);  // %.17g; null when not finite
std::string jnum3(double v); // microsecond values: 3 decimals are plenty
std::string jbool(bool b);
template <typename T>
std::string jints(const std::vector<T> &v)
{
    std::string out = "[";
    for(size_t i = 0; i < v.size(); ++i)
        out += (i ? "," : "") + std::to_string(v[i]);
    return out + "]";
}

struct Obj // builds {"k":v,...} with raw (already-encoded) values
{
    std::string body;
    Obj &raw(const std::string &k, const std::string &v)
    {
        body += (body.empty() ? "" : ",") + jstr(k) + ":" + v;
        return *this;
    }
    Obj &str(const std::string &k, const std::string &v) { return raw(k, jstr(v)); }
    Obj &num(const std::string &k, double v) { return raw(k, jnum(v)); }
    Obj &integer(const std::string &k, long long v) { return raw(k, std::to_string(v)); }
    Obj &boolean(const std::string &k, bool v) { return raw(k, jbool(v)); }
    std::string done() const { return "{" + body + "}"; }
};
} // namespace ks
