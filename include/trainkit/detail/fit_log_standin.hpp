#pragma once
// TEMPORARY stand-in for the log writers of include/trainkit/log/ (TensorBoard events, CSV/JSONL
// scalars, the progress line), which land separately; fit.hpp switches to them then and this
// file goes. Writes the scalars as JSON lines, <dir>/<prefix>-scalars.jsonl
// ({"step": S, "tag": "T", "value": V}, values with 17 significant digits), and plain progress
// lines on stderr.
#include <cerrno>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <stdexcept>
#include <string>

namespace trainkit::detail {

class FitLogStandIn {
 public:
  FitLogStandIn() = default;
  FitLogStandIn(const std::string& directory, const std::string& prefix) {
    path_ = directory + "/" + prefix + "-scalars.jsonl";
    file_ = std::fopen(path_.c_str(), "a");
    if (file_ == nullptr)
      throw std::runtime_error("cannot open the scalar log '" + path_ + "': " + std::strerror(errno));
  }
  ~FitLogStandIn() {
    if (file_ != nullptr) std::fclose(file_);
  }
  FitLogStandIn(const FitLogStandIn&) = delete;
  FitLogStandIn& operator=(const FitLogStandIn&) = delete;

  void scalar(const std::string& tag, std::int64_t step, double value) {
    if (file_ == nullptr) return;
    if (std::isfinite(value))
      std::fprintf(file_, "{\"step\": %lld, \"tag\": \"%s\", \"value\": %.17g}\n",
                   static_cast<long long>(step), tag.c_str(), value);
    else
      std::fprintf(file_, "{\"step\": %lld, \"tag\": \"%s\", \"value\": \"%s\"}\n",
                   static_cast<long long>(step), tag.c_str(), std::isnan(value) ? "NaN" : value > 0 ? "Infinity" : "-Infinity");
  }
  void flush() {
    if (file_ != nullptr) std::fflush(file_);
  }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
  std::FILE* file_ = nullptr;
};

}  // namespace trainkit::detail
