#pragma once
/// The definitions of trainkit/log/log_file.hpp (header-only: included by it; compiled mode:
/// by src/trainkit.cpp alone). See docs/design/compiled-mode.md.
#include <trainkit/log/log_file.hpp>

namespace trainkit::detail {

TRAINKIT_INLINE double unix_time_now() {
  using namespace std::chrono;
  return duration<double>(system_clock::now().time_since_epoch()).count();
}

TRAINKIT_INLINE void make_directories(const std::string& dir, const std::string& what) {
  const auto fail = [&](const std::string& part, int error) {
    throw std::runtime_error("trainkit: cannot create the directory '" + dir + "' for the " +
                             what + (part == dir ? "" : " (at '" + part + "')") + ": " +
                             std::strerror(error));
  };
  for (std::size_t end = dir.find('/', 1);; end = dir.find('/', end + 1)) {
    const std::string part = dir.substr(0, end);
    if (!part.empty() && ::mkdir(part.c_str(), 0755) != 0 && errno != EEXIST) fail(part, errno);
    if (end == std::string::npos) break;
  }
  struct stat st {};
  if (::stat(dir.c_str(), &st) != 0) fail(dir, errno);
  if (!S_ISDIR(st.st_mode)) fail(dir, ENOTDIR);
}

TRAINKIT_INLINE int open_for_writing(const std::string& path, int flags) {
  int fd;
  do {
    fd = ::open(path.c_str(), flags | O_WRONLY | O_CLOEXEC, 0644);
  } while (fd < 0 && errno == EINTR);
  return fd;
}

TRAINKIT_INLINE LogFile::~LogFile() {
  if (fd_ < 0) return;
  if (!failed_) {
    try {
      flush();
    } catch (const std::exception& e) {
      std::cerr << e.what() << " (while closing it; " << buffer_.size()
                << " bytes were not written)\n";
    }
  }
  ::close(fd_);
}

TRAINKIT_INLINE void LogFile::end_record() {
  ++pending_records_;
  if (pending_records_ >= flush_records_ ||
      std::chrono::duration<double>(std::chrono::steady_clock::now() - last_flush_).count() >=
          flush_seconds_) {
    flush();
  }
}

TRAINKIT_INLINE void LogFile::flush() {
  std::size_t done = 0;
  while (done < buffer_.size()) {
    const ssize_t n = ::write(fd_, buffer_.data() + done, buffer_.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      const int error = errno;
      buffer_.erase(0, done);
      failed_ = true;
      throw_file_error("write", what_, path_, error);
    }
    done += static_cast<std::size_t>(n);
  }
  buffer_.clear();
  pending_records_ = 0;
  failed_ = false;
  last_flush_ = std::chrono::steady_clock::now();
}

TRAINKIT_INLINE void LogFile::close() {
  if (fd_ < 0) return;
  flush();
  const int fd = std::exchange(fd_, -1);
  if (::close(fd) != 0 && errno != EINTR) throw_file_error("close", what_, path_, errno);
}

}  // namespace trainkit::detail
