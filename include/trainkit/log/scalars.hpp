#pragma once
/// Scalar logs: the sink interface the fit loop writes to, CSV and JSON-lines writers, an
/// in-memory recorder and a fan-out. The TensorBoard writer (log/tensorboard.hpp) is a sink too.
///
/// Contract of a ScalarSink:
///   add_scalar(tag, value, step)             records one scalar, stamped with the wall clock
///   add_scalar(tag, value, step, wall_time)  the same at a given time (Unix seconds): a fan-out
///                                            stamps once, so every file holds the same time
///   flush()                                  everything recorded so far is in the files
///   close()                                  flush(), then close the files; idempotent
/// `step` is the optimizer step count (applied and skipped steps), the x axis of every curve.
/// The file writers buffer (FlushPolicy) and throw std::runtime_error naming the file on any
/// failure to create, write or close it (unwritable directory, full disk). Their destructors
/// flush; an error there cannot be thrown and is printed on stderr, so call close() to see it.
/// Sinks are not thread-safe. This header does not include LibTorch.
///
/// Files (one line per scalar, appended to an existing file by default, so a resumed run
/// continues its log; a new file starts with the CSV header):
///   CSV    step,tag,value,wall_time           12,Train-Loss,0.25,1733150000.123456
///          (RFC 4180 quoting of tags with , " or newlines; non-finite values: nan, inf, -inf)
///   JSONL  {"step":12,"tag":"Train-Loss","value":0.25,"wall_time":1733150000.123456}
///          (non-finite values as the strings "NaN", "Infinity", "-Infinity": JSON has no
///          literal for them, and a NaN loss is what a log must show)
/// Values are written with 17 significant digits: the double read back is the one written.
#include <trainkit/detail/inline.hpp>
#include <trainkit/log/log_file.hpp>

#include <charconv>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <system_error>
#include <utility>
#include <vector>

namespace trainkit {

/// The tags the fit loop logs (VL-BERT's names, plus the mixed-precision and speed ones).
namespace scalar_tags {
/// Mean loss of the optimizer steps since the last log.
inline constexpr const char* train_loss = "Train-Loss";
/// Learning rate of parameter group `i`: LR/Group_0, LR/Group_1, ...
inline std::string lr_group(std::size_t i) { return "LR/Group_" + std::to_string(i); }
/// The LR group `i` starts from (the base LR times its LR_MULT), VL-BERT's Initial-LR/Group_i.
inline std::string initial_lr_group(std::size_t i) { return "Initial-LR/Group_" + std::to_string(i); }
/// Global L2 norm of the true (unscaled) gradient, before clipping.
inline constexpr const char* grad_norm = "grad-para/Total-Norm";
/// A validation metric: Val-Acc, Val-Loss, ...
inline std::string validation(std::string_view metric) { return "Val-" + std::string(metric); }
/// The dynamic loss scale (FP16).
inline constexpr const char* loss_scale = "loss-scale";
/// Running count of skipped (non-finite) steps.
inline constexpr const char* skipped_steps = "skipped-steps";
/// The overflow diagnosis, per module whose gradient was not finite since the last log:
/// nonfinite/<module path> = the windows it counted (logged only where non-zero).
inline const std::string nonfinite_prefix = "nonfinite/";
/// The forward's peaks (FitOptions::forward_peaks), per module at log windows:
/// forward-peak/<module path> = the largest |output| of its operators (+inf: not finite).
inline const std::string forward_peak_prefix = "forward-peak/";
/// Training throughput since the last log: items (task.items) per second, or micro-batches per
/// second when the task gives no item count.
inline constexpr const char* samples_per_second = "samples-per-second";
/// Wall time per optimizer step since the last log, in seconds.
inline constexpr const char* seconds_per_step = "seconds-per-step";
}  // namespace scalar_tags

/// When buffered records go to the file: after `every_records` records or, checked as records
/// arrive, `every_seconds` after the last write; always on flush(), close() and destruction.
struct FlushPolicy {
  std::size_t every_records = 64;
  double every_seconds = 5.0;
};

/// Where scalars go. Implementations override record() and flush() (and close() if they hold
/// files); callers use add_scalar().
class ScalarSink {
 public:
  virtual ~ScalarSink() = default;

  /// Records `value` for `tag` at optimizer step `step`, stamped with the current wall time.
  void add_scalar(std::string_view tag, double value, std::int64_t step);
  /// Records `value` for `tag` at `step`, stamped `wall_time` (seconds since the Unix epoch).
  void add_scalar(std::string_view tag, double value, std::int64_t step, double wall_time);
  /// Everything recorded so far reaches the files; throws naming the file that failed.
  virtual void flush() = 0;
  /// Flushes and releases the files; throws what flushing or closing reports. Idempotent.
  virtual void close() { flush(); }

 protected:
  virtual void record(std::string_view tag, double value, std::int64_t step, double wall_time) = 0;
};

/// One recorded scalar (ScalarRecorder).
struct Scalar {
  std::string tag;
  double value;
  std::int64_t step;
  double wall_time;
};

/// Keeps every scalar in memory, in order: for tests and for callers that inspect the log.
class ScalarRecorder : public ScalarSink {
 public:
  const std::vector<Scalar>& scalars() const noexcept { return scalars_; }
  void flush() override {}

 protected:
  TRAINKIT_INLINE void record(std::string_view tag, double value, std::int64_t step, double wall_time) override;

 private:
  std::vector<Scalar> scalars_;
};

/// Options of the CSV and JSON-lines writers.
struct TextLogOptions {
  FlushPolicy flush;
  /// Append to an existing file (a resumed run continues it) rather than truncate it.
  bool append = true;
};

namespace detail {

/// `value` with 17 significant digits, or `nan_inf[0..2]` for NaN, +inf, -inf.
std::string format_double(double value, const char* const (&nan_inf)[3]);

std::string format_wall_time(double wall_time);

/// A one-line-per-scalar text file: opened (with its directory) per TextLogOptions, `header`
/// at the start of a new file; derived classes say how a scalar reads as a line.
class TextScalarLog : public ScalarSink {
 public:
  const std::string& path() const noexcept { return file_.path(); }
  void flush() override { file_.flush(); }
  void close() override { file_.close(); }

 protected:
  TextScalarLog(const std::string& path, const TextLogOptions& options, const std::string& what,
                std::string_view header)
      : file_(open(path, options, what, header)) {}
  /// The scalar's line, with its newline.
  virtual std::string line(std::string_view tag, double value, std::int64_t step,
                           double wall_time) const = 0;

 private:
  TRAINKIT_INLINE void record(std::string_view tag, double value, std::int64_t step, double wall_time) final;

  static LogFile open(const std::string& path, const TextLogOptions& options, const std::string& what,
                      std::string_view header);

  LogFile file_;
};

}  // namespace detail

/// Scalars as CSV, one `step,tag,value,wall_time` line each (the header says so).
class CsvScalarWriter : public detail::TextScalarLog {
 public:
  /// Opens `path` (creating its directory); throws naming the file if it cannot.
  explicit CsvScalarWriter(const std::string& path, TextLogOptions options = {})
      : TextScalarLog(path, options, "CSV log", "step,tag,value,wall_time\n") {}

 protected:
  TRAINKIT_INLINE std::string line(std::string_view tag, double value, std::int64_t step, double wall_time) const override;
};

/// Scalars as JSON lines: {"step":..,"tag":..,"value":..,"wall_time":..} per line.
class JsonlScalarWriter : public detail::TextScalarLog {
 public:
  /// Opens `path` (creating its directory); throws naming the file if it cannot.
  explicit JsonlScalarWriter(const std::string& path, TextLogOptions options = {})
      : TextScalarLog(path, options, "JSON-lines log", "") {}

 protected:
  TRAINKIT_INLINE std::string line(std::string_view tag, double value, std::int64_t step, double wall_time) const override;
};

/// Drops the points a stopped run logged after its last checkpoint, so that a resumed run does
/// not log the same (step, tag) twice: removes the trailing lines of a CSV or JSON-lines scalar
/// log (as the writers above write them) whose step is past `last_step`, and a torn last line (no
/// newline: the process died while writing it). Stops at the first line, from the end, with a
/// step <= last_step or without a step (the CSV header), so an earlier run's log is never touched.
/// Returns the number of lines dropped; a missing file is 0. Throws naming the file on failure.
std::size_t drop_points_after(const std::string& path, std::int64_t last_step);

/// Sends every scalar to each of its sinks, stamped with one wall time. An error in one sink
/// does not starve the others: all are called, then the first error is rethrown.
class ScalarFanout : public ScalarSink {
 public:
  /// Adds a sink (owned); returns it.
  ScalarSink& add(std::unique_ptr<ScalarSink> sink);
  /// Constructs a sink of type T in place; returns it.
  template <class T, class... Args>
  T& emplace(Args&&... args) {
    auto sink = std::make_unique<T>(std::forward<Args>(args)...);
    T& ref = *sink;
    sinks_.push_back(std::move(sink));
    return ref;
  }
  std::size_t size() const noexcept { return sinks_.size(); }

  TRAINKIT_INLINE void flush() override;
  TRAINKIT_INLINE void close() override;

 protected:
  TRAINKIT_INLINE void record(std::string_view tag, double value, std::int64_t step, double wall_time) override;

 private:
  template <class F>
  void for_each(F&& f) {
    std::exception_ptr first;
    for (auto& sink : sinks_) {
      try {
        f(*sink);
      } catch (...) {
        if (!first) first = std::current_exception();
      }
    }
    if (first) std::rethrow_exception(first);
  }

  std::vector<std::unique_ptr<ScalarSink>> sinks_;
};

}  // namespace trainkit

#ifndef TRAINKIT_COMPILED_LIB
#include <trainkit/log/scalars-inl.hpp>
#endif
