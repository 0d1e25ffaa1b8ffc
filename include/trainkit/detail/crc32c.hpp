#pragma once
/// CRC-32C (Castagnoli, reflected polynomial 0x82F63B78), table-driven, and TFRecord's masked
/// form of it. Used by the TensorBoard event writer; no LibTorch, no other dependency.
#include <array>
#include <cstddef>
#include <cstdint>
#include <string_view>

namespace trainkit::detail {

/// The 256-entry lookup table, computed at compile time.
inline constexpr std::array<std::uint32_t, 256> crc32c_table = [] {
  std::array<std::uint32_t, 256> table{};
  for (std::uint32_t i = 0; i < 256; ++i) {
    std::uint32_t crc = i;
    for (int bit = 0; bit < 8; ++bit) crc = (crc >> 1) ^ ((crc & 1u) ? 0x82F63B78u : 0u);
    table[i] = crc;
  }
  return table;
}();

/// Continues a CRC-32C over `bytes`: crc32c(a + b) == crc32c_extend(crc32c(a), b).
std::uint32_t crc32c_extend(std::uint32_t crc, std::string_view bytes) noexcept;

/// CRC-32C of `bytes` (crc32c("123456789") == 0xE3069283).
inline std::uint32_t crc32c(std::string_view bytes) noexcept { return crc32c_extend(0, bytes); }

/// TFRecord's masking, so that a CRC stored next to the data it covers does not checksum to a
/// fixed pattern: rotate right by 15, add a constant.
std::uint32_t masked_crc32c(std::string_view bytes) noexcept;

}  // namespace trainkit::detail

namespace trainkit::detail {

inline std::uint32_t crc32c_extend(std::uint32_t crc, std::string_view bytes) noexcept {
  crc = ~crc;
  for (const char c : bytes) {
    crc = crc32c_table[(crc ^ static_cast<unsigned char>(c)) & 0xFFu] ^ (crc >> 8);
  }
  return ~crc;
}

inline std::uint32_t masked_crc32c(std::string_view bytes) noexcept {
  const std::uint32_t crc = crc32c(bytes);
  return ((crc >> 15) | (crc << 17)) + 0xa282ead8u;
}

}  // namespace trainkit::detail
