#pragma once
/// The bytes of a TensorBoard event file, hand-encoded: protobuf wire format (only what
/// tensorflow/core/util/event.proto's scalar events need) and TFRecord framing.
///
///   Event   { double wall_time = 1; int64 step = 2; string file_version = 3; Summary summary = 5; }
///   Summary { repeated Value value = 1; }
///   Value   { string tag = 1; float simple_value = 2; }
///   record  = uint64 length (LE) | masked crc32c(length) (LE) | data | masked crc32c(data) (LE)
#include <trainkit/detail/crc32c.hpp>

#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>

namespace trainkit::detail {

/// Protobuf wire types (the low 3 bits of a field key).
enum class WireType : std::uint8_t { varint = 0, fixed64 = 1, length_delimited = 2, fixed32 = 5 };

inline void put_varint(std::string& out, std::uint64_t value) {
  while (value >= 0x80) {
    out.push_back(static_cast<char>((value & 0x7F) | 0x80));
    value >>= 7;
  }
  out.push_back(static_cast<char>(value));
}

inline void put_key(std::string& out, std::uint32_t field, WireType type) {
  put_varint(out, (static_cast<std::uint64_t>(field) << 3) | static_cast<std::uint8_t>(type));
}

/// `bytes` little-endian bytes of `value` (the wire format is little-endian on every host).
inline void put_little_endian(std::string& out, std::uint64_t value, int bytes) {
  for (int i = 0; i < bytes; ++i) out.push_back(static_cast<char>((value >> (8 * i)) & 0xFF));
}

inline void put_double(std::string& out, std::uint32_t field, double value) {
  std::uint64_t bits;
  std::memcpy(&bits, &value, sizeof bits);
  put_key(out, field, WireType::fixed64);
  put_little_endian(out, bits, 8);
}

inline void put_float(std::string& out, std::uint32_t field, float value) {
  std::uint32_t bits;
  std::memcpy(&bits, &value, sizeof bits);
  put_key(out, field, WireType::fixed32);
  put_little_endian(out, bits, 4);
}

/// int64 fields are plain varints of the two's complement: a negative step takes 10 bytes.
inline void put_int64(std::string& out, std::uint32_t field, std::int64_t value) {
  put_key(out, field, WireType::varint);
  put_varint(out, static_cast<std::uint64_t>(value));
}

inline void put_bytes(std::string& out, std::uint32_t field, std::string_view bytes) {
  put_key(out, field, WireType::length_delimited);
  put_varint(out, bytes.size());
  out.append(bytes.data(), bytes.size());
}

/// The file's first event: wall time and the format version the reader keys on ("brain.Event:2":
/// steps need not increase, nothing is purged as a restart).
inline std::string encode_file_version_event(double wall_time) {
  std::string event;
  put_double(event, 1, wall_time);
  put_bytes(event, 3, "brain.Event:2");
  return event;
}

/// One scalar as an Event holding a one-value Summary (what TensorBoard's add_scalar writes).
inline std::string encode_scalar_event(double wall_time, std::int64_t step, std::string_view tag,
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

/// A SessionLog{status: START} event at `step` (Event field 7): TensorBoard's readers drop every
/// point of the run at steps >= `step` read before it (a restarted run's orphans); the first
/// START of a run only marks its beginning for the server's reader.
inline std::string encode_session_start_event(double wall_time, std::int64_t step) {
  std::string session_log;
  put_int64(session_log, 1, 1);  // SessionLog.status = START
  std::string event;
  put_double(event, 1, wall_time);
  put_int64(event, 2, step);
  put_bytes(event, 7, session_log);
  return event;
}

/// Appends `data` to `out` as one TFRecord.
inline void append_tfrecord(std::string& out, std::string_view data) {
  std::string length;
  put_little_endian(length, data.size(), 8);
  out += length;
  put_little_endian(out, masked_crc32c(length), 4);
  out.append(data.data(), data.size());
  put_little_endian(out, masked_crc32c(data), 4);
}

}  // namespace trainkit::detail
