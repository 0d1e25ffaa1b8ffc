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
/// The format (log/event_encoding.hpp) is TFRecord framing around Event protobufs. It is
/// hand-encoded because it is small (five field kinds) and no Debian package offers a C++ writer
/// without protobuf or TensorFlow. This header does not include LibTorch.
#include <trainkit/detail/inline.hpp>
#include <trainkit/log/event_encoding.hpp>
#include <trainkit/log/log_file.hpp>
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
  explicit TensorBoardWriter(const std::string& log_dir, TensorBoardOptions options = {});

  /// Marks the start of a run that continues at optimizer step `step`: TensorBoard then shows
  /// none of the points at steps >= `step` that earlier files of this directory hold (what a
  /// stopped run logged after its last checkpoint), so a resumed run's curves have no doubles.
  /// Written at once (flushed): call it before the run's first scalar.
  void session_start(std::int64_t step);

  /// The event file's path.
  const std::string& path() const noexcept { return file_.path(); }
  void flush() override { file_.flush(); }
  void close() override { file_.close(); }

 protected:
  TRAINKIT_INLINE void record(std::string_view tag, double value, std::int64_t step, double wall_time) override;

 private:
  static detail::LogFile create(const std::string& log_dir, const TensorBoardOptions& options);

  detail::LogFile file_;
};

}  // namespace trainkit

#ifndef TRAINKIT_COMPILED_LIB
#include <trainkit/log/tensorboard-inl.hpp>
#endif
