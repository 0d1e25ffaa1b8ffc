#pragma once
/// The definitions of trainkit/archive/record_shards.hpp (header-only: included by it; compiled
/// mode: by src/trainkit.cpp alone). See docs/design/compiled-mode.md.
#include <trainkit/archive/record_shards.hpp>

#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <iterator>
#include <utility>

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

namespace trainkit::detail {

namespace shards {
TRAINKIT_INLINE ShardedWrites*& current_writes() {
  thread_local ShardedWrites* scope = nullptr;
  return scope;
}
TRAINKIT_INLINE std::pair<const torch::serialize::InputArchive*, const ShardSource*>& current_reads() {
  thread_local std::pair<const torch::serialize::InputArchive*, const ShardSource*> scope{nullptr, nullptr};
  return scope;
}
}  // namespace shards

TRAINKIT_INLINE ShardedWrites::ShardedWrites(const torch::serialize::OutputArchive& archive, bool main)
    : archive_(&archive), main_(main), outer_(shards::current_writes()) {
  shards::current_writes() = this;
}

TRAINKIT_INLINE ShardedWrites::~ShardedWrites() { shards::current_writes() = outer_; }

TRAINKIT_INLINE ShardedWrites* ShardedWrites::active() { return shards::current_writes(); }

TRAINKIT_INLINE ShardedWrites* ShardedWrites::of(const torch::serialize::OutputArchive& archive) {
  auto* scope = shards::current_writes();
  return scope != nullptr && scope->archive_ == &archive ? scope : nullptr;
}

TRAINKIT_INLINE ShardReads::ShardReads(const torch::serialize::InputArchive& archive, const ShardSource& source)
    : archive_(&archive), source_(&source), outer_(shards::current_reads()) {
  shards::current_reads() = {archive_, source_};
}

TRAINKIT_INLINE ShardReads::~ShardReads() { shards::current_reads() = outer_; }

TRAINKIT_INLINE const ShardSource* ShardReads::of(const torch::serialize::InputArchive& archive) {
  const auto& [a, s] = shards::current_reads();
  return a == &archive ? s : nullptr;
}

TRAINKIT_INLINE std::uint32_t index_crc(const std::string& compact_dump) {
  Crc32 crc;
  crc.update(reinterpret_cast<const unsigned char*>(compact_dump.data()), compact_dump.size());
  return crc.value();
}

TRAINKIT_INLINE bool ShardSource::is_index(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return false;
  char first = 0;
  const auto n = ::pread(fd, &first, 1, 0);
  ::close(fd);
  return n == 1 && first == '{';
}

TRAINKIT_INLINE ShardSource::ShardSource(std::string index) : index_(std::move(index)) {
  const auto slash = index_.find_last_of('/');
  directory_ = slash == std::string::npos ? "." : index_.substr(0, slash);
  const auto damaged = [&](const std::string& why) { return DamagedArchive(index_, why); };
  std::ifstream in(index_, std::ios::binary);
  if (!in) throw std::runtime_error("cannot read checkpoint '" + index_ + "': " + std::strerror(errno));
  const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  auto j = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object()) throw damaged("its index is not a JSON object (truncated, or bytes changed)");
  if (!j.contains("crc32") || !j["crc32"].is_number_unsigned()) throw damaged("its index has no crc32");
  const auto expected = j["crc32"].get<std::uint32_t>();
  j.erase("crc32");
  if (index_crc(j.dump()) != expected) throw damaged("its index fails its CRC-32 (bytes changed)");
  try {
    if (j.at("format").get<std::string>() != "trainkit.checkpoint-set")
      throw damaged("not the index of a trainkit checkpoint set (format '" + j.at("format").get<std::string>() + "')");
    if (const auto version = j.at("version").get<std::int64_t>(); version != 1)
      throw damaged("its index has version " + std::to_string(version) + ", which this trainkit does not read");
    world_size_ = j.at("world_size").get<std::int64_t>();
    token_ = j.at("token").get<std::string>();
    // The records file: every rank reads it whole now. The ranks' files: named and sized, each
    // opened and checked (size, token) when its bytes are first read (file()): a rank of W
    // reads a few of W files, and W ranks opening every file would be W^2 metadata operations
    // on a shared file system.
    const auto& records = j.at("records");
    records_file_ = directory_ + "/" + records.at("file").get<std::string>();
    struct stat st {};
    if (::stat(records_file_.c_str(), &st) != 0)
      throw damaged("its file '" + records_file_ + "' cannot be opened (" + std::strerror(errno) + ")");
    if (static_cast<std::uint64_t>(st.st_size) != records.at("bytes").get<std::uint64_t>())
      throw damaged("its file '" + records_file_ + "' holds " + std::to_string(st.st_size) + " bytes, the index says " +
                    std::to_string(records.at("bytes").get<std::uint64_t>()));
    for (const auto& f : j.at("files")) {
      files_.push_back(directory_ + "/" + f.at("file").get<std::string>());
      file_bytes_.push_back(f.at("bytes").get<std::uint64_t>());
      fds_.push_back(-1);
    }
    for (const auto& [name, t] : j.at("tensors").items()) {
      Record r;
      r.dtype = safetensors_scalar_type(t.at("dtype").get<std::string>());
      if (r.dtype == c10::ScalarType::Undefined) throw damaged("record '" + name + "' has an unknown dtype");
      r.shape = t.at("shape").get<std::vector<std::int64_t>>();
      std::int64_t numel = 1;
      for (const auto d : r.shape) numel *= d;
      const auto item = static_cast<std::uint64_t>(c10::elementSize(r.dtype));
      for (const auto& c : t.at("chunks")) {
        Chunk k;
        k.file = c.at("file").get<std::size_t>();
        k.offset = c.at("offset").get<std::int64_t>();
        k.elements = c.at("elements").get<std::int64_t>();
        const auto bytes = c.at("bytes").get<std::vector<std::uint64_t>>();
        k.crc = c.at("crc32").get<std::uint32_t>();
        if (k.file >= files_.size() || bytes.size() != 2 || bytes[1] < bytes[0] ||
            bytes[1] - bytes[0] != static_cast<std::uint64_t>(k.elements) * item)
          throw damaged("record '" + name + "' has a chunk outside its files");
        k.begin = bytes[0];
        k.end = bytes[1];
        r.chunks.push_back(k);
      }
      std::sort(r.chunks.begin(), r.chunks.end(), [](const Chunk& a, const Chunk& b) { return a.offset < b.offset; });
      std::int64_t covered = 0;
      for (const auto& k : r.chunks) {
        if (k.offset != covered) throw damaged("the chunks of record '" + name + "' do not cover it once");
        covered += k.elements;
      }
      if (covered != numel) throw damaged("the chunks of record '" + name + "' do not cover it once");
      records_.emplace(name, std::move(r));
    }
  } catch (const nlohmann::json::exception& e) {
    throw damaged(std::string("its index is malformed (") + e.what() + ")");
  }
}

TRAINKIT_INLINE ShardSource::~ShardSource() {
  for (const int fd : fds_)
    if (fd >= 0) ::close(fd);
  for (auto& slot : slots_)  // (the slots' last copies done before their memory goes)
    if (slot.copied) {
      try {
        slot.copied->synchronize();
      } catch (const std::exception&) {  // (a device error: the next use of the device says it)
      }
    }
}

TRAINKIT_INLINE std::vector<std::string> ShardSource::files() const {
  std::vector<std::string> all{records_file_};
  all.insert(all.end(), files_.begin(), files_.end());
  return all;
}

TRAINKIT_INLINE std::vector<std::string> ShardSource::records() const {
  std::vector<std::string> names;
  for (const auto& [name, r] : records_) names.push_back(name);
  return names;
}

TRAINKIT_INLINE const ShardSource::Record& ShardSource::find(const std::string& record) const {
  const auto it = records_.find(record);
  if (it == records_.end()) throw std::runtime_error("checkpoint '" + index_ + "' has no record '" + record + "'");
  return it->second;
}

TRAINKIT_INLINE torch::Tensor ShardSource::read_chunk(const std::string& record, const Record& r, const Chunk& c) const {
  auto t = torch::empty({c.elements}, torch::dtype(r.dtype));
  read_chunk_into(record, c, t.data_ptr());
  return t;
}

TRAINKIT_INLINE void ShardSource::read_chunk_into(const std::string& record, const Chunk& c, void* into) const {
  auto* p = static_cast<unsigned char*>(into);
  const std::uint64_t n = c.end - c.begin;
  const int fd = file(c.file);
  for (std::uint64_t done = 0; done < n;) {
    const auto k = ::pread(fd, p + done, n - done, static_cast<off_t>(c.begin + done));
    if (k < 0 && errno == EINTR) continue;
    if (k < 0)  // (an I/O error, not damage: no reason to skip the checkpoint)
      throw std::runtime_error("cannot read checkpoint '" + files_[c.file] + "': " + std::strerror(errno));
    if (k == 0) throw DamagedArchive(files_[c.file], "it ends inside record '" + record + "'");
    done += static_cast<std::uint64_t>(k);
  }
  Crc32 crc;
  crc.update(p, n);
  if (crc.value() != c.crc)
    throw DamagedArchive(files_[c.file], "record '" + record + "' elements [" + std::to_string(c.offset) + ", " +
                                             std::to_string(c.offset + c.elements) + ") fail their CRC-32");
}

TRAINKIT_INLINE torch::Tensor ShardSource::stage(const std::string& record, const Record& r, const Chunk& c,
                                                 bool device) const {
  auto& slot = slots_[next_slot_];
  if (slot.copied) slot.copied->synchronize();  // (its last copy, two chunks ago: done by now, as a rule)
  const auto bytes = static_cast<std::int64_t>(c.end - c.begin);
  if (!slot.bytes.defined() || slot.bytes.numel() < bytes)
    slot.bytes = torch::empty({bytes}, torch::dtype(torch::kUInt8).pinned_memory(device));
  read_chunk_into(record, c, slot.bytes.data_ptr());
  return slot.bytes.narrow(0, 0, bytes).view(r.dtype);
}

TRAINKIT_INLINE void ShardSource::record_copy(const torch::Device& device) const {
  auto& slot = slots_[next_slot_];
  next_slot_ = 1 - next_slot_;
  if (device.is_cpu()) return;  // (a host copy is done when copy_ returns)
  const auto stream = c10::impl::getDeviceGuardImpl(device.type())->getStream(device);
  // (an event records on one device: one of another device, its last copy done, is replaced)
  if (slot.copied && slot.copied->was_marked_for_recording() && slot.copied->device() != stream.device()) {
    slot.copied->synchronize();
    slot.copied.reset();
  }
  if (!slot.copied) slot.copied.emplace(device.type());
  slot.copied->record(stream);
}

TRAINKIT_INLINE std::int64_t ShardSource::staging_bytes() const {
  std::int64_t total = 0;
  for (const auto& slot : slots_)
    if (slot.bytes.defined()) total += slot.bytes.numel();
  return total;
}

TRAINKIT_INLINE int ShardSource::file(std::size_t i) const {
  int& fd = fds_[i];
  if (fd >= 0) return fd;
  const std::string& path = files_[i];
  const auto damaged = [&](const std::string& why) { return DamagedArchive(index_, why); };
  const int opened = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (opened < 0) throw damaged("its file '" + path + "' cannot be opened (" + std::strerror(errno) + ")");
  struct Closer {  // (until the file is checked)
    int fd;
    ~Closer() {
      if (fd >= 0) ::close(fd);
    }
  } closer{opened};
  struct stat st {};
  if (::fstat(opened, &st) != 0) throw std::runtime_error("cannot read checkpoint '" + path + "': " + std::strerror(errno));
  if (static_cast<std::uint64_t>(st.st_size) != file_bytes_[i])
    throw damaged("its file '" + path + "' holds " + std::to_string(st.st_size) + " bytes, the index says " +
                  std::to_string(file_bytes_[i]));
  // Its header names the save it belongs to: a name written again (a resume) replaces the
  // files one by one before the new index is in.
  std::uint64_t n = 0;
  std::string header;
  if (::pread(opened, &n, 8, 0) == 8 && n < (std::uint64_t{1} << 30)) {
    header.resize(n);
    if (::pread(opened, header.data(), n, 8) != static_cast<ssize_t>(n)) header.clear();
  }
  const auto h = nlohmann::json::parse(header, nullptr, /*allow_exceptions=*/false);
  if (!h.is_object() || !h.contains("__metadata__") || h["__metadata__"].value("trainkit.token", std::string()) != token_)
    throw damaged("its file '" + path + "' belongs to another save of that name (written again, and the new "
                  "index not yet in)");
  fd = std::exchange(closer.fd, -1);
  return fd;
}

TRAINKIT_INLINE torch::Tensor ShardSource::read(const std::string& record) const {
  const auto& r = find(record);
  auto whole = torch::empty(r.shape, torch::dtype(r.dtype));
  auto flat = whole.view({-1});
  for (const auto& c : r.chunks) flat.narrow(0, c.offset, c.elements).copy_(read_chunk(record, r, c));
  return whole;
}

TRAINKIT_INLINE void ShardSource::read_range(const std::string& record, std::int64_t from, std::int64_t n,
                                             const torch::Tensor& out) const {
  const auto& r = find(record);
  // Whole chunks are read (each one's CRC covers it whole); a chunk is at most one rank's slice
  // of one parameter in one bucket.
  const bool device = !out.is_cpu(), staged = device || stage_host_reads_;
  for (const auto& c : r.chunks) {
    const auto lo = std::max(from, c.offset), hi = std::min(from + n, c.offset + c.elements);
    if (lo >= hi) continue;
    auto into = out.narrow(0, lo - from, hi - lo);
    if (!staged) {
      if (lo == c.offset && hi == c.offset + c.elements && into.is_contiguous() && into.scalar_type() == r.dtype)
        read_chunk_into(record, c, into.data_ptr());  // (straight into place)
      else
        into.copy_(read_chunk(record, r, c).narrow(0, lo - c.offset, hi - lo));
      continue;
    }
    into.copy_(stage(record, r, c, device).narrow(0, lo - c.offset, hi - lo), /*non_blocking=*/device);
    record_copy(out.device());
  }
}

TRAINKIT_INLINE std::string ShardSource::verify() const {
  try {
    if (const std::string damage = check_archive_file(records_file_); !damage.empty())
      return "its records file '" + records_file_ + "' is damaged: " + damage;
    for (std::size_t i = 0; i < files_.size(); ++i) file(i);  // (a file no chunk is in, too)
    for (const auto& [name, r] : records_)
      for (const auto& c : r.chunks) read_chunk(name, r, c);
  } catch (const std::exception& e) {
    return e.what();
  }
  return "";
}

}  // namespace trainkit::detail
