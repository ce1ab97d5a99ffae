// JSON reader and writing helpers (json.hpp).
#include "json.hpp"

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <stdexcept>

namespace ks
{
// ---------------------------------------------------------------------------------------------
// Minimal JSON reader (objects, arrays, strings, numbers, true/false/null). Enough for the flat
// requests of PROTOCOL.md; rejects malformed input with a message.
// ---------------------------------------------------------------------------------------------
class JParser
{
public:
    explicit JParser(const std::string &text) : _t(text) {}
    JVal parse()
    {
        JVal v = value();
        ws();
        if(_i != _t.size())
            fail("trailing characters");
        return v;
    }

private:
    const std::string &_t;
    size_t             _i{ 0 };

    [[noreturn]] void fail(const std::string &what)
    {
        throw std::runtime_error("JSON parse error at offset " + std::to_string(_i) + ": " + what);
    }
    void ws()
    {
        while(_i < _t.size() && (_t[_i] == ' ' || _t[_i] == '\t' || _t[_i] == '\n' || _t[_i] == '\r'))
            ++_i;
    }
    bool lit(const char *w)
    {
        size_t l = std::strlen(w);
        if(_t.compare(_i, l, w) == 0)
        {
            _i += l;
            return true;
        }
        return false;
    }
    JVal value()
    {
        ws();
        if(_i >= _t.size())
            fail("unexpected end");
        JVal v;
        char c = _t[_i];
        if(c == '{')
        {
            v.type = JVal::OBJ;
            ++_i;
            ws();
            if(_i < _t.size() && _t[_i] == '}')
            {
                ++_i;
                return v;
            }
            for(;;)
            {
                ws();
                if(_i >= _t.size() || _t[_i] != '"')
                    fail("expected key");
                std::string k = str();
                ws();
                if(_i >= _t.size() || _t[_i] != ':')
                    fail("expected ':'");
                ++_i;
                JVal item = value();
                v.o.emplace_back(k, std::move(item));
                ws();
                if(_i < _t.size() && _t[_i] == ',')
                {
                    ++_i;
                    continue;
                }
                if(_i < _t.size() && _t[_i] == '}')
                {
                    ++_i;
                    return v;
                }
                fail("expected ',' or '}'");
            }
        }
        if(c == '[')
        {
            v.type = JVal::ARR;
            ++_i;
            ws();
            if(_i < _t.size() && _t[_i] == ']')
            {
                ++_i;
                return v;
            }
            for(;;)
            {
                v.a.push_back(value());
                ws();
                if(_i < _t.size() && _t[_i] == ',')
                {
                    ++_i;
                    continue;
                }
                if(_i < _t.size() && _t[_i] == ']')
                {
                    ++_i;
                    return v;
                }
                fail("expected ',' or ']'");
            }
        }
        if(c == '"')
        {
            v.type = JVal::STR;
            v.s    = str();
            return v;
        }
        if(lit("true"))
        {
            v.type = JVal::BOOL;
            v.b    = true;
            return v;
        }
        if(lit("false"))
        {
            v.type = JVal::BOOL;
            return v;
        }
        if(lit("null"))
            return v;
        if(c == '-' || (c >= '0' && c <= '9'))
        {
            size_t j = _i;
            while(j < _t.size() && std::strchr("+-0123456789.eE", _t[j]) != nullptr)
                ++j;
            std::string num = _t.substr(_i, j - _i);
            char       *end = nullptr;
            v.type          = JVal::NUM;
            v.n             = std::strtod(num.c_str(), &end);
            if(end == nullptr || *end != '\0')
                fail("bad number '" + num + "'");
            _i = j;
            return v;
        }
        fail(std::string("unexpected character '") + c + "'");
    }
    std::string str()
    {
        ++_i; // opening quote
        std::string out;
        while(_i < _t.size())
        {
            char c = _t[_i++];
            if(c == '"')
                return out;
            if(c != '\\')
            {
                out += c;
                continue;
            }
            if(_i >= _t.size())
                break;
            char e = _t[_i++];
            switch(e)
            {
                case '"': out += '"'; break;
                case '\\': out += '\\'; break;
                case '/': out += '/'; break;
                case 'b': out += '\b'; break;
                case 'f': out += '\f'; break;
                case 'n': out += '\n'; break;
                case 'r': out += '\r'; break;
                case 't': out += '\t'; break;
                case 'u':
                {
                    if(_i + 4 > _t.size())
                        fail("bad \\u escape");
                    unsigned cp = static_cast<unsigned>(std::strtoul(_t.substr(_i, 4).c_str(), nullptr, 16));
                    _i += 4;
                    // BMP only (paths and names are expected to be ASCII/UTF-8 already)
                    if(cp < 0x80)
                        out += static_cast<char>(cp);
                    else if(cp < 0x800)
                    {
                        out += static_cast<char>(0xC0 | (cp >> 6));
                        out += static_cast<char>(0x80 | (cp & 0x3F));
                    }
                    else
                    {
                        out += static_cast<char>(0xE0 | (cp >> 12));
                        out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
                        out += static_cast<char>(0x80 | (cp & 0x3F));
                    }
                    break;
                }
                default: fail("bad escape");
            }
        }
        fail("unterminated string");
    }
};

JVal parse_json(const std::string &text)
{
    return JParser(text).parse();
}

// ---------------------------------------------------------------------------------------------
// JSON writing helpers
// ---------------------------------------------------------------------------------------------
std::string jstr(const std::string &s)
{
    std::string out = "\"";
    for(unsigned char c : s)
    {
        switch(c)
        {
            case '"': out += "\\\""; break;
            case '\\': out += "\\\\"; break;
            case '\n': out += "\\n"; break;
            case '\r': out += "\\r"; break;
            case '\t': out += "\\t"; break;
            default:
                if(c < 0x20)
                {
                    char buf[8];
                    std::snprintf(buf, sizeof(buf), "\\u%04x", c);
                    out += buf;
                }
                else
                    out += static_cast<char>(c);
        }
    }
    return out + "\"";
}
std::string jnum(double v)
{
    if(!std::isfinite(v))
        return "null";
    char buf[32];
    std::snprintf(buf, sizeof(buf), "%.17g", v);
    return buf;
}
std::string jnum3(double v) // microsecond values: 3 decimals are plenty
{
    char buf[32];
    std::snprintf(buf, sizeof(buf), "%.3f", v);
    return buf;
}
std::string jbool(bool b)
{
    return b ? "true" : "false";
}
} // namespace ks
