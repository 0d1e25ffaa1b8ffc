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
#include <trainkit/detail/inline.hpp>
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
  explicit TextLog(std::string path);
  TextLog(const TextLog&) = delete;
  TextLog& operator=(const TextLog&) = delete;
  ~TextLog();

  const std::string& path() const noexcept { return path_; }

  /// Appends one time-stamped line per line of `text`.
  void line(const std::string& text);

 private:
  std::string path_;
  std::FILE* file_ = nullptr;
};

}  // namespace trainkit

#ifndef TRAINKIT_COMPILED_LIB
#include <trainkit/log/text_log-inl.hpp>
#endif
