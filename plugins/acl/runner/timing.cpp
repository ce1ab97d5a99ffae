// Timing helpers (timing.hpp).
#include "timing.hpp"

#include <algorithm>
#include <cmath>
#include <cstddef>

#include "json.hpp"

namespace ks
{
double us_since(Clock::time_point t0)
{
    return std::chrono::duration<double, std::micro>(Clock::now() - t0).count();
}

double median(std::vector<double> v)
{
    if(v.empty())
        return 0;
    std::sort(v.begin(), v.end());
    return v.size() % 2 ? v[v.size() / 2] : 0.5 * (v[v.size() / 2 - 1] + v[v.size() / 2]);
}

bool keep_timing(const std::vector<double> &times, double total, long long min_repeats, long long max_repeats, double min_time_us, double max_time_us, double stable)
{
    const long long n = static_cast<long long>(times.size());
    if(n >= max_repeats)
        return false;
    if(n < min_repeats || total < min_time_us)
        return true;
    if(stable <= 0)
        return false;
    if(max_time_us > 0 && total >= max_time_us)
        return false;
    if(n < 4)
        return true;
    const size_t        half = times.size() / 2;
    std::vector<double> a(times.begin(), times.begin() + half), b(times.begin() + half, times.end());
    const double        m = median(times);
    return std::fabs(median(a) - median(b)) > stable * m;
}

std::string times_json(const std::vector<double> &v)
{
    std::string out = "[";
    for(size_t i = 0; i < v.size(); ++i)
        out += (i ? "," : "") + jnum3(v[i]);
    return out + "]";
}

void add_timing(Obj &o, const Timing &tm)
{
    std::vector<double> sorted = tm.times_us;
    std::sort(sorted.begin(), sorted.end());
    double median = sorted.empty() ? 0 : (sorted.size() % 2 ? sorted[sorted.size() / 2] : 0.5 * (sorted[sorted.size() / 2 - 1] + sorted[sorted.size() / 2]));
    o.num("configure_us", tm.configure_us)
        .num("prepare_us", tm.prepare_us)
        .raw("warmup_us", times_json(tm.warmup_us))
        .raw("times_us", times_json(tm.times_us))
        .num("median_us", median)
        .num("min_us", sorted.empty() ? 0 : sorted.front());
}

} // namespace ks
