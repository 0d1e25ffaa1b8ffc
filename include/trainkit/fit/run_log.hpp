#pragma once
/// What a fit run tells its user and writes down, in one place: the progress line
/// (log/progress.hpp), the run's text log (log/text_log.hpp), the scalar logs (TensorBoard
/// events and JSON lines, log/scalars.hpp, continued across a resume), the messages, and the
/// health warnings about skipped steps. The fit loop (fit.hpp) calls it; on ranks other than
/// the main one it writes nothing (but still checks health: every rank must stop alike).
///
/// Contract — what the loop calls, and when:
///   RunLog(options, trainer, writes, on_scalar)   once; `writes`: this rank writes files
///   started()                      before resuming: the run's start in the text log
///   open(resumed, run_windows)     after resuming: the scalar logs, from the trainer's step on
///   epoch_begins(epoch, index, batches)
///   samples(n)                     n more items trained (speed, progress; n < 0: a micro-batch
///                                  without an item count, and the throughput's unit becomes
///                                  micro-batches); counts() and restore() put them back for a
///                                  replayed window
///   window(report, position, interval)
///                                  after each optimizer window; `interval` (the means since the
///                                  last log window) only at log windows: then it logs, checks
///                                  health (throws NonFiniteGradient when it is time to stop;
///                                  turns the overflow diagnosis on after skipped steps, and off
///                                  after a clean interval)
///   diagnosis_due()                the next window must be a log window (a stop waits one
///                                  watched window, to name the layers)
///   logs_window(w)                 whether optimizer window w (counted from 1) is a log window
///   record_forward(w)              around each task.loss of window w: records the forward's
///                                  peaks when forward_peaks is on and w is a log window (an
///                                  empty Recording otherwise); window() logs them
///   validation(epoch, metrics)     after a validation (the metrics agreed over the ranks)
///   epoch_ends(position), paused() between epochs (validation and checkpoints are not
///                                  training time); epoch_ends checks skipped steps since the
///                                  last log window as a log window does
///   say(text), report(text)        a message for the user / a line of the run's record
///   finish(epoch, index)           once, at the end (errors of the last writes surface here)
#include <trainkit/detail/inline.hpp>
#include <trainkit/trainer/any_trainer.hpp>
#include <trainkit/trainer/forward_peaks.hpp>
#include <trainkit/detail/messages.hpp>
#include <trainkit/fit/fit_options.hpp>
#include <trainkit/log/progress.hpp>
#include <trainkit/log/scalars.hpp>
#include <trainkit/log/tensorboard.hpp>
#include <trainkit/log/text_log.hpp>
#include <trainkit/step/optim.hpp>
#include <trainkit/step/options.hpp>
#include <trainkit/step/step_report.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <iostream>
#include <limits>
#include <map>
#include <memory>
#include <optional>
#include <utility>
#include <string>

#include <unistd.h>

namespace trainkit {

/// Where the loop stands when it logs: `done` micro-batches of `batches` in `epoch`.
struct LogPosition {
  std::int64_t epoch = 0, done = 0, batches = 0;
};

class RunLog {
 public:
  using OnScalar = std::function<void(const std::string& tag, double value, std::int64_t step)>;

  RunLog(const FitOptions& options, AnyTrainer& trainer, bool writes, OnScalar on_scalar);
  ~RunLog();
  RunLog(const RunLog&) = delete;
  RunLog& operator=(const RunLog&) = delete;

  /// A line for the user (the writing rank only), below the progress line when there is one,
  /// and in the text log.
  void say(const std::string& text);
  /// Whether the next optimizer window must be a log window: a run about to stop on skipped
  /// steps watches one more window to name where its gradient stops being finite.
  /// Also after a non-finite training loss, when the forward's peaks were not recorded: the next
  /// window records them, to name the module whose output is first not finite.
  bool diagnosis_due() const { return !pending_stop_.empty() || forward_due_; }
  /// The first check of a run's health comes this many windows in at the latest, whatever
  /// LOG_FREQUENT: a run that skips every step says so within them.
  static constexpr std::int64_t first_check = 20;
  /// Whether optimizer window `window` (the trainer's count once it closes) is a log window:
  /// every LOG_FREQUENT-th, the run's first_check-th, and the one a diagnosis is due at.
  bool logs_window(std::int64_t window) const {
    return window % options_.log_frequent() == 0 || window == first_check_window_ || diagnosis_due();
  }
  /// The forward's peaks recorded while the result lives, when FitOptions::forward_peaks is on
  /// and `window` is a log window; an empty Recording otherwise (nothing registered).
  ForwardPeaks::Recording record_forward(std::int64_t window) {
    return forward_peaks_ && logs_window(window) ? forward_peaks_->record() : ForwardPeaks::Recording();
  }
  /// The forward's records so far, and those after a mark dropped (a window or a micro-batch
  /// replayed after out-of-memory: the failed attempt's outputs are not the run's).
  ForwardPeaks::Mark forward_mark() const { return forward_peaks_ ? forward_peaks_->mark() : ForwardPeaks::Mark(); }
  void forward_discard(const ForwardPeaks::Mark& m) {
    if (forward_peaks_) forward_peaks_->discard_since(m);
  }
  /// What happened on this rank alone (an out-of-memory replay): said as say() does on the
  /// writing rank, on stderr with the rank on the others.
  void say_local(const std::string& text);
  /// A line of the run's record (a validation, a checkpoint): below the progress line when there
  /// is one (not on stderr without one), and in the text log.
  void report(const std::string& text);

  /// The run's start: the seed when it was drawn, the trainer, the device and the ranks.
  void started();

  /// The scalar logs, continued from where training continues (the trainer's step): a run
  /// stopped after its last checkpoint logged points that the resumed run logs again, so the
  /// JSON lines past that step are cut, and TensorBoard is told to hide them (a session
  /// start). Also where the health checks and the run's ETA count from: `run_windows` optimizer
  /// windows lie ahead.
  void open(bool resumed, std::int64_t run_windows);

  void epoch_begins(std::int64_t epoch, std::int64_t index, std::int64_t batches);
  void samples(std::int64_t n);
  /// The sample counts, to put back when a window is replayed from its start.
  struct Counts {
    std::int64_t since_log = 0, in_epoch = 0;
  };
  Counts counts() const { return {samples_since_log_, samples_in_epoch_}; }
  void restore(const Counts& c);

  /// After an optimizer window; `interval` at log windows only (see the file comment).
  void window(const StepReport& report, LogPosition at, const std::map<std::string, double>* interval);

  /// A validation's metrics, logged at the trainer's step and shown.
  void validation(std::int64_t epoch, const std::map<std::string, double>& metrics);

  /// The epoch's line ends complete.
  void epoch_ends(LogPosition at);
  /// Validation and checkpoints are not training time.
  void paused();

  void finish(std::int64_t epoch, std::int64_t index);

 private:
  using Clock = std::chrono::steady_clock;

  void scalar(const std::string& tag, double value, std::int64_t step);

  // Skipped optimizer steps, seen at log windows from the report's counters (no sync of their
  // own). FP32/BF16 skip only on a non-finite gradient, never in a healthy run: the first skip
  // is a warning, and nonfinite_patience skips with no clean log interval between them stop the
  // run (on every rank: the counters agree). FP16's loss scale backs off by skipping: after the
  // start-up backoff, a log interval with more than a quarter of its steps skipped is reported
  // with the scale, once until an interval is clean again.
  struct Skips {
    std::int64_t skipped = 0, window = 0;  // the counters: skipped steps and optimizer windows so far
    double loss_scale = 1;
  };
  void check_skipped(const Skips& now, LogPosition at, std::optional<double> loss, bool epoch_end);
  // Skips of a dynamic scale going from `from` down to `to` (its search, not a sign of trouble).
  std::int64_t search_skips(double from, double to) const;
  // What to do about a non-finite training loss (the forward, not the scale).
  std::string forward_remedy() const;
  // The forward's peaks, turned on by a non-finite training loss when FitOptions::forward_peaks
  // is off (and off again after a clean interval).
  void record_forward_peaks();
  // The overflow diagnosis since the last log window (the ranks' counts combined), logged as
  // nonfinite/<module> scalars; the text naming the modules, or empty.
  std::string nonfinite_names(std::int64_t step);
  // The forward's peaks since the last log window (the ranks' combined), logged as
  // forward-peak/<module> scalars and a line of the text log, a non-finite output warned about
  // once per episode; the text naming where the output first stopped being finite, or empty.
  std::string forward_peaks_logged(LogPosition at, std::int64_t step);
  // The patience stop of a run that did not watch its gradients yet, saying how to learn where.
  NonFiniteGradient unwatched_stop(const std::string& stop) const;

  // The progress line counts optimizer windows inside the epoch, and in the whole run; the
  // loss, LR and scale are the last log window's.
  ProgressState progress_state(LogPosition at) const;

  const FitOptions& options_;
  AnyTrainer& trainer_;  // (not const: the overflow diagnosis is turned on and read here)
  bool writes_;
  OnScalar on_scalar_;
  std::unique_ptr<ScalarFanout> writers_;  // TensorBoard events and JSON lines
  std::unique_ptr<ProgressLine> progress_;
  std::unique_ptr<TextLog> text_log_;      // <output_path>/<prefix>-log.txt
  std::int64_t skipped_at_log_ = 0, window_at_log_ = 0;  // the counters at the last log (check_skipped)
  std::int64_t skipped_unhealthy_ = 0;                   // FP32/BF16 skips since a clean interval
  bool skip_warned_ = false, scale_warned_ = false;
  bool named_ = false;          // the modules said since the last clean interval
  std::string pending_stop_;    // a stop that waits for the next window, watched (diagnosis_due())
  std::unique_ptr<ForwardPeaks> forward_peaks_;  // FitOptions::forward_peaks, or turned on by a non-finite loss
  bool forward_auto_ = false;   // forward_peaks_ turned on by a non-finite loss (off after a clean interval)
  bool forward_due_ = false;    // the next window records the forward (diagnosis_due())
  bool forward_recorded_ = false;  // the last log window's forward was recorded
  std::string forward_origin_;  // the last log window's: where the forward stopped being finite
  bool forward_warned_ = false; // said since the forward was last finite
  std::int64_t first_check_window_ = first_check;  // open(): the run's first check, first_check windows in
  double scale_at_log_ = 0;     // the loss scale at the last check (a dynamic scale's search)
  StepReport last_report_;      // the epoch's last window's (epoch_ends checks skipped steps)
  std::int64_t run_windows_ = 0, run_total_ = 0;  // this run's optimizer windows: done, all (progress ETA)
  std::optional<double> last_loss_;               // the last log window's, for the progress line
  double last_lr_ = std::numeric_limits<double>::quiet_NaN(), last_scale_ = std::numeric_limits<double>::quiet_NaN();
  Clock::time_point clock_ = Clock::now();
  std::int64_t samples_since_log_ = 0, samples_in_epoch_ = 0;
  std::int64_t windows_since_log_ = 0;  // optimizer steps since the last log (seconds-per-step)
  std::string unit_ = "items";          // what samples() counts: items, or micro-batches
};

}  // namespace trainkit

#ifndef TRAINKIT_COMPILED_LIB
#include <trainkit/fit/run_log-inl.hpp>
#endif
