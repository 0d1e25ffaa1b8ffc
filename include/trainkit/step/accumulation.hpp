#pragma once
/// Accumulation policies: how many micro-batches make a window, and how each is weighted.
///
/// Contract — what the trainer calls, and when:
///   AccumulationPolicy<N>(const TrainerOptions&)    once, at construction
///   weight(items)     micro-step phase 2, before backward: the host factor the loss is
///                     multiplied by. items < 0: no item count (plain 1/N weighting)
///   closes()          after the micro-step: true when this micro-step ends the window
///   rescale()         optimizer phase: the host factor R that turns the accumulated gradient
///                     into the mean over the window's micro-batches (or items); 1 for a full
///                     window with plain weighting, N/k for a partial one (flush)
///   reset()           after the optimizer phase (or a dropped window)
///   discard()         Trainer::discard_window(): the open window forgotten
///   save / load       the window's counts and the running mean, for checkpoints
/// Guarantees: with item counts, the window's gradient is the gradient of the mean over all
/// its items, exactly, whatever the counts; every factor is a host double (no device work).
#include <trainkit/archive/checkpoint_io.hpp>
#include <trainkit/step/options.hpp>

#include <torch/serialize/archive.h>

#include <cstdint>
#include <stdexcept>
#include <string>

namespace trainkit {

/// `AccumulationPolicy<Dynamic>`: the window length is TrainerOptions::accumulation_steps.
inline constexpr int Dynamic = -1;

namespace detail {
/// An AccumulationPolicy's counts, whatever its N: the open window's and the running mean's.
struct WindowState {
  std::int64_t position, items;
  double reference;
  bool counted;
  std::int64_t seen_items = 0, seen_batches = 0;  // the closed windows' counts (reference)
};
/// The window.* records of a checkpoint.
void save_window_state(torch::serialize::OutputArchive& archive, const WindowState& state);
WindowState load_window_state(torch::serialize::InputArchive& archive);
}  // namespace detail

template <int N>
class AccumulationPolicy {
  static_assert(N >= 1 || N == Dynamic,
                "trainkit::AccumulationPolicy<N>: N must be >= 1 micro-batches per optimizer "
                "step, or tk::Dynamic to choose it at run time (TrainerOptions::accumulation_steps)");

 public:
  /// The compile-time window length; Dynamic (-1) when chosen at run time.
  static constexpr int steps = N;
  static constexpr bool is_dynamic = (N == Dynamic);

  explicit AccumulationPolicy(const TrainerOptions& options)
      : window_(is_dynamic ? options.accumulation_steps() : N) {}

  /// Micro-batches per window.
  constexpr std::int64_t window() const {
    if constexpr (is_dynamic) return window_;
    else return N;
  }
  /// Changes the window length of AccumulationPolicy<Dynamic>, only between windows.
  void set_window(std::int64_t n) {
    static_assert(is_dynamic, "set_window needs AccumulationPolicy<tk::Dynamic>");
    if (n < 1) throw std::invalid_argument("accumulation steps must be >= 1, got " + std::to_string(n));
    if (position_ != 0)
      throw std::logic_error("set_window: the window length can change only between windows (" +
                             std::to_string(position_) + " micro-batches are pending)");
    window_ = n;
  }

  /// Micro-batches already in the current window.
  std::int64_t position() const { return position_; }
  /// Items already in the current window (0 with plain weighting).
  std::int64_t items() const { return items_; }

  /// Phase 2: the factor for this micro-step's loss; advances the position.
  double weight(std::int64_t items) {
    const bool counted = items >= 0;
    if (position_ == 0) {
      counted_ = counted;
      // Any constant works for exactness (rescale() divides it back out). This one keeps the
      // weighted loss at the magnitude of the window's mean, items_i / (window's items), as a
      // GradScaler loop weights it: with fp16 loss scaling, larger weights overflow more often.
      // The window's item count is known only at its end: the mean count per micro-batch of the
      // windows so far times N stands for it (the first micro-batch's count in the first window).
      const double per_batch = seen_batches_ > 0 ? static_cast<double>(seen_items_) / static_cast<double>(seen_batches_)
                                                 : static_cast<double>(items > 0 ? items : 1);
      reference_ = counted ? per_batch * static_cast<double>(window()) : static_cast<double>(window());
    } else if (counted != counted_) {
      throw std::invalid_argument(
          "micro_step: micro-batch " + std::to_string(position_ + 1) + " of the window " +
          (counted ? "gives" : "does not give") + " an item count, the first one " +
          (counted_ ? "did" : "did not") + "; pass item counts for every micro-batch or for none");
    }
    ++position_;
    if (!counted) return 1.0 / reference_;
    items_ += items;
    return static_cast<double>(items) / reference_;
  }

  /// True when the micro-step just weighted ends the window.
  bool closes() const { return position_ >= window(); }

  /// Optimizer phase: turns the accumulated sum into the window's mean.
  double rescale() const {
    if (counted_) {
      if (items_ <= 0)
        throw std::invalid_argument("optimizer step: the window's item counts sum to 0; "
                                    "a window needs at least one item");
      return reference_ / static_cast<double>(items_);
    }
    return reference_ / static_cast<double>(position_);
  }

  /// After the optimizer phase: the window's counts join the running mean (reference above).
  void reset() {
    if (counted_ && items_ > 0) {
      seen_items_ += items_;
      seen_batches_ += position_;
    }
    position_ = 0;
    items_ = 0;
  }

  /// The open window dropped unused (Trainer::discard_window): as after reset(), but its
  /// counts do not join the running mean.
  void discard() {
    position_ = 0;
    items_ = 0;
  }

  /// For checkpoints taken inside a window (PartialWindow::span).
  using State = detail::WindowState;
  State state() const { return {position_, items_, reference_, counted_, seen_items_, seen_batches_}; }
  void load_state(const State& s) {
    position_ = s.position;
    items_ = s.items;
    reference_ = s.reference;
    counted_ = s.counted;
    seen_items_ = s.seen_items;
    seen_batches_ = s.seen_batches;
  }
  /// Whether the open window's micro-batches gave item counts.
  bool counted() const { return counted_; }

  void save(torch::serialize::OutputArchive& archive) const { detail::save_window_state(archive, state()); }
  void load(torch::serialize::InputArchive& archive) { load_state(detail::load_window_state(archive)); }

 private:
  std::int64_t window_;
  std::int64_t position_ = 0;
  std::int64_t items_ = 0;
  double reference_ = 1.0;
  bool counted_ = false;
  std::int64_t seen_items_ = 0, seen_batches_ = 0;
};

template <class T>
struct is_accumulation_policy : std::false_type {};
template <int N>
struct is_accumulation_policy<AccumulationPolicy<N>> : std::true_type {};

}  // namespace trainkit

namespace trainkit::detail {

inline void save_window_state(torch::serialize::OutputArchive& archive, const WindowState& state) {
  write_value(archive, "window.position", state.position);
  write_value(archive, "window.items", state.items);
  write_value(archive, "window.reference", state.reference);
  write_value(archive, "window.counted", state.counted);
  write_value(archive, "window.seen_items", state.seen_items);
  write_value(archive, "window.seen_batches", state.seen_batches);
}

inline WindowState load_window_state(torch::serialize::InputArchive& archive) {
  WindowState s{};
  s.position = read_value(archive, "window.position").toInt();
  s.items = read_value(archive, "window.items").toInt();
  s.reference = read_value(archive, "window.reference").toDouble();
  s.counted = read_value(archive, "window.counted").toBool();
  c10::IValue seen;  // (absent from older checkpoints: the running mean starts again)
  if (archive.try_read("window.seen_items", seen)) s.seen_items = seen.toInt();
  if (archive.try_read("window.seen_batches", seen)) s.seen_batches = seen.toInt();
  return s;
}

}  // namespace trainkit::detail
