#pragma once
/// Pieces of the fit loop's messages, written the same way everywhere.
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <string>

namespace trainkit::detail {

/// "epoch 3, micro-batch 7 of 40".
std::string position_text(std::int64_t epoch, std::int64_t index, std::int64_t batches);

/// A value as %.6g ("nan", not "-nan").
std::string short_number(double v);

}  // namespace trainkit::detail

namespace trainkit::detail {

inline std::string position_text(std::int64_t epoch, std::int64_t index, std::int64_t batches) {
  return "epoch " + std::to_string(epoch) + ", micro-batch " + std::to_string(index) + " of " + std::to_string(batches);
}

inline std::string short_number(double v) {
  if (std::isnan(v)) return "nan";
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.6g", v);
  return buf;
}

}  // namespace trainkit::detail
