#pragma once
/// The definitions of trainkit/log/tensorboard.hpp (header-only: included by it; compiled mode:
/// by src/trainkit.cpp alone). See docs/design/compiled-mode.md.
#include <trainkit/log/tensorboard.hpp>

namespace trainkit {

TRAINKIT_INLINE TensorBoardWriter::TensorBoardWriter(const std::string& log_dir, TensorBoardOptions options)
    : file_(create(log_dir, options)) {
  std::string record;
  detail::append_tfrecord(record, detail::encode_file_version_event(detail::unix_time_now()));
  file_.append(record);
  file_.flush();
}

TRAINKIT_INLINE void TensorBoardWriter::session_start(std::int64_t step) {
  std::string record;
  detail::append_tfrecord(record, detail::encode_session_start_event(detail::unix_time_now(), step));
  file_.append(record);
  file_.flush();
}

TRAINKIT_INLINE void TensorBoardWriter::record(std::string_view tag, double value, std::int64_t step,
                                               double wall_time) {
  std::string record;
  detail::append_tfrecord(record, detail::encode_scalar_event(wall_time, step, tag,
                                                              static_cast<float>(value)));
  file_.append(record);
  file_.end_record();
}

TRAINKIT_INLINE detail::LogFile TensorBoardWriter::create(const std::string& log_dir,
                                                          const TensorBoardOptions& options) {
  const std::string what = "TensorBoard event file";
  detail::make_directories(log_dir, what + "s");
  char host[256] = {};
  if (::gethostname(host, sizeof host - 1) != 0 || host[0] == '\0') {
    std::snprintf(host, sizeof host, "localhost");
  }
  const std::string base = log_dir + "/events.out.tfevents." +
                           std::to_string(static_cast<std::int64_t>(detail::unix_time_now())) +
                           "." + host + options.filename_suffix;
  std::string path = base;
  for (int n = 1;; ++n) {
    const int fd = detail::open_for_writing(path, O_CREAT | O_EXCL | O_APPEND);
    if (fd >= 0) {
      return detail::LogFile(fd, path, what, options.flush.every_records,
                             options.flush.every_seconds);
    }
    if (errno != EEXIST || n > 1000) detail::throw_file_error("create", what, path, errno);
    path = base + "." + std::to_string(::getpid()) + "." + std::to_string(n);
  }
}

}  // namespace trainkit
