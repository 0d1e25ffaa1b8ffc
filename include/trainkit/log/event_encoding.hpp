#pragma once
/// The bytes of a TensorBoard event file, hand-encoded: protobuf wire format (only what
/// tensorflow/core/util/event.proto's scalar events need) and TFRecord framing.
///
///   Event   { double wall_time = 1; int64 step = 2; string file_version = 3; Summary summary = 5; }
///   Summary { repeated Value value = 1; }
///   Value   { string tag = 1; float simple_value = 2; }
///   record  = uint64 length (LE) | masked crc32c(length) (LE) | data | masked crc32c(data) (LE)
#include <trainkit/detail/inline.hpp>
#include <trainkit/detail/crc32c.hpp>

#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>

namespace trainkit::detail {

/// Protobuf wire types (the low 3 bits of a field key).
enum class WireType : std::uint8_t { varint = 0, fixed64 = 1, length_delimited = 2, fixed32 = 5 };

void put_varint(std::string& out, std::uint64_t value);

void put_key(std::string& out, std::uint32_t field, WireType type);

/// `bytes` little-endian bytes of `value` (the wire format is little-endian on every host).
void put_little_endian(std::string& out, std::uint64_t value, int bytes);

void put_double(std::string& out, std::uint32_t field, double value);

void put_float(std::string& out, std::uint32_t field, float value);

/// int64 fields are plain varints of the two's complement: a negative step takes 10 bytes.
void put_int64(std::string& out, std::uint32_t field, std::int64_t value);

void put_bytes(std::string& out, std::uint32_t field, std::string_view bytes);

/// The file's first event: wall time and the format version the reader keys on ("brain.Event:2":
/// steps need not increase, nothing is purged as a restart).
std::string encode_file_version_event(double wall_time);

/// One scalar as an Event holding a one-value Summary (what TensorBoard's add_scalar writes).
std::string encode_scalar_event(double wall_time, std::int64_t step, std::string_view tag, float value);

/// A SessionLog{status: START} event at `step` (Event field 7): TensorBoard's readers drop every
/// point of the run at steps >= `step` read before it (a restarted run's orphans); the first
/// START of a run only marks its beginning for the server's reader.
std::string encode_session_start_event(double wall_time, std::int64_t step);

/// Appends `data` to `out` as one TFRecord.
void append_tfrecord(std::string& out, std::string_view data);

}  // namespace trainkit::detail

#ifndef TRAINKIT_COMPILED_LIB
#include <trainkit/log/event_encoding-inl.hpp>
#endif
