// Timing: the repeat / stop rule of a measurement, medians, and the timing fields of an answer.
#pragma once

#include <chrono>
#include <string>
#include <vector>

namespace ks
{
struct Obj;

struct Timing
{
    double              configure_us{ 0 };
    double              prepare_us{ 0 };
    std::vector<double> warmup_us;
    std::vector<double> times_us;
};

using Clock = std::chrono::steady_clock;
double us_since(Clock::time_point t0);

double median(std::vector<double> v);

// Repeats until min_repeats are done and their sum reaches min_time_ms; then, when stable_within is
// given (> 0), continues until the medians of the first and second half of the samples agree within
// that fraction, or max_time_ms / max_repeats is reached (the same rule as kselect's core).
bool keep_timing(const std::vector<double> &times, double total, long long min_repeats, long long max_repeats, double min_time_us, double max_time_us, double stable);

std::string times_json(const std::vector<double> &v);
// configure_us, prepare_us, warmup_us, times_us, median_us, min_us
void add_timing(Obj &o, const Timing &tm);
} // namespace ks
