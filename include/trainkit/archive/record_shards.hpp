#pragma once
/// A checkpoint's tensor records in pieces, for checkpoint sets that no rank gathers
/// (docs/design/checkpoints.md, "Sharded sets"). Writing: inside a ShardedWrites scope,
/// detail::write_tensor and the storages hand each rank's pieces of the records (a parameter's
/// elements [offset, offset + n) of its flattened tensor) to the scope instead of an archive;
/// checkpoint_set.hpp writes them to the rank's safetensors file. Reading: a ShardSource is a
/// set's index, opened; inside a ShardReads scope the record helpers of checkpoint_io.hpp read an
/// archive's tensor records from it, so every reader (the trainer, the storages, the policies)
/// reads a set as it reads a single file, and a storage reads only the ranges its rank holds.
#include <trainkit/detail/inline.hpp>
#include <trainkit/archive/safetensors.hpp>
#include <trainkit/archive/zip_check.hpp>

#include <c10/core/Event.h>
#include <c10/core/ScalarType.h>
#include <torch/serialize/archive.h>
#include <torch/types.h>

#include <array>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace trainkit::detail {

/// A checkpoint whose bytes fail a check (truncated, a CRC-32 wrong, an index that does not
/// describe its files).
class DamagedArchive : public std::runtime_error {
 public:
  DamagedArchive(const std::string& path, std::string damage)
      : std::runtime_error("checkpoint '" + path + "' is damaged: " + damage + "; nothing was loaded from it"),
        damage_(std::move(damage)) {}
  /// What is wrong, without the file's name.
  const std::string& damage() const { return damage_; }

 private:
  std::string damage_;
};

/// Elements [offset, offset + data.numel()) of the flattened tensor record `record`.
struct RecordChunk {
  std::string record;
  std::vector<std::int64_t> shape;  ///< the whole record's
  std::int64_t offset = 0;
  torch::Tensor data;  ///< 1-D, contiguous, on the host
};

/// RAII: while it lives, the tensor records of `archive` written on this thread go to it in
/// pieces, not to the archive (write_tensor: a whole record on the main rank, none on the
/// others, whose archives are dropped; the storages: each rank its own slices,
/// ShardedSlices::write_local). Records of other archives (a callback's nested one)
/// and of dtypes safetensors does not hold stay in their archive. Every rank of a run opens one
/// around the same save, which then makes no collective of its own.
class ShardedWrites {
 public:
  ShardedWrites(const torch::serialize::OutputArchive& archive, bool main);
  ~ShardedWrites();  // (the enclosing scope back: scopes nest)
  ShardedWrites(const ShardedWrites&) = delete;
  ShardedWrites& operator=(const ShardedWrites&) = delete;
  /// The scope open on this thread, or none.
  static ShardedWrites* active();
  /// The scope open on this thread for `archive`, or none.
  static ShardedWrites* of(const torch::serialize::OutputArchive& archive);
  /// Whether this rank writes the records every rank holds alike.
  bool main() const { return main_; }
  /// A piece, already copied to the host (checkpoint_io.hpp's write_chunk makes the copy).
  void add(RecordChunk chunk) { chunks_.push_back(std::move(chunk)); }
  std::vector<RecordChunk> take() { return std::move(chunks_); }

 private:
  const torch::serialize::OutputArchive* archive_;
  bool main_;
  std::vector<RecordChunk> chunks_;
  ShardedWrites* outer_;
};

/// A checkpoint set's index, opened: every tensor record's dtype, shape and chunks (file, first
/// element, byte range, CRC-32), and the files, each checked present at its recorded size. Reads
/// byte ranges with pread; each chunk read is checked against its CRC-32 (DamagedArchive names
/// the file).
class ShardSource {
 public:
  /// Whether `path` is a set's index (a JSON object), not a single archive.
  static bool is_index(const std::string& path);
  /// Reads the index alone (and the records file's size). Throws DamagedArchive naming `index`
  /// when it fails its own CRC-32, does not parse, or its records file is missing or of
  /// another size. A rank's file is checked (there, of its size, of this save) when its bytes
  /// are first read, with the same error.
  explicit ShardSource(std::string index);
  ~ShardSource();
  ShardSource(const ShardSource&) = delete;
  ShardSource& operator=(const ShardSource&) = delete;

  const std::string& index() const { return index_; }
  /// The set's other records: a torch archive the main rank wrote.
  const std::string& records_file() const { return records_file_; }
  /// Ranks of the run that wrote the set.
  std::int64_t world_size() const { return world_size_; }
  /// The save's token: the records file and every rank's file carry it.
  const std::string& token() const { return token_; }
  /// Every file of the set but the index (the records file first).
  std::vector<std::string> files() const;
  std::vector<std::string> records() const;
  bool has(const std::string& record) const { return records_.count(record) != 0; }
  /// The record's shape (it must exist).
  const std::vector<std::int64_t>& shape(const std::string& record) const { return find(record).shape; }
  /// The whole record, on the host.
  torch::Tensor read(const std::string& record) const;
  /// Elements [from, from + n) of the flattened record into `out` (1-D, n elements, any device).
  /// Into host memory: a chunk that `out` takes whole is read straight into it (no copy). Into
  /// a device's: each chunk is read into one of two page-locked slots in turn and copied from
  /// there asynchronously, on the device's current stream, while the next chunk is read; a slot
  /// is written again only once its last copy is done (an event: the host waits for that copy
  /// alone). Later work on that stream sees the values; the source waits for its copies before
  /// it goes.
  void read_range(const std::string& record, std::int64_t from, std::int64_t n, const torch::Tensor& out) const;
  /// The slots' bytes (twice the largest chunk read into a device; 0 before).
  std::int64_t staging_bytes() const;
  /// Tests: read_range into host memory through the slots too (pageable, copies synchronous),
  /// the device path's own code.
  void stage_host_reads(bool on) { stage_host_reads_ = on; }
  /// Checks every file and reads every chunk, checking its CRC-32: "" or what is wrong, naming
  /// the file.
  std::string verify() const;

 private:
  struct Chunk {
    std::size_t file = 0;
    std::int64_t offset = 0, elements = 0;
    std::uint64_t begin = 0, end = 0;  // bytes in the file
    std::uint32_t crc = 0;
  };
  struct Record {
    c10::ScalarType dtype = c10::ScalarType::Undefined;
    std::vector<std::int64_t> shape;
    std::vector<Chunk> chunks;  // by offset, covering the record once
  };
  const Record& find(const std::string& record) const;
  // File i's descriptor: opened and checked (its size, its save's token) at the first call.
  int file(std::size_t i) const;
  // The chunk's elements, read and checked.
  torch::Tensor read_chunk(const std::string& record, const Record& r, const Chunk& c) const;
  // The chunk's bytes read into `p` and checked.
  void read_chunk_into(const std::string& record, const Chunk& c, void* p) const;
  // The chunk's elements read and checked into the next slot (page-locked when `device`), once
  // that slot's last copy is done; its copy then goes through record_copy().
  torch::Tensor stage(const std::string& record, const Record& r, const Chunk& c, bool device) const;
  // The copy from the slot stage() gave last, just enqueued on `device`'s current stream.
  void record_copy(const torch::Device& device) const;
  struct Slot {
    torch::Tensor bytes;            // (uint8; grown to the largest chunk staged in it)
    std::optional<c10::Event> copied;  // its last copy into a device
  };

  std::string index_, directory_, records_file_, token_;
  std::int64_t world_size_ = 0;
  std::vector<std::string> files_;  // the shards, by rank
  std::vector<std::uint64_t> file_bytes_;  // their sizes, as the index says
  mutable std::vector<int> fds_;  // each file's, once read from (-1: not yet)
  mutable std::array<Slot, 2> slots_;  // read_range into a device: chunks staged in turn
  mutable std::size_t next_slot_ = 0;
  bool stage_host_reads_ = false;
  std::map<std::string, Record> records_;
};

/// RAII: while it lives, the record helpers read `archive`'s tensor records from `source`
/// (records the set holds; the archive's own otherwise).
class ShardReads {
 public:
  ShardReads(const torch::serialize::InputArchive& archive, const ShardSource& source);
  ~ShardReads();
  ShardReads(const ShardReads&) = delete;
  ShardReads& operator=(const ShardReads&) = delete;
  /// The source of `archive`'s records, or none.
  static const ShardSource* of(const torch::serialize::InputArchive& archive);

 private:
  const torch::serialize::InputArchive* archive_;
  const ShardSource* source_;
  std::pair<const torch::serialize::InputArchive*, const ShardSource*> outer_;
};

/// The CRC-32 of a set's index: over the compact dump of its JSON object without the "crc32"
/// member (a JSON object's members are sorted, so the dump is one text).
std::uint32_t index_crc(const std::string& compact_dump);

}  // namespace trainkit::detail

#ifndef TRAINKIT_COMPILED_LIB
#include <trainkit/archive/record_shards-inl.hpp>
#endif
