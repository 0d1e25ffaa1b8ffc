#pragma once
/// The training progress line: epoch, a bar, percentage and step/total, elapsed time, the whole
/// run's ETA, the time per step, the throughput (samples/s, or its unit), loss, LR and loss scale.
///
/// Contract:
///   ProgressLine(options)  output stream, terminal or not, clock: injectable (tests)
///   update(state)          the fit loop's state after an optimizer step; the epoch's first
///                          update is where its rates start (give one at step 0 when the epoch
///                          begins). Cheap when nothing is drawn: no I/O, one clock read.
///   message(text)          a line of its own (a checkpoint written, a validation result) that
///                          does not tear the progress line
///   finish()               ends the current epoch's line (also done by a new epoch and by the
///                          destructor)
/// On a terminal: one line redrawn in place ("\r", text, erase to end of line), at most every
/// `refresh_seconds`, cut to the terminal's width so that it never wraps. Elsewhere (a file, a
/// pipe, a cluster's log): a plain line every `every_steps` steps and/or every `every_seconds`.
/// Rates are exponential moving averages over the intervals between drawn lines (weight
/// `smoothing` on the newest), so a slow first batch fades out; they carry over from one epoch
/// to the next, but the pause between two epochs (validation, checkpoints) is not counted. The
/// ETA is the whole run's when the state has run_total ((run_total - run_step) at the averaged
/// time per step), else the epoch's; elapsed time counts from the first update. Durations are
/// h:mm:ss. A terminal's line has a bar of the epoch's progress; the plain lines do not.
/// Not thread-safe.
/// This header does not include LibTorch.
#include <trainkit/detail/inline.hpp>
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <iostream>
#include <limits>
#include <optional>
#include <ostream>
#include <string>
#include <utility>

#include <sys/ioctl.h>
#include <unistd.h>

namespace trainkit {

/// Where and how often the progress line is drawn.
struct ProgressOptions {
  /// The stream; std::cout, std::cerr and std::clog are recognised as their file descriptors.
  std::ostream* out = &std::cerr;
  /// Draw as on a terminal; unset: isatty() of the stream's descriptor (false for other streams).
  std::optional<bool> terminal;
  /// Terminal: the shortest interval between two redraws.
  double refresh_seconds = 0.2;
  /// Terminal: the width the line is cut to; 0: ask the terminal (TIOCGWINSZ), else unbounded.
  int columns = 0;
  /// Not a terminal: a line every this many steps (LOG_FREQUENT); 0: none by steps.
  std::int64_t every_steps = 0;
  /// Not a terminal: a line when this many seconds passed since the last; 0: none by time.
  double every_seconds = 30.0;
  /// Weight of the newest interval in the rate averages, in (0, 1]; 1: no smoothing.
  double smoothing = 0.3;
  /// Monotonic seconds; unset: std::chrono::steady_clock.
  std::function<double()> clock;
};

/// What the line shows. NaN LR and scale are left out (a loss scale only exists with FP16Dynamic);
/// a loss, when given, is shown even when it is NaN or inf.
struct ProgressState {
  std::int64_t epoch = 0;
  std::int64_t epochs = 0;   ///< the run's end epoch (shown as "Epoch e/epochs"); 0: unknown
  std::int64_t step = 0;     ///< steps done in this epoch
  std::int64_t total = 0;    ///< steps in this epoch; 0: unknown (no ETA, no percentage)
  std::int64_t run_step = 0;   ///< steps done in this run (every epoch's)
  std::int64_t run_total = 0;  ///< steps in the whole run; 0: unknown (the ETA is the epoch's)
  std::int64_t samples = 0;  ///< samples (items) done in this epoch
  std::string unit = "samples";  ///< what `samples` counts, in the throughput's label (unit/s)
  std::optional<double> loss;  ///< shown as it is, NaN and inf included
  double lr = std::numeric_limits<double>::quiet_NaN();
  double loss_scale = std::numeric_limits<double>::quiet_NaN();
};

namespace detail {

/// A duration as h:mm:ss (hours unbounded); "-:--:--" when unknown (negative, NaN, infinite).
std::string format_hms(double seconds);
/// The time of one step: "12.3 ms/step", "1.52 s/step"; "- s/step" when unknown.
std::string format_step_time(double seconds);

int stream_descriptor(const std::ostream* out);

}  // namespace detail

/// The progress line of a training run (see the header's contract).
class ProgressLine {
 public:
  explicit ProgressLine(ProgressOptions options = {});
  ProgressLine(const ProgressLine&) = delete;
  ProgressLine& operator=(const ProgressLine&) = delete;
  ~ProgressLine() { finish(); }

  bool is_terminal() const noexcept { return terminal_; }

  /// Shows `state` if it is time to: on a terminal every `refresh_seconds`, elsewhere every
  /// `every_steps` steps or `every_seconds` seconds. A new epoch (or a step going back) ends
  /// the previous epoch's line; its rates start from the new epoch's first update.
  void update(const ProgressState& state);

  /// Prints `text` on a line of its own; on a terminal the progress line is redrawn below it.
  void message(const std::string& text);

  /// Ends the epoch's line with its latest state (a terminal's line gets its newline). The next
  /// update() starts afresh. Called by a new epoch and by the destructor.
  void finish();

  /// The text of the last line drawn (without terminal control characters).
  const std::string& line() const noexcept { return line_; }

 private:
  struct Point {
    double time;
    std::int64_t step;
    std::int64_t samples;
  };
  struct Rates {  // moving averages of one interval's length, steps and samples
    double seconds, steps, samples;
  };

  void draw(double now);

  std::string format() const;

  /// The line cut to the terminal's width less one (writing the last column wraps on some).
  std::string fit(const std::string& text) const;

  ProgressOptions options_;
  int fd_ = -1;
  bool terminal_ = false;
  bool has_state_ = false;   // an epoch's line is in progress
  bool line_shown_ = false;  // its line has been drawn
  std::optional<double> started_;  // the clock at the first update (elapsed time)
  ProgressState state_;
  Point drawn_{};  // the last drawn point (or the epoch's first)
  std::optional<Rates> rate_;
  std::string line_;
};

}  // namespace trainkit

#ifndef TRAINKIT_COMPILED_LIB
#include <trainkit/log/progress-inl.hpp>
#endif
