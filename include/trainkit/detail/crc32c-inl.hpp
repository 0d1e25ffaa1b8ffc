#pragma once
/// The definitions of trainkit/detail/crc32c.hpp (header-only: included by it; compiled mode:
/// by src/trainkit.cpp alone). See docs/design/compiled-mode.md.
#include <trainkit/detail/crc32c.hpp>

namespace trainkit::detail {

TRAINKIT_INLINE std::uint32_t crc32c_extend(std::uint32_t crc, std::string_view bytes) noexcept {
  crc = ~crc;
  for (const char c : bytes) {
    crc = crc32c_table[(crc ^ static_cast<unsigned char>(c)) & 0xFFu] ^ (crc >> 8);
  }
  return ~crc;
}

TRAINKIT_INLINE std::uint32_t masked_crc32c(std::string_view bytes) noexcept {
  const std::uint32_t crc = crc32c(bytes);
  return ((crc >> 15) | (crc << 17)) + 0xa282ead8u;
}

}  // namespace trainkit::detail
