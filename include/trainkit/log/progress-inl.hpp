#pragma once
/// The definitions of trainkit/log/progress.hpp (header-only: included by it; compiled mode:
/// by src/trainkit.cpp alone). See docs/design/compiled-mode.md.
#include <trainkit/log/progress.hpp>

namespace trainkit {
namespace detail {

TRAINKIT_INLINE std::string format_hms(double seconds) {
  if (!(seconds >= 0) || std::isinf(seconds)) return "-:--:--";
  const auto s = static_cast<long long>(std::llround(seconds));
  char text[32];
  std::snprintf(text, sizeof text, "%lld:%02lld:%02lld", s / 3600, s / 60 % 60, s % 60);
  return text;
}

TRAINKIT_INLINE std::string format_step_time(double seconds) {
  if (!std::isfinite(seconds) || seconds < 0) return "- s/step";
  char buf[32];
  if (seconds < 1) std::snprintf(buf, sizeof buf, "%.3g ms/step", seconds * 1000);
  else std::snprintf(buf, sizeof buf, "%.3g s/step", seconds);
  return buf;
}

TRAINKIT_INLINE int stream_descriptor(const std::ostream* out) {
  if (out == &std::cout) return STDOUT_FILENO;
  if (out == &std::cerr || out == &std::clog) return STDERR_FILENO;
  return -1;
}

}  // namespace detail
}  // namespace trainkit
namespace trainkit {

TRAINKIT_INLINE ProgressLine::ProgressLine(ProgressOptions options)
    : options_(std::move(options)) {
  fd_ = detail::stream_descriptor(options_.out);
  terminal_ = options_.terminal ? *options_.terminal : fd_ >= 0 && ::isatty(fd_) == 1;
  if (!options_.clock) {
    options_.clock = [] {
      using namespace std::chrono;
      return duration<double>(steady_clock::now().time_since_epoch()).count();
    };
  }
}

TRAINKIT_INLINE void ProgressLine::update(const ProgressState& state) {
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

TRAINKIT_INLINE void ProgressLine::message(const std::string& text) {
  std::ostream& out = *options_.out;
  if (terminal_ && line_shown_) {
    out << "\r\x1b[K" << text << '\n' << '\r' << fit(line_) << "\x1b[K" << std::flush;
  } else {
    out << text << '\n' << std::flush;
  }
}

TRAINKIT_INLINE void ProgressLine::finish() {
  if (!has_state_) return;
  if (state_.step != drawn_.step || !line_shown_) draw(options_.clock());
  if (terminal_) *options_.out << '\n' << std::flush;
  has_state_ = false;
  line_shown_ = false;  // the rates carry over; the pause until the next epoch's start does not count
}

TRAINKIT_INLINE void ProgressLine::draw(double now) {
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

TRAINKIT_INLINE std::string ProgressLine::format() const {
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
  text += " | " + detail::format_step_time(per_step);
  if (has_rate) {
    std::snprintf(buf, sizeof buf, " | %.1f %s/s", rate_->samples / rate_->seconds, state_.unit.c_str());
  } else {
    std::snprintf(buf, sizeof buf, " | - %s/s", state_.unit.c_str());
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

TRAINKIT_INLINE std::string ProgressLine::fit(const std::string& text) const {
  int columns = options_.columns;
  struct winsize size {};
  if (columns == 0 && fd_ >= 0 && ::ioctl(fd_, TIOCGWINSZ, &size) == 0) columns = size.ws_col;
  if (columns <= 1 || static_cast<int>(text.size()) < columns) return text;
  return text.substr(0, static_cast<std::size_t>(columns - 1));
}

}  // namespace trainkit
