#pragma once
/// Memory: how much one forward+backward needs, what a budget allows, which errors mean
/// "out of memory", and the fit loop's use of them (detail::PieceRunner, below): micro-batches
/// run as pieces planned by TRAIN.MEMORY_BUDGET, and a window replayed in smaller pieces after
/// an out-of-memory error (fit.hpp, "Memory").
///
///   tk::PeakMemory peak(device);        // CUDA: the caching allocator's peak allocated bytes;
///   peak.reset(); run(); peak.bytes();  // CPU: the process's peak resident set (VmHWM)
///   tk::device_memory_bytes(device)     // what a budget's fraction is of
///   tk::memory_budget_bytes(0.8, dev)   // a fraction, or bytes
///   tk::plan_pieces(items, measured, budget)  // the largest piece of a micro-batch that fits
///
/// Planning (plan_pieces) is a pure function of its measurements, so it is tested without a
/// device: the peak of one forward+backward is taken to grow linearly with the piece's items
/// (activations), over a base (the model, its gradient and optimizer state, the runtime). The
/// line is fitted to the measured points by least squares; the plan is the largest piece whose
/// predicted peak, and every measured peak at or below its size, stays within the budget less a
/// margin (10%: the optimizer phase's temporaries, the allocator's fragmentation, batches with
/// more items than the measured one).
#include <trainkit/detail/inline.hpp>
#include <trainkit/trainer/any_trainer.hpp>
#include <trainkit/config/error.hpp>
#include <trainkit/detail/messages.hpp>
#include <trainkit/detail/out_of_memory.hpp>
#include <trainkit/detail/rng_state.hpp>
#include <trainkit/fit/metrics.hpp>
#include <trainkit/fit/task.hpp>

#include <c10/core/CachingDeviceAllocator.h>
#include <c10/util/Exception.h>
#include <torch/types.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <fstream>
#include <functional>
#include <new>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include <unistd.h>

namespace trainkit {

namespace detail {

// A "Name:   12345 kB" line of /proc/self/status, in bytes (-1 when absent).
double proc_status_bytes(const char* name);

/// "1 item", "8 items".
inline std::string items_text(std::int64_t n) { return std::to_string(n) + (n == 1 ? " item" : " items"); }

std::string mib_text(double bytes);

}  // namespace detail

/// The peak memory since reset() on one device. CUDA: the caching allocator's peak allocated
/// bytes (what tensors held; the CUDA context and the allocator's cache are not counted).
/// CPU: the whole process's peak resident set, VmHWM, which Linux resets through
/// /proc/self/clear_refs; available() is false where that file cannot be written.
class PeakMemory {
 public:
  explicit PeakMemory(torch::Device device) : device_(device) {}

  bool available() const;
  void reset() const;
  /// Bytes at the peak since reset().
  double bytes() const;

 private:
  c10::DeviceIndex index() const { return device_.has_index() ? device_.index() : 0; }
  torch::Device device_;
};

/// The memory of `device` that a budget's fraction is of: a GPU's total memory; on the CPU the
/// machine's physical memory, or the cgroup's limit (containers) when that is lower.
double device_memory_bytes(torch::Device device);

/// TRAIN.MEMORY_BUDGET to bytes: a value in (0, 1] is a fraction of device_memory_bytes, a
/// larger one is bytes. 0: no budget.
double memory_budget_bytes(double budget, torch::Device device);

/// The share of a memory budget that plans keep free.
inline constexpr double kMemoryMargin = 0.1;

/// A plan: the largest piece of a micro-batch (in items) whose forward+backward fits the budget.
struct MemoryPlan {
  double budget_bytes = 0;         ///< the budget
  double margin = kMemoryMargin;   ///< the share of the budget kept free
  std::vector<std::pair<std::int64_t, double>> measured;  ///< (items of a piece, peak bytes), ascending
  double base_bytes = 0;     ///< the fitted line: peak ~ base_bytes + bytes_per_item x items
  double bytes_per_item = 0;
  std::int64_t batch_items = 0;  ///< the measured micro-batch's items
  std::int64_t piece_items = 0;  ///< the largest piece that fits; batch_items: no split
  double seconds = 0;            ///< what measuring cost
  /// Whether the measurements hold the optimizer's state (false: a torch::optim optimizer's,
  /// made at its first step, after them; the plan's text says so).
  bool optimizer_state_counted = true;

  /// Pieces a micro-batch of `items` items is split into.
  std::int64_t pieces_for(std::int64_t items) const;
  /// The line the fit loop prints and logs.
  std::string text() const;
};

/// The plan from measurements of one forward+backward at several piece sizes (`measured`,
/// any order; at least one). Throws ConfigError(TRAIN.MEMORY_BUDGET) when not even one item
/// fits, naming the budget and the measured need.
MemoryPlan plan_pieces(std::int64_t batch_items, std::vector<std::pair<std::int64_t, double>> measured,
                       double budget_bytes, double margin = kMemoryMargin);

namespace detail {

/// The fit loop's micro-batches as pieces of at most piece_items() items (Task::split), the
/// memory plan that chooses that size (plan()), and the replay of a window in smaller pieces
/// after an out-of-memory error (replay()). Every piece has its own forward and backward; the
/// optimizer step is the whole micro-batch's (AnyTrainer::micro_step_pieces).
template <class Batch>
class PieceRunner {
 public:
  /// `loss(piece, weight)`: the piece's loss, its value counted with `weight` (the loop's sums).
  using Loss = std::function<torch::Tensor(const Batch&, double weight)>;
  using Say = std::function<void(const std::string&)>;

  /// `say`: what every rank does alike (the plan), said once; `say_local`: what this rank
  /// alone does (a replay), said by it.
  PieceRunner(AnyTrainer& trainer, const Task<Batch>& task, std::int64_t piece_items, Say say, Say say_local)
      : trainer_(trainer), task_(task), piece_items_(piece_items), say_(std::move(say)), say_local_(std::move(say_local)) {}

  /// The largest piece run at once (0: whole micro-batches).
  std::int64_t piece_items() const { return piece_items_; }
  /// Windows replayed so far.
  std::int64_t replays() const { return replays_; }
  /// Stand-in pieces this rank ran so far (ZeRO stage 3: step()).
  std::int64_t stand_ins() const { return stand_ins_; }

  /// TRAIN.MEMORY_BUDGET (`budget`: a fraction of the device's memory, or bytes): measures one
  /// forward+backward of micro-batch 0 of `epoch` whole and in pieces of 1, 1/8, 1/4 and 1/2 of
  /// its items, smallest first, stopping before a size the last two measurements predict over
  /// the budget (and after one that is over it), and plans the largest piece that fits with the
  /// margin. The optimizer's state is allocated first (AnyTrainer::allocate_optimizer_state);
  /// the model's buffers, the generators and the trainer's gradient are put back as they were.
  ///
  /// ZeRO stage 3 (the ranks measure in step): each measurement is a trial backward
  /// (AnyTrainer::trial_backward: the units gathered and reduce-scattered as in a step), the
  /// sizes come from the largest micro-batch 0 over the ranks, each point is the largest peak
  /// and item count over the ranks and the budget the smallest, so every rank makes the same
  /// decisions and the same plan. An out-of-memory error there ends the run (a step's gathers
  /// and reductions, once sent, cannot be taken back, even on one rank cut as several), saying
  /// so on that rank (the others stop at the process group's timeout or heartbeat).
  MemoryPlan plan(double budget_setting, std::int64_t epoch) {
    if (!task_.split)  // (fit() refuses a split without items)
      throw ConfigError("TRAIN.MEMORY_BUDGET", "planning the micro-batch needs a task that splits its batches "
                                               "(tk::Task::split and items); this task has no split. Set TRAIN.MEMORY_BUDGET: 0");
    const auto started = std::chrono::steady_clock::now();
    const torch::Device device = trainer_.device();
    const bool trial = trainer_.shards_parameters();  // (a forward outside the step would find the units released)
    PeakMemory peak(device);
    if (!peak.available())
      throw ConfigError("TRAIN.MEMORY_BUDGET", "the peak memory cannot be measured here (/proc/self/clear_refs is not "
                                               "writable); set TRAIN.MEMORY_BUDGET: 0");
    const Batch batch = task_.batch(epoch, 0);
    const std::int64_t own = task_.items(batch);  // (in step: another rank's may be larger)
    std::vector<double> agreed{static_cast<double>(own), -memory_budget_bytes(budget_setting, device)};
    if (in_step()) trainer_.replicas().all_reduce(agreed, Reduce::max);
    const auto total = static_cast<std::int64_t>(agreed[0]);
    const double budget = -agreed[1];
    TORCH_CHECK(total >= 1, "TRAIN.MEMORY_BUDGET: micro-batch 0 of epoch ", epoch, " has no items to measure");
    std::vector<std::int64_t> sizes{1};
    for (const std::int64_t parts : {8, 4, 2, 1}) sizes.push_back((total + parts - 1) / parts);
    sizes.erase(std::unique(sizes.begin(), sizes.end()), sizes.end());
    // What the measurement would change: the buffers (batch norm's statistics), the generators.
    std::vector<torch::Tensor> buffers;
    for (const auto& b : trainer_.model().buffers()) buffers.push_back(b.clone());
    // A fresh run's optimizer state (AdamW: 8 bytes per parameter) appears at its first step,
    // after this: allocated now, the peaks measured below hold it, as training's will.
    bool state_counted = true;
    try {
      state_counted = trainer_.allocate_optimizer_state();
    } catch (const std::exception& e) {
      if (!is_out_of_memory(e)) throw;
      throw ConfigError("TRAIN.MEMORY_BUDGET", "the optimizer's state does not fit on " + device.str() +
                                               " beside the model and its gradient, before any forward (no piece size "
                                               "can help; shard it with TRAIN.ZERO_STAGE across ranks): " + first_line_of(e));
    }
    const RngStates generators = RngStates::of(device);
    trainer_.model().train();
    std::vector<std::pair<std::int64_t, double>> measured;
    std::int64_t fails_from = total + 1;  // the smallest size that ran out of memory
    for (const std::int64_t size : sizes) {
      const Pieces pieces = split(batch, own, std::max<std::int64_t>(1, (own + size - 1) / size));
      const std::int64_t items = largest_over_ranks(pieces.items[pieces.largest]);
      if (!measured.empty() && items <= measured.back().first) continue;
      // Not a size the last two points say is over the budget: measuring it would take the
      // process (or the device) past the budget it was given.
      if (measured.size() >= 2) {
        const auto& [x0, y0] = measured[measured.size() - 2];
        const auto& [x1, y1] = measured.back();
        const double predicted = y1 + (y1 - y0) / static_cast<double>(x1 - x0) * static_cast<double>(items - x1);
        if (predicted > budget * (1 - kMemoryMargin)) break;
      }
      double bytes = 0;
      try {
        Metrics scratch;
        const auto loss = [&] {
          const auto l = task_.loss(pieces.batches[pieces.largest], scratch);
          return task_.terms.empty() ? l : l.sum();  // (terms: their sums)
        };
        peak.reset();
        if (trial) {
          trainer_.trial_backward(loss);
        } else {
          trainer_.allocate_gradient();  // (Sharding::gradients releases it between windows)
          torch::Tensor l;
          {
            const auto region = trainer_.precision_region();
            l = loss();
          }
          l.backward();
        }
        bytes = peak.bytes();
      } catch (const std::exception& e) {
        if (!is_out_of_memory(e)) throw;
        if (trial)
          throw ConfigError("TRAIN.MEMORY_BUDGET", "measuring a piece of " + items_text(items) + " ran out of memory on " +
                                                   device.str() + " (rank " + std::to_string(trainer_.replicas().rank()) +
                                                   "); with ZeRO stage 3 each measurement is a step's forward and "
                                                   "backward, whose gathers and reductions the other ranks make with it "
                                                   "and which cannot be taken back once sent, so it cannot go on past it: "
                                                   "set a smaller budget: " + first_line_of(e));
        fails_from = items;
      }
      trainer_.discard_window();  // the measurement's gradient
      if (fails_from <= items) break;
      bytes = largest_over_ranks(bytes);
      measured.emplace_back(items, bytes);
      if (bytes > budget * (1 - kMemoryMargin)) break;  // larger pieces need more
    }
    {
      torch::NoGradGuard no_grad;
      std::size_t i = 0;
      for (auto& b : trainer_.model().buffers()) b.copy_(buffers[i++]);
      generators.restore();
    }
    if (!device.is_cpu()) c10::getDeviceAllocator(device.type())->emptyCache();
    if (measured.empty())
      throw ConfigError("TRAIN.MEMORY_BUDGET", "one forward+backward of a single item ran out of memory on " + device.str() +
                                               " before the budget of " + mib_text(budget) + " was reached");
    MemoryPlan plan = plan_pieces(total, measured, budget);
    plan.piece_items = std::min(plan.piece_items, fails_from - 1);
    plan.optimizer_state_counted = state_counted;
    plan.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
    piece_items_ = plan.piece_items;
    planned_ = true;
    say_("trainkit: " + plan.text());
    return plan;
  }

  /// A resumed run goes on with the pieces its checkpoint's run ended with (`saved`; 0: whole
  /// micro-batches), unless a budget planned afresh or this run's are smaller already.
  void resume_with(std::int64_t saved) {
    if (planned_ || saved <= 0 || (piece_items_ != 0 && saved >= piece_items_)) return;
    piece_items_ = saved;
    say_("trainkit: micro-batches run as pieces of at most " + items_text(piece_items_) +
         ", as the checkpoint's run did (it ran out of memory with larger ones; TRAIN.MEMORY_BUDGET plans afresh)");
  }

  /// One micro-batch of `items` items (-1: no count) through the trainer: whole, or as pieces
  /// when it has more items than piece_items().
  ///
  /// ZeRO stage 3 (every piece's forward and backward gathers every unit on every rank): the
  /// ranks agree on the micro-batch's number of pieces, the largest any rank needs (one
  /// all-reduce of one value per micro-batch; on NCCL a host sync). A rank runs the pieces it
  /// would run alone, then, where another rank needs more, stand-ins for the rest: a piece of
  /// its micro-batch cut as finely as the others' (the one with the fewest items but one), its
  /// loss weighted 0 (no gradient, no count, no metric; the model's buffers put back after), so
  /// that its gathers and reductions line up with the others'.
  MicroStepResult step(const Batch& batch, std::int64_t items, const Loss& loss) {
    last_piece_items_ = items;
    const bool cuts = task_.split && piece_items_ > 0;
    const std::int64_t own = cuts && items > piece_items_ ? (items + piece_items_ - 1) / piece_items_ : 1;
    const std::int64_t parts = cuts ? largest_over_ranks(own) : own;
    if (parts > 1) return step_pieces(batch, items, own, parts, loss);
    const double weight = items >= 0 ? static_cast<double>(items) : 1.0;
    auto closure = [&] { return loss(batch, weight); };
    // (Loss terms: their counts were given to the window, Trainer::begin_window.)
    return items >= 0 && task_.terms.empty() ? trainer_.micro_step(closure, items) : trainer_.micro_step(closure);
  }


  /// A window opens at micro-batch `index` of `epoch`: where a replay begins, with the
  /// generators as they are now (host state: no device sync).
  void window_opens(std::int64_t epoch, std::int64_t index) {
    window_ = {true, epoch, index, RngStates::of(trainer_.device())};
  }

  /// Out of memory in micro-batch `index` (`e`): the open window is dropped and begins again at
  /// its first micro-batch with pieces half the size of the largest that failed, and with the
  /// generators put back as they were when it opened, so that the replay draws the same
  /// dropout masks wherever in the forward or backward the allocation failed. Returns that
  /// micro-batch (the loop puts its own sums back to the window's start). Throws, saying why,
  /// when the window cannot be replayed: no split, a window begun in an earlier epoch or
  /// before a resume, or pieces of one item.
  ///
  /// A gradient reduced at each micro-batch's end (AnyTrainer::reduces_each_micro_batch: stage
  /// 2 with several ranks) replays the failed micro-batch alone and returns `index`: the
  /// window's earlier micro-batches are summed on every rank already, and replaying them would
  /// send them again while the other ranks go on (their collectives would no longer line up).
  /// Each micro-batch's generators are then its position's (the loop seeds them by position
  /// with several ranks).
  std::int64_t replay(const std::exception& e, std::int64_t epoch, std::int64_t index, std::int64_t batches) {
    const std::string where = "out of memory at " + position_text(epoch, index, batches) + " (optimizer step " +
                              std::to_string(trainer_.windows() + 1) + ", " +
                              (last_piece_items_ >= 0 ? items_text(last_piece_items_) + " at once" : "no item count") +
                              "): " + first_line_of(e) + ". ";
    const std::string intact = "; the checkpoints written so far are intact";
    if (trainer_.shards_parameters())
      throw std::runtime_error(where + "With ZeRO stage 3 (TRAIN.ZERO_STAGE: 3) every forward and backward gathers "
                               "the units' parameters on every rank in step, so this rank cannot replay its "
                               "micro-batch alone; resume with smaller pieces (TRAIN.PIECE_ITEMS, or a plan: "
                               "TRAIN.MEMORY_BUDGET), a smaller micro-batch (TRAIN.BATCH_IMAGES) or more ranks" +
                               intact);
    if (!task_.split)
      throw std::runtime_error(where + "Give the task a split function (tk::Task::split, with items) so that trainkit "
                               "replays the window in smaller pieces, or plan them with TRAIN.MEMORY_BUDGET" + intact);
    const bool alone = trainer_.reduces_each_micro_batch();  // the failed micro-batch only
    if (!alone && (!window_.open || window_.epoch != epoch))
      throw std::runtime_error(where + "The window began " +
                               (window_.open ? "in epoch " + std::to_string(window_.epoch) : std::string("before this run resumed")) +
                               ", so it cannot be replayed; resume with a smaller micro-batch or TRAIN.MEMORY_BUDGET" + intact);
    if (last_piece_items_ <= 1)
      throw std::runtime_error(where + "Pieces of one item do not fit: recompute activations (tk::recompute), train "
                               "in half precision, or use a smaller model" + intact);
    if (alone) {
      trainer_.discard_micro_batch();  // (throws where its backward had sent buckets)
    } else {
      trainer_.discard_window();
      window_.generators.restore();
    }
    if (!trainer_.device().is_cpu()) c10::getDeviceAllocator(trainer_.device().type())->emptyCache();
    piece_items_ = std::max<std::int64_t>(1, last_piece_items_ / 2);
    ++replays_;
    const std::string replayed =
        alone ? "The micro-batch is replayed alone (the window's earlier micro-batches are summed on every rank already: "
                "TRAIN.ZERO_STAGE 2)"
              : "The window's partial gradient is dropped and the window replayed from micro-batch " + std::to_string(window_.index);
    say_local_("trainkit: " + where + replayed + " in pieces of at most " + items_text(piece_items_) +
               "; the run goes on at that size, and the optimizer step is the window's as before");
    return alone ? index : window_.index;
  }

 private:
  // Whether the ranks cut micro-batches and measure in step: ZeRO stage 3 with several ranks.
  bool in_step() const { return trainer_.shards_parameters() && trainer_.replicas().world_size() > 1; }
  // The largest `value` over the ranks (in_step(): every rank calls it alike), else `value`.
  template <class T>
  T largest_over_ranks(T value) {
    if (!in_step()) return value;
    std::vector<double> v{static_cast<double>(value)};
    trainer_.replicas().all_reduce(v, Reduce::max);
    return static_cast<T>(v[0]);
  }

  // step() in `parts` pieces: this rank's own (`own`, whole for 1: what it runs alone), then,
  // in step with ranks that cut more, stand-ins for the rest. A stand-in runs the piece with the
  // fewest items but one of the micro-batch cut into `parts` (the first where none has items).
  MicroStepResult step_pieces(const Batch& batch, std::int64_t items, std::int64_t own, std::int64_t parts,
                              const Loss& loss) {
    const Pieces pieces = own > 1 ? split(batch, items, own) : Pieces{{batch}, {items}, 0};
    last_piece_items_ = pieces.items[pieces.largest];
    const auto real = static_cast<std::int64_t>(pieces.batches.size());
    TORCH_CHECK(real <= parts, "fit: task.split(a micro-batch, ", own, ") returned ", real, " pieces, more than the ",
                parts, " every rank runs (ZeRO stage 3)");
    std::vector<std::int64_t> counts = pieces.items;
    counts.resize(static_cast<std::size_t>(parts), 0);  // (stand-ins: no items)
    std::vector<Batch> finer;
    const Batch* stand_in = &batch;  // (a split that gives no piece: the micro-batch)
    if (real < parts) {
      finer = task_.split(batch, parts);
      std::int64_t fewest = -1;  // the stand-in's items
      for (const auto& piece : finer)
        if (const auto n = task_.items(piece); fewest < 0 || (n > 0 && (fewest == 0 || n < fewest))) {
          stand_in = &piece;
          fewest = n;
        }
      if (stand_ins_ == 0)
        say_local_("trainkit: rank " + std::to_string(trainer_.replicas().rank()) + " runs " +
                   std::to_string(parts - real) + " of a micro-batch's " + std::to_string(parts) +
                   " pieces as stand-ins (its " + items_text(items) + " make " + std::to_string(real) +
                   " piece(s) of at most " + items_text(piece_items_) + ", another rank's more; ZeRO stage 3 runs as "
                   "many pieces on every rank): each runs a piece again with its loss weighted 0");
      stand_ins_ += parts - real;
    }
    // The model's buffers as the first stand-in found them, put back after the micro-step.
    struct Buffers {
      torch::nn::Module& model;
      std::vector<torch::Tensor> kept;
      bool keeping = false;
      void keep() {
        if (keeping) return;
        for (const auto& b : model.buffers()) kept.push_back(b.clone());
        keeping = true;
      }
      ~Buffers() {
        torch::NoGradGuard no_grad;
        std::size_t i = 0;
        if (keeping)
          for (auto& b : model.buffers()) b.copy_(kept[i++]);
      }
    } buffers{trainer_.model(), {}, false};
    return trainer_.micro_step_pieces(
        [&](std::int64_t j) {
          const auto k = static_cast<std::size_t>(j);
          if (j < real) return loss(pieces.batches[k], static_cast<double>(counts[k]));
          buffers.keep();
          Metrics scratch;
          return task_.loss(*stand_in, scratch) * 0.0;
        },
        counts);
  }


  // `parts` pieces of a micro-batch of `items` items (task.split), with their item counts, and
  // the index of the largest; an error when the pieces do not hold the micro-batch's items.
  struct Pieces {
    std::vector<Batch> batches;
    std::vector<std::int64_t> items;
    std::size_t largest = 0;
  };
  Pieces split(const Batch& batch, std::int64_t items, std::int64_t parts) const {
    Pieces p;
    p.batches = parts == 1 ? std::vector<Batch>{batch} : task_.split(batch, parts);
    std::int64_t sum = 0;
    for (const auto& piece : p.batches) {
      p.items.push_back(task_.items(piece));
      sum += p.items.back();
    }
    if (p.batches.empty() || sum != items)
      throw std::runtime_error("fit: task.split(a micro-batch of " + std::to_string(items) + " items, " +
                               std::to_string(parts) + ") returned " + std::to_string(p.batches.size()) + " pieces of " +
                               std::to_string(sum) + " items in all; the pieces must hold the micro-batch's items");
    p.largest = static_cast<std::size_t>(std::max_element(p.items.begin(), p.items.end()) - p.items.begin());
    return p;
  }

  AnyTrainer& trainer_;
  const Task<Batch>& task_;
  std::int64_t piece_items_ = 0;
  Say say_, say_local_;
  bool planned_ = false;
  std::int64_t last_piece_items_ = -1;  // the items of the last micro-step's largest piece
  std::int64_t replays_ = 0;
  std::int64_t stand_ins_ = 0;
  struct OpenWindow {
    bool open = false;
    std::int64_t epoch = 0, index = 0;
    RngStates generators;
  } window_;
};

}  // namespace detail

}  // namespace trainkit

#ifndef TRAINKIT_COMPILED_LIB
#include <trainkit/fit/memory-inl.hpp>
#endif
