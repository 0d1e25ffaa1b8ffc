#pragma once
// Atomic archive files: write to a temporary file in the destination's directory, fsync it,
// rename it over the final name, fsync the directory. A crash at any instant leaves either
// the old file or the new one under the final name, never a partial one.
// Records are read and written through the helpers below, so that a missing record or one of
// the wrong shape is reported by its name, the same way everywhere.
#include <trainkit/detail/inline.hpp>
#include <trainkit/archive/record_shards.hpp>
#include <trainkit/archive/zip_check.hpp>

#include <c10/core/Device.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <torch/serialize/archive.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <fcntl.h>
#include <functional>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>
#include <sys/stat.h>
#include <unistd.h>

namespace trainkit::detail {

std::string directory_of(const std::string& path);

void fsync_path(const std::string& path, bool directory);

/// RAII: a temporary file that is removed unless released.
class TemporaryFile {
 public:
  explicit TemporaryFile(std::string path) : path_(std::move(path)) {}
  ~TemporaryFile();
  TemporaryFile(const TemporaryFile&) = delete;
  TemporaryFile& operator=(const TemporaryFile&) = delete;
  const std::string& path() const { return path_; }
  void release() { released_ = true; }

 private:
  std::string path_;
  bool released_ = false;
};

/// The file `path` written atomically from what `produce` hands its sink (the bytes in order);
/// returns its size.
std::size_t write_atomically(const std::string& path,
                             const std::function<void(const std::function<size_t(const void*, size_t)>&)>& produce,
                             const std::string& what = "checkpoint");
std::size_t write_archive_atomically(torch::serialize::OutputArchive& archive, const std::string& path);
/// An archive's file, already serialized (archive_bytes), written atomically.
std::size_t write_bytes_atomically(const std::string& bytes, const std::string& path);
/// The bytes of `archive`'s file, in memory: its tensors' values as they are now.
std::string archive_bytes(torch::serialize::OutputArchive& archive);

/// A shape as LibTorch prints it ("[2, 3]"), for messages.
std::string shape_string(c10::IntArrayRef sizes);

std::runtime_error missing_record(const std::string& key);

/// Writes a tensor record. As a buffer: the tensor read back never requires grad. Inside a
/// StagedWrites scope, a copy of it on the host. Inside a ShardedWrites scope, to the scope's
/// pieces on the main rank (whole), and nowhere on the others.
void write_tensor(torch::serialize::OutputArchive& archive, const std::string& key, const torch::Tensor& tensor);
/// Inside a ShardedWrites scope: a chunk of a set's record (the index's word), elements
/// [offset, offset + chunk.numel()) of the flattened record `record` of shape `shape`, from
/// `chunk`: inside a StagedWrites scope a copy (asynchronous from a device, waited for by its
/// wait()); outside one a CPU chunk itself (the set is written before the state changes), a
/// device chunk copied to the host.
void write_chunk(const std::string& record, c10::IntArrayRef shape, std::int64_t offset, const torch::Tensor& chunk);

/// Background checkpoint writes in flight, and a second stop signal's wish to exit: the signal
/// handler (fit/stop_signals.hpp) exits at once when no write is in flight, else leaves the exit
/// to the writer, which takes it when its file is complete (a checkpoint the loop already took
/// is not lost to the second signal). Lock-free atomics, safe in a signal handler; sequentially
/// consistent, so that of "handler: set `exit_signal`, read `writing`" and "writer: decrement
/// `writing`, read `exit_signal`" at least one sees the other.
struct ExitAfterWrites {
  std::atomic<int> writing{0};
  std::atomic<int> exit_signal{0};
};
inline ExitAfterWrites& exit_after_writes() {
  static ExitAfterWrites state;
  return state;
}

/// RAII: while it lives, write_tensor on this thread writes a host copy of each tensor, not the
/// tensor: an archive filled in the scope holds the state as it was, whatever changes it later
/// (a checkpoint serialized and written by another thread while training goes on; wait()
/// before the state changes). A record
/// that cannot be copied so (the nested archive of a torch::optim optimizer, which writes its
/// own tensors) calls cannot_stage(): the scope is then not complete(), and its archive must be
/// serialized before the state changes.
/// A host region that a background checkpoint's copies (StagedWrites) are cut from, reused by
/// every save: one allocation sized from the state (what the previous save copied), page-locked
/// when the copies come from a device. Without it each save's copies are new allocations, which
/// LibTorch's caching host allocator rounds up to a power of two each and keeps (up to twice the
/// state, for good). A save that finds the region too small, or still in use (a tensor cut from
/// it alive), copies the rest as before and says how much (outside()); the region grows to fit
/// once its copies are written (reserve_wanted(), off the training loop's pause).
class StagingRegion {
 public:
  /// A save begins: its copies are cut from the start again, where no earlier cut is alive.
  void begin();
  /// A host tensor of `like`'s dtype and shape cut from the region (undefined when it does not
  /// fit or is in use); counted in wanted() either way. `device`: the copy comes from a device.
  torch::Tensor take(const torch::Tensor& like, bool device);
  /// Grows the region to this save's bytes where it was too small (pinned where a copy came
  /// from a device); returns whether it allocated.
  bool reserve_wanted();
  std::size_t bytes() const { return region_.defined() ? static_cast<std::size_t>(region_.numel()) : 0; }
  /// This save's copies: their bytes, cut from the region or not, and those not cut from it
  /// (each copy is cut at a 64-byte boundary: the region is up to 63 bytes a copy larger).
  std::size_t wanted() const { return wanted_; }
  std::size_t outside() const { return outside_; }

 private:
  static constexpr std::size_t kAlign = 64;
  torch::Tensor region_;  // bytes (kByte)
  std::size_t used_ = 0, needed_ = 0, wanted_ = 0, outside_ = 0;  // (needed_: wanted_ with each copy aligned)
  bool usable_ = false, pinned_ = false, wanted_pinned_ = false;
};

/// What a StagedWrites scope holds for its thread.
struct StagingState {
  bool active = false, incomplete = false;
  std::vector<c10::Device> copying;  // devices whose streams carry copies not waited for
  StagingRegion* region = nullptr;   // where the copies are cut from (none: new allocations)
};

class StagedWrites {
 public:
  /// `region`: the copies are cut from it (StagingRegion::begin() is called here).
  explicit StagedWrites(StagingRegion* region = nullptr);
  ~StagedWrites();  // (the enclosing scope's state back: scopes nest)
  StagedWrites(const StagedWrites&) = delete;
  StagedWrites& operator=(const StagedWrites&) = delete;
  bool complete() const;
  /// Waits for the copies: a CUDA tensor's is asynchronous, into pinned host memory, on its
  /// device's current stream; this synchronizes each such stream once (the one host sync of
  /// the copies). Before the state may change.
  void wait() const;
  /// Whether a scope is active on this thread.
  static bool active();
  /// A record of the scope's archive holds references to the live state.
  static void cannot_stage();

 private:
  StagingState outer_;  // the enclosing scope's, put back at the end
};

/// A tensor record of an archive, as a new tensor (InputArchive::read into a defined tensor
/// would set_() it in place). The tensor records of an archive opened with a ShardReads scope
/// come from its set's files (so do those of the helpers below).
torch::Tensor read_tensor(torch::serialize::InputArchive& archive, const std::string& key);
/// read_tensor() into `out` when the record exists; false when it does not.
bool try_read_tensor(torch::serialize::InputArchive& archive, const std::string& key, torch::Tensor& out);
/// The shape of a tensor record, or std::nullopt when there is none (a set's without reading it).
std::optional<std::vector<std::int64_t>> tensor_shape(torch::serialize::InputArchive& archive, const std::string& key);

/// Copies a tensor record into `target`, which keeps its storage, dtype and device (const as
/// in Tensor::copy_: the handle stays, the values change). Returns false, changing nothing,
/// when the record is absent (a record older checkpoints may lack); throws when its shape
/// differs (copy_ would broadcast a wrong shape silently).
bool read_into_if_present(torch::serialize::InputArchive& archive, const std::string& key,
                          const torch::Tensor& target);
/// As read_into_if_present(), for a record that must be there.
void read_into(torch::serialize::InputArchive& archive, const std::string& key, const torch::Tensor& target);

/// Writes a value record (an int, double, bool or string as c10::IValue).
void write_value(torch::serialize::OutputArchive& archive, const std::string& key, const c10::IValue& value);

/// A value record of an archive. Throws when it is missing.
c10::IValue read_value(torch::serialize::InputArchive& archive, const std::string& key);

/// The first line of an exception's message (c10::Error's without its backtrace).
std::string first_line_of(const std::exception& e);

/// Opens a checkpoint for reading. Every path that reads one (Trainer::load, resume,
/// tk::load_weights, PARTIAL_PRETRAIN) comes here, so every one refuses a damaged file: the
/// archive's own reader finds a truncated file but not flipped bytes, the CRC-32 of each record
/// (zip_check.hpp) does.
void read_archive(torch::serialize::InputArchive& archive, const std::string& path);

/// Loads `archive` into `part` (part.load(archive, source), which checks what it can before
/// changing anything); when that throws, the state `part` had before is put back from a
/// snapshot in host memory (part.snapshot, then part.restore; no collective) and the error goes
/// on. The one rollback of trainer.load(path) and of the checkpoint manager.
template <class Part>
void load_or_restore(Part& part, torch::serialize::InputArchive& archive, const std::string& source) {
  std::stringstream previous;
  {
    torch::serialize::OutputArchive snapshot;
    part.snapshot(snapshot);
    snapshot.save_to(previous);
  }
  try {
    part.load(archive, source);
  } catch (...) {
    torch::serialize::InputArchive snapshot;
    snapshot.load_from(previous, torch::Device(torch::kCPU));
    part.restore(snapshot);
    throw;
  }
}

}  // namespace trainkit::detail

#ifndef TRAINKIT_COMPILED_LIB
#include <trainkit/archive/checkpoint_io-inl.hpp>
#endif
