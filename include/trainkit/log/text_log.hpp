#pragma once
/// The run's text log: `<OUTPUT_PATH>/<prefix>-log.txt`, one time-stamped line per event the fit
/// loop reports (start and resume, the progress at each log window, validation results,
/// checkpoints written, warnings, the stop or the end), appended to across runs in the same
/// directory, so that a job's history is in one file after its console is gone.
///
/// Contract:
///   TextLog(path)   opens for appending (creating it); throws std::runtime_error naming the
///                   file when it cannot
///   line(text)      "YYYY-MM-DD HH:MM:SS  text\n" (local time), written and flushed at once:
///                   a killed run's log ends at its last event
/// A write that fails (a full disk) is reported once on stderr and the log stops; training
/// goes on (the checkpoints have their own errors). This header does not include LibTorch.
#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <iostream>
#include <stdexcept>
#include <string>

namespace trainkit {

class TextLog {
 public:
  explicit TextLog(std::string path) : path_(std::move(path)) {
    file_ = std::fopen(path_.c_str(), "a");
    if (file_ == nullptr)
      throw std::runtime_error("cannot open the run's text log '" + path_ + "': " + std::strerror(errno));
  }
  TextLog(const TextLog&) = delete;
  TextLog& operator=(const TextLog&) = delete;
  ~TextLog() {
    if (file_ != nullptr) std::fclose(file_);
  }

  const std::string& path() const noexcept { return path_; }

  /// Appends one time-stamped line per line of `text`.
  void line(const std::string& text) {
    if (file_ == nullptr) return;
    char stamp[32];
    const std::time_t now = std::time(nullptr);
    std::tm local{};
    ::localtime_r(&now, &local);
    std::strftime(stamp, sizeof stamp, "%Y-%m-%d %H:%M:%S", &local);
    std::string out;
    std::size_t begin = 0;
    while (begin <= text.size()) {
      const std::size_t end = std::min(text.find('\n', begin), text.size());
      out += std::string(stamp) + "  " + text.substr(begin, end - begin) + "\n";
      begin = end + 1;
    }
    if (std::fwrite(out.data(), 1, out.size(), file_) != out.size() || std::fflush(file_) != 0) {
      std::cerr << "trainkit: warning: cannot write the run's text log '" << path_ << "': " << std::strerror(errno)
                << "; it stops here (training goes on)" << std::endl;
      std::fclose(file_);
      file_ = nullptr;
    }
  }

 private:
  std::string path_;
  std::FILE* file_ = nullptr;
};

}  // namespace trainkit
