#pragma once
/// An append-only, buffered log file on POSIX calls, whose every failure is an exception naming
/// the file (std::ofstream reports neither which call failed nor errno). Shared by the scalar
/// writers (log/scalars.hpp, log/tensorboard.hpp). Not thread-safe; no LibTorch.
#include <trainkit/detail/inline.hpp>
#include <cerrno>
#include <chrono>
#include <cstddef>
#include <cstring>
#include <iostream>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

namespace trainkit::detail {

/// Seconds since the Unix epoch, as event files and the CSV/JSONL writers record them.
double unix_time_now();

[[noreturn]] inline void throw_file_error(const std::string& action, const std::string& what,
                                          const std::string& path, int error) {
  throw std::runtime_error("trainkit: cannot " + action + " " + what + " '" + path +
                           "': " + std::strerror(error));
}

/// mkdir -p: creates `dir` and its missing parents (0755); throws naming the directory, the
/// part of it that failed, and `what` it is for.
void make_directories(const std::string& dir, const std::string& what);

/// open(2) with `flags | O_WRONLY | O_CLOEXEC`, mode 0644, retried on EINTR: a descriptor or -1.
int open_for_writing(const std::string& path, int flags);

/// A file written only at its end through a buffer. The buffer goes to the file when
/// `flush_records` records have been ended since the last write, when `flush_seconds` have
/// passed since it (checked as records end), on flush() and close(), and in the destructor.
class LogFile {
 public:
  /// Takes ownership of `fd`, open for writing on `path`; `what` names the file in errors
  /// ("CSV log", "TensorBoard event file").
  LogFile(int fd, std::string path, std::string what, std::size_t flush_records,
          double flush_seconds)
      : fd_(fd), path_(std::move(path)), what_(std::move(what)),
        flush_records_(flush_records == 0 ? 1 : flush_records), flush_seconds_(flush_seconds),
        last_flush_(std::chrono::steady_clock::now()) {}
  LogFile(LogFile&& other) noexcept
      : fd_(std::exchange(other.fd_, -1)), path_(std::move(other.path_)),
        what_(std::move(other.what_)), flush_records_(other.flush_records_),
        flush_seconds_(other.flush_seconds_), last_flush_(other.last_flush_),
        buffer_(std::move(other.buffer_)), pending_records_(other.pending_records_),
        failed_(other.failed_) {}
  LogFile(const LogFile&) = delete;
  LogFile& operator=(const LogFile&) = delete;
  LogFile& operator=(LogFile&&) = delete;

  /// Flushes what is left; an error here cannot be thrown, so it is printed on stderr (once:
  /// not when flush() or close() has already thrown it).
  ~LogFile();

  const std::string& path() const noexcept { return path_; }

  /// Appends bytes of the current record to the buffer.
  void append(std::string_view bytes) { buffer_.append(bytes.data(), bytes.size()); }

  /// Marks the end of a record; writes the buffer if the flush policy says so.
  void end_record();

  /// Writes the whole buffer to the file. On an error (a full disk, an I/O error) it throws,
  /// and keeps what was not written: a later flush() continues from there.
  void flush();

  /// Flushes and closes the file, throwing what either reports (close(2) can report a
  /// delayed write error on network file systems). Idempotent.
  void close();

 private:
  int fd_;
  std::string path_;
  std::string what_;
  std::size_t flush_records_;
  double flush_seconds_;
  std::chrono::steady_clock::time_point last_flush_;
  std::string buffer_;
  std::size_t pending_records_ = 0;
  bool failed_ = false;
};

}  // namespace trainkit::detail

#ifndef TRAINKIT_COMPILED_LIB
#include <trainkit/log/log_file-inl.hpp>
#endif
