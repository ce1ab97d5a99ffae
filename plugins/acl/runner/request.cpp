// Request field accessors (request.hpp).
#include "request.hpp"

#include <cctype>
#include <cmath>

namespace ks
{
const JVal &need(const JVal &obj, const std::string &k)
{
    const JVal *v = obj.get(k);
    if(v == nullptr)
        throw BadRequest("missing field '" + k + "'");
    return *v;
}
long long as_int(const JVal &v, const std::string &what)
{
    if(v.type != JVal::NUM || std::floor(v.n) != v.n)
        throw BadRequest("field '" + what + "' must be an integer");
    return static_cast<long long>(v.n);
}
long long opt_int(const JVal &obj, const std::string &k, long long dflt)
{
    const JVal *v = obj.get(k);
    return (v == nullptr || v->type == JVal::NUL) ? dflt : as_int(*v, k);
}
double opt_num(const JVal &obj, const std::string &k, double dflt)
{
    const JVal *v = obj.get(k);
    if(v == nullptr || v->type == JVal::NUL)
        return dflt;
    if(v->type != JVal::NUM)
        throw BadRequest("field '" + k + "' must be a number");
    return v->n;
}
bool opt_bool(const JVal &obj, const std::string &k, bool dflt)
{
    const JVal *v = obj.get(k);
    if(v == nullptr || v->type == JVal::NUL)
        return dflt;
    if(v->type != JVal::BOOL)
        throw BadRequest("field '" + k + "' must be true/false");
    return v->b;
}
std::string opt_str(const JVal &obj, const std::string &k, const std::string &dflt)
{
    const JVal *v = obj.get(k);
    if(v == nullptr || v->type == JVal::NUL)
        return dflt;
    if(v->type != JVal::STR)
        throw BadRequest("field '" + k + "' must be a string");
    return v->s;
}
std::vector<long long> int_list(const JVal &obj, const std::string &k, size_t n, std::vector<long long> dflt)
{
    const JVal *v = obj.get(k);
    if(v == nullptr || v->type == JVal::NUL)
        return dflt;
    if(v->type != JVal::ARR || (n != 0 && v->a.size() != n))
        throw BadRequest("field '" + k + "' must be a list of " + std::to_string(n) + " integers");
    std::vector<long long> out;
    for(const auto &e : v->a)
        out.push_back(as_int(e, k));
    return out;
}
std::string upper(std::string s)
{
    for(auto &c : s)
        c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
    return s;
}

const JVal &obj_or_empty(const JVal &o, const std::string &k)
{
    static JVal empty = [] {
        JVal e;
        e.type = JVal::OBJ;
        return e;
    }();
    const JVal *v = o.get(k);
    if(v == nullptr || v->type == JVal::NUL)
        return empty;
    if(v->type != JVal::OBJ)
        throw BadRequest("'" + k + "' must be an object");
    return *v;
}
} // namespace ks
