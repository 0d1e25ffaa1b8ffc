#pragma once
/// The definitions of trainkit/log/text_log.hpp (header-only: included by it; compiled mode:
/// by src/trainkit.cpp alone). See docs/design/compiled-mode.md.
#include <trainkit/log/text_log.hpp>

namespace trainkit {

TRAINKIT_INLINE TextLog::TextLog(std::string path)
    : path_(std::move(path)) {
  file_ = std::fopen(path_.c_str(), "a");
  if (file_ == nullptr)
    throw std::runtime_error("cannot open the run's text log '" + path_ + "': " + std::strerror(errno));
}

TRAINKIT_INLINE TextLog::~TextLog() {
  if (file_ != nullptr) std::fclose(file_);
}

TRAINKIT_INLINE void TextLog::line(const std::string& text) {
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

}  // namespace trainkit
