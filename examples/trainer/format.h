#ifndef DDP_EXAMPLES_TRAINER_FORMAT_H_
#define DDP_EXAMPLES_TRAINER_FORMAT_H_

// Number and time formatting for what people read.

#include <cstdint>
#include <string>

namespace ddp::examples::trainer {

/// 1234567 -> "1,234,567".
std::string FormatCount(int64_t n);
/// Seconds as "0:09", "12:34" or "1:02:03" (rounded down; negative, NaN and
/// infinity as "-"; from 1e15 on as "1e+15s").
std::string FormatClock(double seconds);
/// Seconds as "0.8s", "23.4s", "2m05s", "2h03m" ("-" and "1e+15s" as
/// FormatClock).
std::string FormatSeconds(double seconds);
/// A rate with thousands separators and no decimals: "2,613" ("-" for a
/// negative, NaN or infinite rate; from 1e15 on as "1e+15").
std::string FormatRate(double per_second);
/// printf into a std::string.
std::string StringPrintf(const char* format, ...) __attribute__((format(printf, 1, 2)));
/// A double that reads back exactly ("%a"), for checkpoint metadata.
std::string ExactDouble(double value);
/// Parses ExactDouble's output (or any strtod input), subnormals included;
/// throws std::invalid_argument for text that is not a number, one past a
/// double's range, or a non-zero one that would read as zero (below half
/// the smallest subnormal).
/// Text that starts with white space (which strtod would skip) is not a
/// number either.
double ParseExactDouble(const std::string& text);
/// ParseExactDouble, refusing an infinity or a NaN too (std::invalid_argument
/// quoting the text): for a saved flag that must be a finite number.
double ParseFiniteDouble(const std::string& text);

}  // namespace ddp::examples::trainer

#endif  // DDP_EXAMPLES_TRAINER_FORMAT_H_
