#pragma once
/// The definitions of trainkit/archive/checkpoint_set.hpp (header-only: included by it; compiled
/// mode: by src/trainkit.cpp alone). See docs/design/compiled-mode.md.
#include <trainkit/archive/checkpoint_set.hpp>

#include <nlohmann/json.hpp>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <optional>
#include <thread>

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

namespace trainkit::detail {

TRAINKIT_INLINE std::string shard_path(const std::string& name, std::int64_t rank, std::int64_t world) {
  char tail[64];
  std::snprintf(tail, sizeof tail, ".%05lld-of-%05lld.safetensors", static_cast<long long>(rank),
                static_cast<long long>(world));
  return name + tail;
}

TRAINKIT_INLINE std::string records_path(const std::string& name) { return name + ".records"; }

TRAINKIT_INLINE std::string token_text(std::uint64_t token) {
  char text[24];
  std::snprintf(text, sizeof text, "%016llx", static_cast<unsigned long long>(token));
  return text;
}

namespace sets {

TRAINKIT_INLINE std::string base_name(const std::string& path) {
  const auto slash = path.find_last_of('/');
  return slash == std::string::npos ? path : path.substr(slash + 1);
}

// A shard's header, when the file is there and was written by the save `token`.
struct ShardHeader {
  nlohmann::json header;
  std::uint64_t data_begin = 0, size = 0;
};
TRAINKIT_INLINE std::optional<ShardHeader> read_header(const std::string& path, std::uint64_t token) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return std::nullopt;
  ShardHeader h;
  struct stat st {};
  ::fstat(fd, &st);
  h.size = static_cast<std::uint64_t>(st.st_size);
  std::uint64_t n = 0;
  std::string text;
  bool ok = ::pread(fd, &n, 8, 0) == 8 && n + 8 <= h.size;
  if (ok) {
    text.resize(n);
    ok = ::pread(fd, text.data(), n, 8) == static_cast<ssize_t>(n);
  }
  ::close(fd);
  if (!ok) return std::nullopt;  // (not a file of this save: they are renamed in whole)
  h.header = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  h.data_begin = 8 + n;
  if (!h.header.is_object() || !h.header.contains("__metadata__") ||
      h.header["__metadata__"].value("trainkit.token", std::string()) != token_text(token))
    return std::nullopt;  // an earlier attempt's, or another file under the name
  return h;
}
}  // namespace sets

TRAINKIT_INLINE std::size_t write_shard(const std::string& name, std::int64_t rank, std::int64_t world,
                                        std::uint64_t token, const std::vector<RecordChunk>& chunks) {
  const std::string path = shard_path(name, rank, world);
  std::vector<SafetensorsEntry> entries;
  auto places = nlohmann::json::array();
  for (const auto& c : chunks) {
    const char* dtype = safetensors_dtype(c.data.scalar_type());
    if (dtype == nullptr)
      throw std::runtime_error("cannot write checkpoint '" + name + "': record '" + c.record + "' is " +
                               std::string(c10::toString(c.data.scalar_type())) + ", which safetensors does not hold");
    std::int64_t numel = 1;
    for (const auto d : c.shape) numel *= d;
    const bool whole = c.offset == 0 && c.data.numel() == numel;
    const std::string key = whole ? c.record : c.record + "@" + std::to_string(c.offset);
    const auto n = static_cast<std::uint64_t>(c.data.nbytes());
    Crc32 crc;
    crc.update(static_cast<const unsigned char*>(c.data.data_ptr()), n);
    entries.push_back({key, dtype, whole ? c.shape : std::vector<std::int64_t>{c.data.numel()}, c.data.data_ptr(), n});
    places.push_back({{"key", key}, {"record", c.record}, {"offset", c.offset}, {"shape", c.shape}, {"crc32", crc.value()}});
  }
  const nlohmann::ordered_json metadata = {{"format", "pt"},
                                           {"trainkit.token", token_text(token)},
                                           {"trainkit.rank", std::to_string(rank)},
                                           {"trainkit.world_size", std::to_string(world)},
                                           {"trainkit.chunks", places.dump()}};
  return write_safetensors_file(path, metadata, entries, "checkpoint");
}

TRAINKIT_INLINE std::size_t write_index(const std::string& name, std::int64_t world, std::uint64_t token,
                                        const std::atomic<bool>& cancel, double timeout_s) {
  const auto fail = [&](const std::string& why) {
    return std::runtime_error("cannot write checkpoint '" + name + "': " + why + "; the previous checkpoints are intact");
  };
  auto tensors = nlohmann::json::object();
  auto files = nlohmann::json::array();
  std::uint64_t total = 0;
  const auto start = std::chrono::steady_clock::now();
  for (std::int64_t r = 0; r < world; ++r) {
    const std::string path = shard_path(name, r, world);
    std::optional<sets::ShardHeader> h;
    while (!(h = sets::read_header(path, token))) {
      if (cancel.load()) throw fail("stopped while waiting for rank " + std::to_string(r) + "'s file '" + path + "'");
      const double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      if (exit_after_writes().exit_signal.load() != 0 && waited > kSetGraceAfterSignal)
        throw fail("a second stop signal came, and rank " + std::to_string(r) + "'s file '" + path + "' is not there");
      if (std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() > timeout_s)
        throw fail("rank " + std::to_string(r) + "'s file '" + path + "' did not appear within " +
                   std::to_string(static_cast<long long>(timeout_s)) + " s (did that rank stop, or is the directory on a file system the ranks' machines do not share?)");
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    try {
      const auto places = nlohmann::json::parse(h->header.at("__metadata__").at("trainkit.chunks").get<std::string>());
      for (const auto& p : places) {
        const auto& entry = h->header.at(p.at("key").get<std::string>());
        const auto dtype = entry.at("dtype").get<std::string>();
        const auto bytes = entry.at("data_offsets").get<std::vector<std::uint64_t>>();
        auto& t = tensors[p.at("record").get<std::string>()];
        t["dtype"] = dtype;
        t["shape"] = p.at("shape");
        t["chunks"].push_back({{"file", r},
                               {"key", p.at("key")},
                               {"offset", p.at("offset")},
                               {"elements", (bytes.at(1) - bytes.at(0)) / c10::elementSize(safetensors_scalar_type(dtype))},
                               {"bytes", {h->data_begin + bytes.at(0), h->data_begin + bytes.at(1)}},
                               {"crc32", p.at("crc32")}});
      }
    } catch (const nlohmann::json::exception& e) {
      throw fail("rank " + std::to_string(r) + "'s file '" + path + "' has a malformed header (" + e.what() + ")");
    }
    files.push_back({{"file", sets::base_name(path)}, {"bytes", h->size}});
    total += h->size;
  }
  struct stat st {};
  const std::string records = records_path(name);
  if (::stat(records.c_str(), &st) != 0) throw fail("its records file '" + records + "' is missing");
  total += static_cast<std::uint64_t>(st.st_size);
  nlohmann::json index = {{"format", "trainkit.checkpoint-set"},
                          {"version", 1},
                          {"world_size", world},
                          {"token", token_text(token)},
                          {"records", {{"file", sets::base_name(records)}, {"bytes", st.st_size}}},
                          {"files", files},
                          {"tensors", tensors}};
  index["crc32"] = index_crc(index.dump());
  return total + write_bytes_atomically(index.dump(1) + "\n", name);
}

TRAINKIT_INLINE std::shared_ptr<ShardSource> open_checkpoint_file(torch::serialize::InputArchive& archive,
                                                                  const std::string& path) {
  if (!ShardSource::is_index(path)) {
    read_archive(archive, path);
    return nullptr;
  }
  auto source = std::make_shared<ShardSource>(path);
  read_archive(archive, source->records_file());
  c10::IValue token;
  if (!archive.try_read("set.token", token) || !token.isString() || token.toStringRef() != source->token())
    throw DamagedArchive(path, "its records file '" + source->records_file() + "' belongs to another save of that name");
  return source;
}

}  // namespace trainkit::detail
