#pragma once
/// The definitions of trainkit/log/event_encoding.hpp (header-only: included by it; compiled mode:
/// by src/trainkit.cpp alone). See docs/design/compiled-mode.md.
#include <trainkit/log/event_encoding.hpp>

namespace trainkit::detail {

TRAINKIT_INLINE void put_varint(std::string& out, std::uint64_t value) {
  while (value >= 0x80) {
    out.push_back(static_cast<char>((value & 0x7F) | 0x80));
    value >>= 7;
  }
  out.push_back(static_cast<char>(value));
}

TRAINKIT_INLINE void put_key(std::string& out, std::uint32_t field, WireType type) {
  put_varint(out, (static_cast<std::uint64_t>(field) << 3) | static_cast<std::uint8_t>(type));
}

TRAINKIT_INLINE void put_little_endian(std::string& out, std::uint64_t value, int bytes) {
  for (int i = 0; i < bytes; ++i) out.push_back(static_cast<char>((value >> (8 * i)) & 0xFF));
}

TRAINKIT_INLINE void put_double(std::string& out, std::uint32_t field, double value) {
  std::uint64_t bits;
  std::memcpy(&bits, &value, sizeof bits);
  put_key(out, field, WireType::fixed64);
  put_little_endian(out, bits, 8);
}

TRAINKIT_INLINE void put_float(std::string& out, std::uint32_t field, float value) {
  std::uint32_t bits;
  std::memcpy(&bits, &value, sizeof bits);
  put_key(out, field, WireType::fixed32);
  put_little_endian(out, bits, 4);
}

TRAINKIT_INLINE void put_int64(std::string& out, std::uint32_t field, std::int64_t value) {
  put_key(out, field, WireType::varint);
  put_varint(out, static_cast<std::uint64_t>(value));
}

TRAINKIT_INLINE void put_bytes(std::string& out, std::uint32_t field, std::string_view bytes) {
  put_key(out, field, WireType::length_delimited);
  put_varint(out, bytes.size());
  out.append(bytes.data(), bytes.size());
}

TRAINKIT_INLINE std::string encode_file_version_event(double wall_time) {
  std::string event;
  put_double(event, 1, wall_time);
  put_bytes(event, 3, "brain.Event:2");
  return event;
}

TRAINKIT_INLINE std::string encode_scalar_event(double wall_time, std::int64_t step, std::string_view tag,
                                                float value) {
  std::string summary_value;
  put_bytes(summary_value, 1, tag);
  put_float(summary_value, 2, value);
  std::string summary;
  put_bytes(summary, 1, summary_value);
  std::string event;
  put_double(event, 1, wall_time);
  put_int64(event, 2, step);
  put_bytes(event, 5, summary);
  return event;
}

TRAINKIT_INLINE std::string encode_session_start_event(double wall_time, std::int64_t step) {
  std::string session_log;
  put_int64(session_log, 1, 1);  // SessionLog.status = START
  std::string event;
  put_double(event, 1, wall_time);
  put_int64(event, 2, step);
  put_bytes(event, 7, session_log);
  return event;
}

TRAINKIT_INLINE void append_tfrecord(std::string& out, std::string_view data) {
  std::string length;
  put_little_endian(length, data.size(), 8);
  out += length;
  put_little_endian(out, masked_crc32c(length), 4);
  out.append(data.data(), data.size());
  put_little_endian(out, masked_crc32c(data), 4);
}

}  // namespace trainkit::detail
