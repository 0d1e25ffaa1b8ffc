#pragma once
// Atomic archive files: write to a temporary file in the destination's directory, fsync it,
// rename it over the final name, fsync the directory. A crash at any instant leaves either
// the old file or the new one under the final name, never a partial one.
// Records are read and written through the helpers below, so that a missing record or one of
// the wrong shape is reported by its name, the same way everywhere.
#include <trainkit/detail/zip_check.hpp>

#include <torch/serialize/archive.h>

#include <cerrno>
#include <cstring>
#include <fcntl.h>
#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>
#include <sys/stat.h>
#include <unistd.h>

namespace trainkit::detail {

inline std::string directory_of(const std::string& path) {
  const auto slash = path.find_last_of('/');
  if (slash == std::string::npos) return ".";
  return slash == 0 ? "/" : path.substr(0, slash);
}

inline void fsync_path(const std::string& path, bool directory) {
  const int fd = ::open(path.c_str(), directory ? O_RDONLY | O_DIRECTORY : O_RDONLY);
  if (fd < 0) throw std::runtime_error("cannot open '" + path + "' to flush it: " + std::strerror(errno));
  const int rc = ::fsync(fd);
  const int err = errno;
  ::close(fd);
  if (rc != 0) throw std::runtime_error("cannot flush '" + path + "' to disk: " + std::strerror(err));
}

/// RAII: a temporary file that is removed unless released.
class TemporaryFile {
 public:
  explicit TemporaryFile(std::string path) : path_(std::move(path)) {}
  ~TemporaryFile() {
    if (!released_) ::unlink(path_.c_str());
  }
  TemporaryFile(const TemporaryFile&) = delete;
  TemporaryFile& operator=(const TemporaryFile&) = delete;
  const std::string& path() const { return path_; }
  void release() { released_ = true; }

 private:
  std::string path_;
  bool released_ = false;
};

inline void write_archive_atomically(torch::serialize::OutputArchive& archive,
                                     const std::string& path) {
  const auto dir = directory_of(path);
  struct stat st {};
  if (::stat(dir.c_str(), &st) != 0 || !S_ISDIR(st.st_mode))
    throw std::runtime_error("cannot write checkpoint '" + path + "': directory '" + dir +
                             "' does not exist");
  if (::access(dir.c_str(), W_OK) != 0)
    throw std::runtime_error("cannot write checkpoint '" + path + "': directory '" + dir +
                             "' is not writable (" + std::strerror(errno) + ")");
  TemporaryFile tmp(path + ".tmp." + std::to_string(::getpid()));
  const int fd = ::open(tmp.path().c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0)
    throw std::runtime_error("cannot write checkpoint '" + path + "': cannot create '" + tmp.path() +
                             "': " + std::strerror(errno));
  // The archive goes through a writer function, not save_to(path): LibTorch's file writer
  // throws from its destructor on a failed write (a full disk), which terminates the process.
  // This writer never reports a failure to LibTorch; it keeps the first error for below.
  int error = 0;
  archive.save_to([&](const void* data, size_t n) -> size_t {
    const char* p = static_cast<const char*>(data);
    for (size_t left = n; left > 0 && error == 0;) {
      const ssize_t k = ::write(fd, p, left);
      if (k < 0 && errno == EINTR) continue;
      if (k <= 0) {
        error = k < 0 ? errno : EIO;
        break;
      }
      p += k;
      left -= static_cast<size_t>(k);
    }
    return n;
  });
  if (error == 0 && ::fsync(fd) != 0) error = errno;
  if (::close(fd) != 0 && error == 0) error = errno;
  if (error != 0)
    throw std::runtime_error("cannot write checkpoint '" + path + "': " + std::strerror(error) +
                             " while writing '" + tmp.path() + "'" +
                             (error == ENOSPC || error == EDQUOT || error == EFBIG ? " (disk full?)" : "") +
                             "; the file under that name, if any, is unchanged");
  if (::rename(tmp.path().c_str(), path.c_str()) != 0)
    throw std::runtime_error("cannot rename '" + tmp.path() + "' to '" + path +
                             "': " + std::strerror(errno));
  tmp.release();
  fsync_path(dir, true);
}

/// A shape as LibTorch prints it ("[2, 3]"), for messages.
inline std::string shape_string(c10::IntArrayRef sizes) {
  std::ostringstream s;
  s << sizes;
  return s.str();
}

inline std::runtime_error missing_record(const std::string& key) {
  return std::runtime_error("checkpoint has no record '" + key + "'");
}

/// Writes a tensor record. As a buffer: the tensor read back never requires grad.
inline void write_tensor(torch::serialize::OutputArchive& archive, const std::string& key,
                         const torch::Tensor& tensor) {
  archive.write(key, tensor, /*is_buffer=*/true);
}

/// A tensor record of an archive, as a new tensor (InputArchive::read into a defined tensor
/// would set_() it in place).
inline torch::Tensor read_tensor(torch::serialize::InputArchive& archive, const std::string& key) {
  torch::Tensor t;
  if (!archive.try_read(key, t, /*is_buffer=*/true)) throw missing_record(key);
  return t;
}

/// Copies a tensor record into `target`, which keeps its storage, dtype and device (const as
/// in Tensor::copy_: the handle stays, the values change). Returns false, changing nothing,
/// when the record is absent (a record older checkpoints may lack); throws when its shape
/// differs (copy_ would broadcast a wrong shape silently).
inline bool read_into_if_present(torch::serialize::InputArchive& archive, const std::string& key,
                                 const torch::Tensor& target) {
  torch::Tensor saved;
  if (!archive.try_read(key, saved, /*is_buffer=*/true)) return false;
  if (saved.sizes() != target.sizes())
    throw std::runtime_error("checkpoint record '" + key + "' has shape " + shape_string(saved.sizes()) +
                             ", this run needs " + shape_string(target.sizes()));
  target.copy_(saved);
  return true;
}
/// As read_into_if_present(), for a record that must be there.
inline void read_into(torch::serialize::InputArchive& archive, const std::string& key,
                      const torch::Tensor& target) {
  if (!read_into_if_present(archive, key, target)) throw missing_record(key);
}

/// Writes a value record (an int, double, bool or string as c10::IValue).
inline void write_value(torch::serialize::OutputArchive& archive, const std::string& key,
                        const c10::IValue& value) {
  archive.write(key, value);
}

/// A value record of an archive. Throws when it is missing.
inline c10::IValue read_value(torch::serialize::InputArchive& archive, const std::string& key) {
  c10::IValue value;
  if (!archive.try_read(key, value)) throw missing_record(key);
  return value;
}

/// The first line of an exception's message (c10::Error's without its backtrace).
inline std::string first_line_of(const std::exception& e) {
  const auto* c10_error = dynamic_cast<const c10::Error*>(&e);
  const std::string text = c10_error != nullptr ? c10_error->what_without_backtrace() : e.what();
  return text.substr(0, text.find('\n'));
}

/// A checkpoint whose bytes fail the archive check (truncated, a record's CRC-32 wrong).
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

/// Opens a checkpoint for reading. Every path that reads one (Trainer::load, resume,
/// tk::load_weights, PARTIAL_PRETRAIN) comes here, so every one refuses a damaged file: the
/// archive's own reader finds a truncated file but not flipped bytes, the CRC-32 of each record
/// (zip_check.hpp) does.
inline void read_archive(torch::serialize::InputArchive& archive, const std::string& path) {
  if (::access(path.c_str(), R_OK) != 0)
    throw std::runtime_error("cannot read checkpoint '" + path + "': " + std::strerror(errno));
  if (const std::string damage = check_archive_file(path); !damage.empty()) throw DamagedArchive(path, damage);
  try {
    // Onto the CPU, whatever device wrote it: a GPU checkpoint opens on a CPU-only machine, and
    // no rank materialises the whole state on the GPU that saved it; readers copy to their
    // targets' devices.
    archive.load_from(path, torch::Device(torch::kCPU));
  } catch (const std::exception& e) {
    throw std::runtime_error("checkpoint '" + path +
                             "' is truncated or corrupt (not a complete archive): " + e.what());
  }
}

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
