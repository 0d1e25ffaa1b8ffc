#pragma once
/// The definitions of trainkit/detail/messages.hpp (header-only: included by it; compiled mode:
/// by src/trainkit.cpp alone). See docs/design/compiled-mode.md.
#include <trainkit/detail/messages.hpp>

namespace trainkit::detail {

TRAINKIT_INLINE std::string position_text(std::int64_t epoch, std::int64_t index, std::int64_t batches) {
  return "epoch " + std::to_string(epoch) + ", micro-batch " + std::to_string(index) + " of " + std::to_string(batches);
}

TRAINKIT_INLINE std::string short_number(double v) {
  if (std::isnan(v)) return "nan";
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.6g", v);
  return buf;
}

}  // namespace trainkit::detail
