#pragma once
/// safetensors (huggingface's format), written in one place: an 8-byte little-endian header
/// length, a JSON header {"__metadata__": {...}, key: {dtype, shape, data_offsets}} padded with
/// spaces so that the data start 8-byte aligned, then the tensors' bytes back to back. trainkit
/// writes it for weight files (io/weight_files.hpp) and for each rank's file of a checkpoint set
/// (archive/checkpoint_set.hpp), both through the one atomic file writer (write_atomically).
#include <c10/core/ScalarType.h>
#include <nlohmann/json.hpp>

#include <cstdint>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

namespace trainkit::detail {

// (checkpoint_io.hpp's, included below: it includes this header through record_shards.hpp.)
std::size_t write_atomically(const std::string& path,
                             const std::function<void(const std::function<size_t(const void*, size_t)>&)>& produce,
                             const std::string& what);

/// safetensors' names of the dtypes it holds.
struct SafetensorsType {
  const char* name;
  c10::ScalarType type;
};
inline constexpr SafetensorsType kSafetensorsTypes[] = {
    {"F64", c10::ScalarType::Double}, {"F32", c10::ScalarType::Float},  {"F16", c10::ScalarType::Half},
    {"BF16", c10::ScalarType::BFloat16}, {"I64", c10::ScalarType::Long}, {"I32", c10::ScalarType::Int},
    {"I16", c10::ScalarType::Short},  {"I8", c10::ScalarType::Char},    {"U8", c10::ScalarType::Byte},
    {"BOOL", c10::ScalarType::Bool}};
/// nullptr when safetensors has no name for `type`.
inline const char* safetensors_dtype(c10::ScalarType type) {
  for (const auto& t : kSafetensorsTypes)
    if (t.type == type) return t.name;
  return nullptr;
}
/// Undefined when `name` is none of safetensors' dtypes.
inline c10::ScalarType safetensors_scalar_type(const std::string& name) {
  for (const auto& t : kSafetensorsTypes)
    if (name == t.name) return t.type;
  return c10::ScalarType::Undefined;
}

/// One tensor of a safetensors file: its key, dtype name (safetensors_dtype), shape, and bytes
/// (contiguous, on the host).
struct SafetensorsEntry {
  std::string key;
  const char* dtype;
  std::vector<std::int64_t> shape;
  const void* data;
  std::uint64_t bytes;
};

/// The file's bytes before the tensors': the header's length and the header, whose
/// data_offsets place `entries` back to back in their order.
inline std::string safetensors_head(const nlohmann::ordered_json& metadata, const std::vector<SafetensorsEntry>& entries) {
  nlohmann::ordered_json header;
  header["__metadata__"] = metadata;
  std::uint64_t offset = 0;
  for (const auto& e : entries) {
    header[e.key] = {{"dtype", e.dtype}, {"shape", e.shape}, {"data_offsets", {offset, offset + e.bytes}}};
    offset += e.bytes;
  }
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');  // the data start 8-byte aligned
  std::string head(8, '\0');
  const std::uint64_t length = text.size();
  std::memcpy(head.data(), &length, 8);
  return head + text;
}

/// `entries` as a safetensors file at `path`, written atomically (write_atomically: a temporary
/// file, fsync, rename, the directory's fsync); `what` names the file in errors. Returns the
/// bytes written.
inline std::size_t write_safetensors_file(const std::string& path, const nlohmann::ordered_json& metadata,
                                          const std::vector<SafetensorsEntry>& entries, const std::string& what) {
  const std::string head = safetensors_head(metadata, entries);
  return write_atomically(
      path,
      [&](const std::function<size_t(const void*, size_t)>& sink) {
        sink(head.data(), head.size());
        for (const auto& e : entries) sink(e.data, e.bytes);
      },
      what);
}

}  // namespace trainkit::detail

#include <trainkit/archive/checkpoint_io.hpp>
