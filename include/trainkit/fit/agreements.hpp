#pragma once
/// Data parallel: what the fit loop's ranks must do alike (stop, write a checkpoint, finish) is
/// agreed in one small collective that every rank calls at the same point, and which also
/// combines the loop's running sums when asked. A checkpoint that failed in the background on
/// one rank is agreed the same way, so that every rank stops there. The points are the loop's:
/// every log window, each epoch's end and, between log windows, the window about
/// Replicas::agreement_seconds after the last agreement (from the ranks' mean time per window,
/// the same on every rank), so that a stop (a signal, the launcher's store gone:
/// Replicas::store_gone) waits seconds, not LOG_FREQUENT slow windows. One process: no
/// collective, its own requests.
#include <trainkit/fit/metrics.hpp>
#include <trainkit/step/replicas.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace trainkit::detail {

/// Stop, checkpoint and finish requests: this rank's, or (agreed) any rank's; and the ranks
/// whose checkpoint written in the background failed (this rank's: 0 or 1; agreed: how many).
struct Requests {
  bool stop = false, checkpoint = false, finish = false;
  std::int64_t write_failures = 0;
};

class Agreements {
 public:
  using Clock = std::chrono::steady_clock;

  Agreements(Replicas& replicas, std::int64_t log_frequent) : replicas_(replicas), log_frequent_(log_frequent) {}

  bool single() const { return replicas_.world_size() == 1; }

  /// The run starts after optimizer window `window`: the first agreement between log windows
  /// comes two windows in (nothing is measured before).
  void start(std::int64_t window) {
    last_window_ = window;
    last_at_ = Clock::now();
    next_ = window + std::min<std::int64_t>(2, log_frequent_);
  }
  /// Whether the ranks agree after window `window` although it is no log window.
  bool due(std::int64_t window) const { return !single() && window >= next_; }

  /// The requests any rank made; `totals`, when given, the mean over the ranks of their sums
  /// and weights (so that a ratio is the mean over every rank's items; every rank's task must
  /// add the same metric names). `window` > 0: an agreement after that optimizer window, which
  /// also agrees the ranks' time per window and schedules the next (due()).
  Requests agree(Requests mine, Metrics::Totals* totals = nullptr, std::int64_t window = 0) {
    if (single()) return mine;
    std::vector<double> v;
    if (totals)
      for (const auto& [name, sw] : totals->of) v.insert(v.end(), {sw.first, sw.second});
    v.insert(v.end(), {mine.stop ? 1.0 : 0.0, mine.checkpoint ? 1.0 : 0.0, mine.finish ? 1.0 : 0.0,
                       static_cast<double>(mine.write_failures)});
    if (window > 0) v.push_back(seconds_per_window(window));
    replicas_.all_reduce(v, Reduce::mean);
    std::size_t i = 0;
    if (totals)
      for (auto& [name, sw] : totals->of) sw = {v[i], v[i + 1]}, i += 2;
    if (window > 0) schedule(window, v[i + 4]);
    return {v[i] > 0, v[i + 1] > 0, v[i + 2] > 0, std::llround(v[i + 3] * replicas_.world_size())};
  }

  /// Validation metrics: the mean over the ranks.
  void mean(std::map<std::string, double>& values) {
    if (single()) return;
    std::vector<double> v;
    for (const auto& [name, x] : values) v.push_back(x);
    replicas_.all_reduce(v, Reduce::mean);
    std::size_t i = 0;
    for (auto& [name, x] : values) x = v[i++];
  }

 private:
  // This rank's seconds per window since the last agreement after a window (or the start).
  double seconds_per_window(std::int64_t window) {
    const auto now = Clock::now();
    const double seconds = std::chrono::duration<double>(now - last_at_).count();
    const double per = seconds / static_cast<double>(std::max<std::int64_t>(1, window - last_window_));
    last_at_ = now;
    last_window_ = window;
    return per;
  }
  // The next agreement: as many windows as fit in agreement_seconds (the ranks' mean), at
  // least 1 and at most LOG_FREQUENT (a log window agrees anyway).
  void schedule(std::int64_t window, double per_window) {
    const double fits =
        per_window > 0 ? Replicas::agreement_seconds / per_window : static_cast<double>(log_frequent_);
    next_ = window + std::clamp<std::int64_t>(static_cast<std::int64_t>(std::min(fits, 1e15)), 1, log_frequent_);
  }

  Replicas& replicas_;
  std::int64_t log_frequent_;
  std::int64_t next_ = 0, last_window_ = 0;
  Clock::time_point last_at_ = Clock::now();
};

}  // namespace trainkit::detail
