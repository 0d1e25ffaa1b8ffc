#pragma once
/// The training progress line: epoch, a bar, percentage and step/total, elapsed time, the whole
/// run's ETA, samples/s, loss, LR and loss scale.
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
  std::int64_t samples = 0;  ///< samples done in this epoch
  std::optional<double> loss;  ///< shown as it is, NaN and inf included
  double lr = std::numeric_limits<double>::quiet_NaN();
  double loss_scale = std::numeric_limits<double>::quiet_NaN();
};

namespace detail {

/// A duration as h:mm:ss (hours unbounded); "-:--:--" when unknown (negative, NaN, infinite).
inline std::string format_hms(double seconds) {
  if (!(seconds >= 0) || std::isinf(seconds)) return "-:--:--";
  const auto s = static_cast<long long>(std::llround(seconds));
  char text[32];
  std::snprintf(text, sizeof text, "%lld:%02lld:%02lld", s / 3600, s / 60 % 60, s % 60);
  return text;
}

inline int stream_descriptor(const std::ostream* out) {
  if (out == &std::cout) return STDOUT_FILENO;
  if (out == &std::cerr || out == &std::clog) return STDERR_FILENO;
  return -1;
}

}  // namespace detail

/// The progress line of a training run (see the header's contract).
class ProgressLine {
 public:
  explicit ProgressLine(ProgressOptions options = {}) : options_(std::move(options)) {
    fd_ = detail::stream_descriptor(options_.out);
    terminal_ = options_.terminal ? *options_.terminal : fd_ >= 0 && ::isatty(fd_) == 1;
    if (!options_.clock) {
      options_.clock = [] {
        using namespace std::chrono;
        return duration<double>(steady_clock::now().time_since_epoch()).count();
      };
    }
  }
  ProgressLine(const ProgressLine&) = delete;
  ProgressLine& operator=(const ProgressLine&) = delete;
  ~ProgressLine() { finish(); }

  bool is_terminal() const noexcept { return terminal_; }

  /// Shows `state` if it is time to: on a terminal every `refresh_seconds`, elsewhere every
  /// `every_steps` steps or `every_seconds` seconds. A new epoch (or a step going back) ends
  /// the previous epoch's line; its rates start from the new epoch's first update.
  void update(const ProgressState& state) {
    const double now = options_.clock();
    if (!started_) started_ = now;
    if (has_state_ && (state.epoch != state_.epoch || state.step < state_.step)) finish();
    state_ = state;
    if (!has_state_) {  // the epoch's first point: rates start here; a terminal shows it
      has_state_ = true;
      drawn_ = {now, state.step, state.samples};
      if (terminal_) draw(now);
      return;
    }
    const bool due = terminal_ ? now - drawn_.time >= options_.refresh_seconds
                               : (options_.every_steps > 0 &&
                                  state.step - drawn_.step >= options_.every_steps) ||
                                     (options_.every_seconds > 0 &&
                                      now - drawn_.time >= options_.every_seconds);
    if (due) draw(now);
  }

  /// Prints `text` on a line of its own; on a terminal the progress line is redrawn below it.
  void message(const std::string& text) {
    std::ostream& out = *options_.out;
    if (terminal_ && line_shown_) {
      out << "\r\x1b[K" << text << '\n' << '\r' << fit(line_) << "\x1b[K" << std::flush;
    } else {
      out << text << '\n' << std::flush;
    }
  }

  /// Ends the epoch's line with its latest state (a terminal's line gets its newline). The next
  /// update() starts afresh. Called by a new epoch and by the destructor.
  void finish() {
    if (!has_state_) return;
    if (state_.step != drawn_.step || !line_shown_) draw(options_.clock());
    if (terminal_) *options_.out << '\n' << std::flush;
    has_state_ = false;
    line_shown_ = false;  // the rates carry over; the pause until the next epoch's start does not count
  }

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

  void draw(double now) {
    const Point point{now, state_.step, state_.samples};
    if (point.time > drawn_.time && point.step >= drawn_.step) {
      const Rates interval{point.time - drawn_.time, double(point.step - drawn_.step),
                           double(point.samples - drawn_.samples)};
      const double a = options_.smoothing;
      rate_ = rate_ ? Rates{a * interval.seconds + (1 - a) * rate_->seconds,
                            a * interval.steps + (1 - a) * rate_->steps,
                            a * interval.samples + (1 - a) * rate_->samples}
                    : interval;
    }
    drawn_ = point;
    line_ = format();
    line_shown_ = true;
    std::ostream& out = *options_.out;
    if (terminal_) {
      out << '\r' << fit(line_) << "\x1b[K" << std::flush;
    } else {
      out << line_ << '\n' << std::flush;
    }
  }

  std::string format() const {
    char buf[96];
    std::string text = "Epoch " + std::to_string(state_.epoch);
    if (state_.epochs > 0) text += "/" + std::to_string(state_.epochs);
    if (state_.total > 0) {
      const std::int64_t step = std::clamp<std::int64_t>(state_.step, 0, state_.total);  // floors: 100% when done
      if (terminal_) {
        constexpr std::int64_t kBar = 20;
        const auto full = static_cast<std::size_t>(step * kBar / state_.total);
        text += " [" + std::string(full, '=') + (full < kBar ? ">" + std::string(kBar - full - 1, ' ') : "") + "]";
      }
      const int width = static_cast<int>(std::to_string(state_.total).size());
      std::snprintf(buf, sizeof buf, " %3d%% %*lld/%lld", static_cast<int>(step * 100 / state_.total), width,
                    static_cast<long long>(state_.step), static_cast<long long>(state_.total));
    } else {
      std::snprintf(buf, sizeof buf, " step %lld", static_cast<long long>(state_.step));
    }
    text += buf;
    text += " | " + detail::format_hms(drawn_.time - started_.value_or(drawn_.time));
    const bool has_rate = rate_ && rate_->seconds > 0;
    const double per_step = has_rate && rate_->steps > 0 ? rate_->seconds / rate_->steps
                                                         : std::numeric_limits<double>::quiet_NaN();
    if (state_.run_total > 0) {
      text += " ETA " + detail::format_hms(double(state_.run_total - state_.run_step) * per_step);
    } else if (state_.total > 0) {
      text += " epoch ETA " + detail::format_hms(double(state_.total - state_.step) * per_step);
    }
    if (has_rate) {
      std::snprintf(buf, sizeof buf, " | %.1f samples/s", rate_->samples / rate_->seconds);
    } else {
      std::snprintf(buf, sizeof buf, " | - samples/s");
    }
    text += buf;
    if (state_.loss) {
      std::snprintf(buf, sizeof buf, " | loss %.4g", *state_.loss);
      text += buf;
    }
    if (!std::isnan(state_.lr)) {
      std::snprintf(buf, sizeof buf, " lr %.3g", state_.lr);
      text += buf;
    }
    if (!std::isnan(state_.loss_scale)) {
      std::snprintf(buf, sizeof buf, " scale %.6g", state_.loss_scale);
      text += buf;
    }
    return text;
  }

  /// The line cut to the terminal's width less one (writing the last column wraps on some).
  std::string fit(const std::string& text) const {
    int columns = options_.columns;
    struct winsize size {};
    if (columns == 0 && fd_ >= 0 && ::ioctl(fd_, TIOCGWINSZ, &size) == 0) columns = size.ws_col;
    if (columns <= 1 || static_cast<int>(text.size()) < columns) return text;
    return text.substr(0, static_cast<std::size_t>(columns - 1));
  }

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
