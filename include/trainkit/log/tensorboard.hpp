#pragma once
/// TensorBoard event files, written from scratch: a ScalarSink (log/scalars.hpp) whose
/// scalars TensorBoard's own reader reads back (tests: tensorboard.read_back).
///
/// Contract:
///   TensorBoardWriter(log_dir, options)  creates log_dir (mkdir -p) and a new file in it,
///       events.out.tfevents.<unix seconds>.<hostname><suffix>, with ".<pid>.<n>" appended when
///       that name exists (two writers in one second); writes and flushes the file-version
///       record, so an unwritable directory or a full disk is an exception here, naming the path.
///   session_start(step)   a SessionLog START event: points of earlier files at steps >= step
///       are not shown (a resumed run's restart point; the fit loop writes one at every start)
///   add_scalar(tag, value, step[, wall_time])  one Event{wall_time, step, Summary{Value{tag,
///       simple_value}}} record; the value is stored as float32 (TensorBoard's simple_value).
///   flush() / close() / destructor          as every ScalarSink: buffered per FlushPolicy.
/// The format (detail/event_encoding.hpp) is TFRecord framing around Event protobufs. It is
/// hand-encoded because it is small (five field kinds) and no Debian package offers a C++ writer
/// without protobuf or TensorFlow. This header does not include LibTorch.
#include <trainkit/detail/event_encoding.hpp>
#include <trainkit/detail/log_file.hpp>
#include <trainkit/log/scalars.hpp>

#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <string>
#include <string_view>

#include <fcntl.h>
#include <unistd.h>

namespace trainkit {

/// Options of a TensorBoardWriter.
struct TensorBoardOptions {
  FlushPolicy flush;
  /// Appended to the file name (e.g. ".rank3"): TensorBoard reads every *tfevents* file.
  std::string filename_suffix;
};

/// Scalars as a TensorBoard event file in a log directory (one run of TensorBoard's view).
class TensorBoardWriter : public ScalarSink {
 public:
  /// Creates `log_dir` and a new event file in it; throws naming the path if it cannot.
  explicit TensorBoardWriter(const std::string& log_dir, TensorBoardOptions options = {})
      : file_(create(log_dir, options)) {
    std::string record;
    detail::append_tfrecord(record, detail::encode_file_version_event(detail::unix_time_now()));
    file_.append(record);
    file_.flush();
  }

  /// Marks the start of a run that continues at optimizer step `step`: TensorBoard then shows
  /// none of the points at steps >= `step` that earlier files of this directory hold (what a
  /// stopped run logged after its last checkpoint), so a resumed run's curves have no doubles.
  /// Written at once (flushed): call it before the run's first scalar.
  void session_start(std::int64_t step) {
    std::string record;
    detail::append_tfrecord(record, detail::encode_session_start_event(detail::unix_time_now(), step));
    file_.append(record);
    file_.flush();
  }

  /// The event file's path.
  const std::string& path() const noexcept { return file_.path(); }
  void flush() override { file_.flush(); }
  void close() override { file_.close(); }

 protected:
  void record(std::string_view tag, double value, std::int64_t step, double wall_time) override {
    std::string record;
    detail::append_tfrecord(record, detail::encode_scalar_event(wall_time, step, tag,
                                                                static_cast<float>(value)));
    file_.append(record);
    file_.end_record();
  }

 private:
  static detail::LogFile create(const std::string& log_dir, const TensorBoardOptions& options) {
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

  detail::LogFile file_;
};

}  // namespace trainkit
