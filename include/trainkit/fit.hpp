#pragma once
/// The fit loop: epochs over a Task, with validation, checkpoints, resume, logs and graceful
/// stops. The shape is agreed in notes/fit_api.md.
///
///   tk::Task<Batch> task;
///   task.batches_per_epoch = [&](std::int64_t epoch) { return loader_length; };
///   task.batch = [&](std::int64_t epoch, std::int64_t index) { return make_batch(seed, epoch, index); };
///   task.loss = [&](const Batch& b, tk::Metrics& metrics) { return loss_of(model, b); };
///   auto options = tk::RunPlan::from(config).fit;  // OUTPUT_PATH, LOG_FREQUENT, END_EPOCH...
///   tk::FitResult r = tk::fit(trainer, task, options);
///   return 0;                                      // also after a SIGTERM: r.stopped
///
/// What one call does, in order:
///   1. Resume: TRAIN.RESUME loads <prefix>-<BEGIN_EPOCH-1>.ckpt (with BEGIN_EPOCH 0: the newest
///      checkpoint), and it is an error when there is none; TRAIN.AUTO_RESUME loads the newest
///      complete checkpoint if there is one (a damaged newest one is reported, the previous one
///      used). Training continues at the exact micro-batch the checkpoint was written before.
///   2. Epochs [BEGIN_EPOCH or the resumed one, END_EPOCH): micro-batch `index` of epoch `e` is
///      task.batch(e, index): the data sampler's state is (e, index), so resuming is exact. Each
///      goes through trainer.micro_step (with task.items when given); trainer.flush() at the end
///      of the epoch. The loss and the task's metrics are averaged over the epoch, weighted by
///      items (or micro-batches), on the device.
///   3. Every LOG_FREQUENT optimizer windows: read that window's StepReport (the only host sync
///      of the loop besides the epoch end) and log Train-Loss (the mean since the last log),
///      Train-<metric>, LR/Group_<i>, grad-para/Total-Norm, loss-scale, skipped-steps,
///      samples-per-second (log/scalars.hpp's tags; step = optimizer windows, applied + skipped)
///      to <OUTPUT_PATH>/tensorboard/ (TensorBoard events) and <OUTPUT_PATH>/<prefix>-scalars.jsonl,
///      and Initial-LR/Group_<i>, and write a line to the run's text log (<OUTPUT_PATH>/<prefix>-log.txt,
///      log/text_log.hpp, which also has the run's start, resume, validations, checkpoints,
///      warnings and end). The progress line (log/progress.hpp) on stderr follows every window
///      on a terminal (bar, elapsed, the whole run's ETA), else prints at log windows. A run that resumes at
///      optimizer step S drops the JSON lines past S (what the stopped run logged after its
///      checkpoint; said once) and opens its TensorBoard file with a session start at S + 1, which
///      hides those points in TensorBoard: each (step, tag) is in the logs once.
///   4. End of an epoch: validation every VAL_FREQUENT epochs (and after the last), Val-<metric>
///      logged, the plateau schedule told, the epoch_end callback, a checkpoint every
///      CHECKPOINT_FREQUENT epochs (and after the last, at a new best, on request). A callback
///      that finishes the run (EpochEnd::request_finish, e.g. EarlyStopping in callbacks.hpp)
///      gets a checkpoint marked finished: fit returns with FitResult::finished, and a run of the
///      same command in that directory trains no further (it says why).
///   Callbacks' own state (Callbacks::state) goes into every checkpoint and comes back on resume.
///   With FitOptions::workers (NUM_WORKERS_PER_GPU) > 0, the next micro-batches of the epoch are
///   made on that many threads while the step runs (task.batch must then be thread-safe and
///   draw no numbers from torch's global generator: it is a pure function of its position).
///   5. SIGINT/SIGTERM: the loop finishes the current window, writes a checkpoint and returns
///      with FitResult::stopped, printing how to resume; a second signal exits at once.
///
/// Data parallel (trainer.set_replicas, distributed.hpp): every rank runs fit() on its shard
/// (task.batch(epoch, index) gives this rank's micro-batch, e.g. from tk::DistributedSampler);
/// only the main rank writes checkpoints, logs and messages; every rank resumes from the same
/// file; logged and epoch means are over every rank's items, validation metrics the mean over
/// ranks; a stop (a signal or a callback's request on any rank) is agreed at the next log window
/// (every LOG_FREQUENT optimizer steps) or epoch end, inside the collective that logging does
/// anyway: no window pays a collective or a host sync for it. With more than one rank, the RNG
/// (CPU, and the trainer's GPU) is seeded before each micro-batch from (seed, rank, epoch, index): dropout masks and
/// anything task.batch draws are a pure function of the position on every rank, so a resume is
/// exact on every rank (a checkpoint holds one rank's generator state, the main rank's).
///
/// Memory (memory.hpp), for a task with split and items:
///   - TRAIN.MEMORY_BUDGET (FitOptions::memory_budget): before training (and before resuming),
///     one forward+backward of micro-batch 0 of BEGIN_EPOCH is measured whole and in pieces of
///     1, 1/8, 1/4 and 1/2 of its items, smallest first, stopping before a size the last two
///     measurements predict over the budget (and after one that is over it); the largest
///     piece that fits with a 10% margin is planned (tk::plan_pieces), printed and logged, and
///     every micro-batch with more items runs as pieces of at most that size
///     (AnyTrainer::micro_step_pieces: the optimizer step is the whole micro-batch's, so the
///     effective batch and the trajectory are those of the configuration, up to rounding). The
///     measurement leaves the model, its buffers, the trainer and the generators as they were.
///     A budget that cannot hold one item is a ConfigError naming the budget and the need.
///   - Out of memory in a micro-batch's forward or backward (c10::OutOfMemoryError, the CPU
///     allocator's error): the open window's partial gradient and its metrics are dropped, the
///     piece size halved (FitResult::piece_items), and the window replayed from its first
///     micro-batch; the window's optimizer step is then what it would have been. Said once per
///     replay. The smaller size stays for the rest of the run and goes into checkpoints (a
///     resume without a budget keeps it, said). Out of memory with pieces of one item, in a
///     window begun in an earlier epoch or before a resume, or in the optimizer phase, stops the
///     run with an error; the checkpoints written so far are intact. batch_end callbacks see the
///     replayed micro-batches again. Data parallel: only the rank that ran out replays; the
///     others wait for it at the window's all-reduce.
///   Without task.split an out-of-memory error stops the run, naming the micro-batch.
///
/// Errors: a checkpoint that cannot be written (unwritable directory, full disk) throws
/// CheckpointError naming the file and the step; the checkpoints already written stay intact.
/// A non-finite gradient with NONFINITE abort throws NonFiniteGradient with the epoch, the
/// micro-batch, the optimizer step and the loss value.
#include <trainkit/checkpoint.hpp>
#include <trainkit/config/error.hpp>
#include <trainkit/config/resume_changes.hpp>
#include <trainkit/detail/rng_state.hpp>
#include <trainkit/detail/stop_signals.hpp>
#include <trainkit/log/progress.hpp>
#include <trainkit/log/scalars.hpp>
#include <trainkit/log/tensorboard.hpp>
#include <trainkit/log/text_log.hpp>
#include <trainkit/any_trainer.hpp>
#include <trainkit/memory.hpp>
#include <trainkit/metrics.hpp>
#include <trainkit/optim.hpp>
#include <trainkit/fit_options.hpp>

#include <torch/arg.h>
#include <torch/types.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <deque>
#include <functional>
#include <future>
#include <iostream>
#include <limits>
#include <map>
#include <memory>
#include <optional>
#include <random>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include <unistd.h>

namespace trainkit {

/// The application's task. Data are addressed by (epoch, index): the batch for a position must
/// be a pure function of the seed, the epoch and the index (shuffle with a generator seeded from
/// them), so that the data sampler's state is just (epoch, index) and resuming is exact.
template <class Batch>
struct Task {
  /// Micro-batches in `epoch` (on this rank).
  std::function<std::int64_t(std::int64_t epoch)> batches_per_epoch;
  /// Micro-batch `index` of `epoch`. With FitOptions::workers > 0 it runs on worker threads,
  /// several at once, ahead of the step: it must be thread-safe and use its own generator.
  std::function<Batch(std::int64_t epoch, std::int64_t index)> batch;
  /// Forward: the loss as a scalar tensor. May record more scalars, averaged over the epoch by
  /// the loop: metrics.add("MLM-Acc", accuracy, count). Runs inside the precision region.
  std::function<torch::Tensor(const Batch&, Metrics& metrics)> loss;
  /// Optional: the micro-batch's item count (samples, tokens): the window's gradient and the
  /// logged means are then weighted by items (Trainer::micro_step with items).
  std::function<std::int64_t(const Batch&)> items;
  /// Optional (needs items): `parts` pieces of a micro-batch, together holding its items, each
  /// a Batch that loss() takes; loss() must be the mean over a batch's items, so that the
  /// items-weighted mean of the pieces' losses is the batch's. With it, the loop runs
  /// micro-batches that do not fit in memory as pieces (FitOptions::memory_budget,
  /// piece_items) and replays a window after an out-of-memory error ("Memory" above).
  std::function<std::vector<Batch>(const Batch&, std::int64_t parts)> split;
  /// Optional: validation after an epoch; the metrics are logged as Val-<name>.
  std::function<std::map<std::string, double>(std::int64_t epoch)> validate;
  /// Optional: the validation metric that ranks checkpoints (the best is kept) and drives the
  /// plateau schedule.
  std::string best_metric;
  bool higher_is_better = true;
};

/// After each micro-batch. A callback may ask for a checkpoint (written at the next window
/// boundary) or a stop (a checkpoint, then fit returns).
struct BatchEnd {
  std::int64_t epoch = 0, index = 0, batches = 0;  ///< micro-batch `index` of `batches` just ran
  const MicroStepResult* step = nullptr;           ///< its result (a report when a window closed)
  bool request_checkpoint = false;
  bool request_stop = false;
};
/// After each epoch (after validation, before its checkpoint).
struct EpochEnd {
  std::int64_t epoch = 0;
  std::map<std::string, double> train;       ///< the epoch's means: "Loss" and the task's metrics
  std::map<std::string, double> validation;  ///< empty when this epoch did not validate
  bool request_checkpoint = false;
  bool request_stop = false;   ///< stop now, continue when run again (as a signal does)
  /// Training is done (early stopping): the checkpoint is marked finished, and a run of the
  /// same command in this directory trains no further. finish_reason says why (it is printed).
  bool request_finish = false;
  std::string finish_reason;
};
struct Callbacks {
  std::function<void(BatchEnd&)> batch_end;
  std::function<void(EpochEnd&)> epoch_end;
  /// Every scalar the loop logs, as it logs it (besides the files): tag, value, step.
  std::function<void(const std::string& tag, double value, std::int64_t step)> scalar;
  std::vector<CallbackState> state;
};

/// What fit() did.
struct FitResult {
  FitPosition position;                        ///< where training would continue
  std::int64_t windows = 0;                    ///< optimizer phases so far (applied + skipped)
  std::int64_t applied_steps = 0, skipped_steps = 0;
  std::map<std::string, double> train;         ///< the last completed epoch's means
  std::map<std::string, double> validation;    ///< the last validation
  std::vector<std::string> checkpoints;        ///< written by this call, in order
  std::string resumed_from;                    ///< the checkpoint loaded ("" = none)
  std::string best_checkpoint;                 ///< "" when no best metric
  bool stopped = false;                        ///< by a signal or a callback, before END_EPOCH
  bool finished = false;                       ///< a callback ended training (EpochEnd::request_finish), now or in the run resumed
  int signal = 0;                              ///< the signal that stopped it (0: none)
  std::string message;                         ///< the stop message (how to resume), or why nothing was trained
  std::optional<MemoryPlan> plan;              ///< the memory plan (FitOptions::memory_budget)
  std::int64_t piece_items = 0;                ///< the largest piece run at the end (0: whole micro-batches)
  std::int64_t replays = 0;                    ///< windows replayed after running out of memory
};

namespace detail {

inline std::string position_text(std::int64_t epoch, std::int64_t index, std::int64_t batches) {
  return "epoch " + std::to_string(epoch) + ", micro-batch " + std::to_string(index) + " of " + std::to_string(batches);
}

inline std::string short_number(double v) {
  if (std::isnan(v)) return "nan";  // not "-nan"
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.6g", v);
  return buf;
}

/// Micro-batches made ahead on worker threads (FitOptions::workers): while the step runs, up to
/// `workers` of the epoch's next positions are being made. next(epoch, index) returns that
/// position's batch, made on this thread when it was not ahead (an epoch's first, a resume's);
/// an exception of task.batch surfaces there, for its own position. Batches in flight when the
/// loop ends are waited for and dropped.
template <class Batch>
class Prefetcher {
 public:
  using Make = std::function<Batch(std::int64_t, std::int64_t)>;
  Prefetcher(const Make& make, std::int64_t workers) : make_(make), workers_(static_cast<std::size_t>(workers)) {}
  Prefetcher(const Prefetcher&) = delete;
  Prefetcher& operator=(const Prefetcher&) = delete;
  ~Prefetcher() { drop(); }

  Batch next(std::int64_t epoch, std::int64_t index, std::int64_t batches) {
    if (workers_ == 0) return make_(epoch, index);
    if (!ahead_.empty() && (ahead_.front().epoch != epoch || ahead_.front().index != index)) drop();
    if (ahead_.empty()) {
      top_up(epoch, index + 1, batches);
      return make_(epoch, index);
    }
    std::future<Batch> batch = std::move(ahead_.front().batch);
    ahead_.pop_front();
    top_up(epoch, index + 1, batches);
    return batch.get();
  }

 private:
  struct Ahead {
    std::int64_t epoch, index;
    std::future<Batch> batch;
  };
  void top_up(std::int64_t epoch, std::int64_t from, std::int64_t batches) {
    std::int64_t index = ahead_.empty() ? from : ahead_.back().index + 1;
    for (; ahead_.size() < workers_ && index < batches; ++index)
      ahead_.push_back({epoch, index, std::async(std::launch::async, [this, epoch, index] { return make_(epoch, index); })});
  }
  void drop() {
    for (auto& a : ahead_) a.batch.wait();  // their errors are not this position's
    ahead_.clear();
  }
  const Make& make_;
  std::size_t workers_;
  std::deque<Ahead> ahead_;
};

/// One run of the loop; fit() below builds it and calls run(). Compiled once per Batch type,
/// whatever the trainer's configuration (it sees the trainer as AnyTrainer).
template <class Batch>
class FitLoop {
 public:
  FitLoop(AnyTrainer& trainer, Task<Batch>& task, const FitOptions& options, Callbacks callbacks)
      : trainer_(trainer),
        task_(task),
        options_(options),
        callbacks_(std::move(callbacks)),
        checkpoints_(options.output_path(), options.prefix(), options.checkpoint_keep()) {}

  FitResult run() {
    StopSignals signals(options_.handle_signals());
    if (writes()) {
      checkpoints_.create_directory();
      lock_ = std::make_unique<DirectoryLock>(options_.output_path());  // one job per directory
      if (options_.text_log())
        text_log_ = std::make_unique<TextLog>(options_.output_path() + "/" + options_.prefix() + "-log.txt");
      if (options_.progress()) {
        ProgressOptions p;
        p.every_steps = options_.log_frequent();
        progress_ = std::make_unique<ProgressLine>(p);
      }
    }
    piece_items_ = options_.piece_items();
    if (options_.memory_budget() > 0) plan_memory();  // before resuming: it leaves no trace
    state_.seed = options_.seed();
    state_.best_metric = task_.best_metric;
    state_.higher_is_better = task_.higher_is_better;
    if (options_.seed_drawn())
      say("trainkit: RNG_SEED is -1: this run uses seed " + std::to_string(options_.seed()) +
          (trainer_.replicas().world_size() > 1 ? " on all " + std::to_string(trainer_.replicas().world_size()) + " ranks" : "") +
          " (set RNG_SEED: " + std::to_string(options_.seed()) + " to repeat it)");
    if (text_log_)
      text_log_->line("start: " + trainer_.type_name() + " on " + trainer_.device().str() +
                      (trainer_.replicas().world_size() > 1 ? " x " + std::to_string(trainer_.replicas().world_size()) + " ranks" : "") +
                      ", epochs until " + std::to_string(options_.end_epoch()) + ", seed " + std::to_string(options_.seed()) +
                      ", pid " + std::to_string(::getpid()));
    const FitPosition start = resume();
    if (!finished_.empty()) {  // a callback ended the run (early stopping): nothing more to do
      result_.finished = true;
      result_.message = "trainkit: nothing to train: the run in '" + options_.output_path() + "' finished at epoch " +
                        std::to_string(start.epoch) + " (" + finished_ + "; '" + result_.resumed_from +
                        "' is marked finished); start afresh in another directory (--model-dir)";
      say(result_.message);
      return finish();
    }
    if (!result_.resumed_from.empty() && start.epoch >= options_.end_epoch()) {  // a finished job run again
      result_.message = "trainkit: nothing to train: '" + result_.resumed_from + "' is at epoch " +
                        std::to_string(start.epoch) + " and TRAIN.END_EPOCH is " + std::to_string(options_.end_epoch()) +
                        "; raise TRAIN.END_EPOCH to train on, or start afresh in another directory (--model-dir)";
      say(result_.message);
    }
    if (writes()) open_logs();
    skipped_at_log_ = trainer_.skipped_steps().item<std::int64_t>();  // once per run
    window_at_log_ = trainer_.windows();
    state_.config_json = options_.config_json();
    clock_ = Clock::now();
    const std::int64_t n = trainer_.window_length();  // the run's optimizer windows, for the progress line's ETA
    for (std::int64_t epoch = start.epoch; epoch < options_.end_epoch(); ++epoch)
      run_total_ += (task_.batches_per_epoch(epoch) + n - 1) / n - (epoch == start.epoch ? start.index / n : 0);
    Prefetcher<Batch> prefetch(task_.batch, options_.workers());

    for (std::int64_t epoch = start.epoch; epoch < options_.end_epoch(); ++epoch) {
      const std::int64_t batches = task_.batches_per_epoch(epoch);
      TORCH_CHECK(batches >= 1, "fit: task.batches_per_epoch(", epoch, ") must be >= 1, got ", batches);
      const std::int64_t first = epoch == start.epoch ? start.index : 0;
      if (first == 0) {  // a resumed epoch keeps its running sums (they are in the checkpoint)
        metrics_.reset();
        logged_ = {};
      }
      samples_in_epoch_ = 0;
      if (progress_) progress_->update(progress_state(epoch, first, batches));
      trainer_.model().train();
      bool checkpoint_requested = false, stop_requested = false;
      for (std::int64_t index = first; index < batches; ++index) {
        if (task_.split && trainer_.window_position() == 0) open_window(epoch, index);
        if (trainer_.replicas().world_size() > 1)  // every rank's RNG resumes exactly (below)
          detail::seed_rng_states(detail::mix_seed({static_cast<std::uint64_t>(options_.seed()),
                                                    static_cast<std::uint64_t>(trainer_.replicas().rank()),
                                                    static_cast<std::uint64_t>(epoch), static_cast<std::uint64_t>(index)}),
                                  trainer_.device());
        const Batch batch = prefetch.next(epoch, index, batches);
        MicroStepResult r;
        try {
          r = micro_step(batch, epoch, index, batches);
        } catch (const std::exception& e) {
          if (!detail::is_out_of_memory(e)) throw;
          index = replay_window(e, epoch, index, batches) - 1;  // throws when it cannot
          continue;
        }
        stop_requested |= signals.received() != 0;
        Requests agreed;  // data parallel: what every rank does at this window
        if (r.window_closed) agreed = window_closed(r.report, epoch, index + 1, batches, {stop_requested, checkpoint_requested});
        if (callbacks_.batch_end) {
          BatchEnd info{epoch, index, batches, &r};
          callbacks_.batch_end(info);
          checkpoint_requested |= info.request_checkpoint;
          stop_requested |= info.request_stop;
        }
        stop_requested |= signals.received() != 0;
        // Checkpoints inside an epoch fall on window boundaries: the signal's "finish the
        // current window" is this condition becoming true. Ranks must stop and checkpoint at the
        // same window: they agree at log windows, in the collective that logging does anyway
        // (no sync of its own), so a data-parallel stop or checkpoint waits for the next log
        // window (where the checkpoint's running sums are every rank's: write_checkpoint).
        const bool at_boundary = trainer_.window_position() == 0 && index + 1 < batches;
        const bool single = trainer_.replicas().world_size() == 1;
        const bool stop_now = single ? stop_requested : agreed.stop;
        const bool checkpoint_now = single ? checkpoint_requested : agreed.checkpoint;
        if ((checkpoint_now || stop_now) && at_boundary) {
          state_.position = {epoch, index + 1};
          write_checkpoint(/*epoch_end*/ false);
          checkpoint_requested = false;
          if (stop_now) return stop(signals.received());
        }
      }
      if (auto report = flush(epoch, batches)) window_closed(*report, epoch, batches, batches);
      if (progress_) progress_->update(progress_state(epoch, batches, batches));  // the epoch's line ends complete
      stop_requested = stop_requested || signals.received() != 0;
      any_rank(stop_requested);
      if (stop_requested) {  // every micro-batch ran; the epoch's end runs after resuming
        state_.position = {epoch, batches};
        if (trainer_.replicas().world_size() > 1) {  // the sums over every rank (write_checkpoint)
          logged_ = metrics_.totals();
          total_over_ranks(logged_);
        }
        write_checkpoint(false);
        return stop(signals.received());
      }

      // End of the epoch: means, validation, best checkpoint, schedule, callback, checkpoint.
      EpochEnd end;
      end.epoch = epoch;
      end.train = epoch_means();
      result_.train = end.train;
      const bool last = epoch + 1 == options_.end_epoch();
      bool new_best = false;
      if (task_.validate && ((epoch + 1) % options_.val_frequent() == 0 || last)) {
        end.validation = task_.validate(epoch);
        average_over_ranks(end.validation);  // the schedule and the best must agree on every rank
        trainer_.model().train();
        result_.validation = end.validation;
        std::string shown = "epoch " + std::to_string(epoch) + " validation:";
        for (const auto& [name, value] : end.validation) {
          log_scalar(scalar_tags::validation(name), value, trainer_.windows());
          shown += " " + name + " " + short_number(value);
        }
        report(shown);
        new_best = observe_best(epoch, end.validation);
      }
      if (callbacks_.epoch_end) callbacks_.epoch_end(end);
      stop_requested = stop_requested || end.request_stop || signals.received() != 0;
      bool finish_requested = end.request_finish;
      any_rank(stop_requested, finish_requested);  // one collective for both
      state_.position = {epoch + 1, 0};
      if (finish_requested) {  // data parallel: any rank's request, the main rank's reason
        finished_ = end.finish_reason.empty() ? "a callback finished training" : end.finish_reason;
        write_checkpoint(/*epoch_end*/ true);
        result_.finished = true;
        result_.message = "trainkit: finished after epoch " + std::to_string(epoch) + ": " + finished_ +
                          "; the checkpoint is marked finished, so running this again trains no further";
        say(result_.message);
        return finish();
      }
      if ((epoch + 1) % options_.checkpoint_frequent() == 0 || last || new_best || end.request_checkpoint ||
          checkpoint_requested || stop_requested)
        write_checkpoint(/*epoch_end*/ true);
      if (stop_requested && !last) return stop(signals.received());
      clock_ = Clock::now();  // validation and checkpoints are not training time
      samples_since_log_ = 0;
    }
    return finish();
  }

 private:
  using Clock = std::chrono::steady_clock;

  // Checkpoints, logs and messages: on the main rank only (every rank trains and resumes).
  bool writes() const { return options_.write_files() && trainer_.replicas().is_main(); }

  // Data parallel (replicas.hpp): what every rank must agree on goes through one small
  // collective, called by every rank at the same point; with one process these are no-ops.
  // Each flag set on every rank when it is set on any: one collective for all of them.
  template <class... Flags>
  void any_rank(Flags&... flags) {
    if (trainer_.replicas().world_size() == 1) return;
    std::vector<double> v{(flags ? 1.0 : 0.0)...};
    trainer_.replicas().average(v);
    std::size_t i = 0;
    ((flags = v[i++] > 0), ...);
  }
  void average_over_ranks(std::map<std::string, double>& values) {
    if (trainer_.replicas().world_size() == 1) return;
    std::vector<double> v;
    for (const auto& [name, x] : values) v.push_back(x);
    trainer_.replicas().average(v);
    std::size_t i = 0;
    for (auto& [name, x] : values) x = v[i++];
  }
  // Stop and checkpoint requests: this rank's, or (returned by total_over_ranks) any rank's.
  struct Requests {
    bool stop = false, checkpoint = false;
  };
  // Sums and weights averaged alike: their ratio is then the mean over every rank's items.
  // (Every rank's task must add the same metric names.) The requests ride along: returns
  // whether any rank made each.
  Requests total_over_ranks(Metrics::Totals& totals, Requests requests = {}) {
    if (trainer_.replicas().world_size() == 1) return requests;
    std::vector<double> v;
    for (const auto& [name, sw] : totals.of) v.insert(v.end(), {sw.first, sw.second});
    v.insert(v.end(), {requests.stop ? 1.0 : 0.0, requests.checkpoint ? 1.0 : 0.0});
    trainer_.replicas().average(v);
    std::size_t i = 0;
    for (auto& [name, sw] : totals.of) sw = {v[i], v[i + 1]}, i += 2;
    return {v[i] > 0, v[i + 1] > 0};
  }
  std::map<std::string, double> epoch_means() {
    Metrics::Totals totals = metrics_.totals();
    total_over_ranks(totals);
    std::map<std::string, double> means;
    for (const auto& [name, sw] : totals.of) means[name] = totals.mean(name);
    return means;
  }

  // 1. Resume, by TRAIN.RESUME / AUTO_RESUME. Returns where training starts. The checkpoint's
  // configuration is checked before anything is loaded.
  FitPosition resume() {
    const FitPosition begin{options_.begin_epoch(), 0};
    if (!options_.resume() && !options_.auto_resume()) return begin;
    std::optional<CheckpointManager::Opened> opened;
    if (options_.resume() && options_.begin_epoch() > 0) {
      opened = checkpoints_.open(checkpoints_.epoch_path(options_.begin_epoch() - 1));
    } else {
      opened = checkpoints_.open_newest();
      if (!opened && options_.resume())
        throw std::runtime_error("TRAIN.RESUME: no complete checkpoint '" + options_.prefix() + "-*.ckpt' in '" +
                                 options_.output_path() + "' to resume from");
    }
    if (!opened) return begin;
    const LoopState& saved = opened->state;
    check_resume_changes(saved.config_json);  // before anything changes
    for (const auto& name : checkpoints_.restore(*opened, trainer_, callbacks_.state))
      say("trainkit: the checkpoint has no state for the callback '" + name + "' (written without it): it starts afresh");
    finished_ = saved.finished;
    // The piece size the checkpoint's run ended with (0: whole micro-batches).
    if (!planned_ && saved.piece_items > 0 && (piece_items_ == 0 || saved.piece_items < piece_items_)) {
      piece_items_ = saved.piece_items;
      say("trainkit: micro-batches run as pieces of at most " + detail::items_text(piece_items_) +
          ", as the checkpoint's run did (it ran out of memory with larger ones; TRAIN.MEMORY_BUDGET plans afresh)");
    }
    metrics_ = saved.metrics;
    logged_ = saved.logged;
    if (saved.seed != options_.seed())
      std::cerr << "trainkit: warning: '" << opened->path << "' was written by a run with RNG_SEED " << saved.seed
                << ", this run has " << options_.seed() << "; data drawn from the seed will differ from the "
                << "interrupted run's (set RNG_SEED: " << saved.seed << " to continue it exactly)\n";
    state_.position = saved.position;
    if (saved.best_metric == state_.best_metric) {
      state_.best_value = saved.best_value;
      state_.best_path = saved.best_path;
    }
    result_.resumed_from = opened->path;
    say("trainkit: resumed from '" + opened->path + "' at epoch " + std::to_string(saved.position.epoch) +
        ", micro-batch " + std::to_string(saved.position.index) + " (optimizer step " +
        std::to_string(trainer_.windows()) + ")");
    return saved.position;
  }

  // The scalar logs, continued from where training continues: a run stopped after its last
  // checkpoint logged points that the resumed run logs again, so the JSON lines past the
  // checkpoint's step are cut, and TensorBoard is told to hide them (a session start).
  void open_logs() {
    const std::string jsonl = options_.output_path() + "/" + options_.prefix() + "-scalars.jsonl";
    const std::int64_t step = trainer_.windows();
    if (const std::size_t dropped = drop_points_after(jsonl, step))
      say("trainkit: dropped " + std::to_string(dropped) + " line(s) past optimizer step " + std::to_string(step) +
          " from '" + jsonl + "' (" +
          (result_.resumed_from.empty() ? "an earlier run's: this run starts afresh in the directory"
                                        : "logged after the checkpoint: training continues from it") + ")");
    log_ = std::make_unique<ScalarFanout>();
    log_->emplace<TensorBoardWriter>(options_.output_path() + "/tensorboard").session_start(step + 1);
    log_->emplace<JsonlScalarWriter>(jsonl);
  }

  // 2. One micro-batch through the trainer, its loss and metrics added to the epoch's means.
  MicroStepResult micro_step(const Batch& batch, std::int64_t epoch, std::int64_t index, std::int64_t batches) {
    const std::int64_t items = task_.items ? task_.items(batch) : -1;
    const double weight = items >= 0 ? static_cast<double>(items) : 1.0;
    samples_since_log_ += items >= 0 ? items : 1;
    samples_in_epoch_ += items >= 0 ? items : 1;
    last_piece_items_ = items;
    try {
      if (task_.split && piece_items_ > 0 && items > piece_items_) return micro_step_pieces(batch, items);
      auto closure = [&] { return counted_loss(batch, weight); };
      return items >= 0 ? trainer_.micro_step(closure, items) : trainer_.micro_step(closure);
    } catch (const NonFiniteGradient& e) {
      throw NonFiniteGradient(position_text(epoch, index, batches) + ": " + e.what());
    }
  }

  // task.loss of a micro-batch (or a piece of one), its value added to the epoch's "Loss"
  // with `weight`.
  torch::Tensor counted_loss(const Batch& batch, double weight) {
    torch::Tensor loss = task_.loss(batch, metrics_);
    TORCH_CHECK(loss.defined() && loss.numel() == 1, "fit: task.loss must return a scalar tensor");
    metrics_.add("Loss", loss, weight);
    return loss;
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

  // A micro-batch of `items` items as pieces of at most piece_items_ (task.split), each with
  // its own forward and backward; one micro-step of the trainer.
  MicroStepResult micro_step_pieces(const Batch& batch, std::int64_t items) {
    const Pieces pieces = split(batch, items, (items + piece_items_ - 1) / piece_items_);
    last_piece_items_ = pieces.items[pieces.largest];
    return trainer_.micro_step_pieces(
        [&](std::int64_t j) {
          const auto k = static_cast<std::size_t>(j);
          return counted_loss(pieces.batches[k], static_cast<double>(pieces.items[k]));
        },
        pieces.items);
  }

  // The window being filled: where it began and the loop's sums before it, for a replay.
  // (A Metrics copy is a snapshot: metrics.hpp.)
  void open_window(std::int64_t epoch, std::int64_t index) {
    window_ = {true, epoch, index, metrics_, samples_since_log_, samples_in_epoch_};
  }

  // Out of memory in micro-batch `index`: the window is dropped and begins again at its first
  // micro-batch with pieces half the size of the largest that failed. Returns that micro-batch.
  std::int64_t replay_window(const std::exception& e, std::int64_t epoch, std::int64_t index, std::int64_t batches) {
    const std::string where = "out of memory at " + position_text(epoch, index, batches) + " (optimizer step " +
                              std::to_string(trainer_.windows() + 1) + ", " +
                              (last_piece_items_ >= 0 ? detail::items_text(last_piece_items_) + " at once" : "no item count") +
                              "): " + detail::first_line_of(e) + ". ";
    const std::string intact = "; the checkpoints written so far are intact";
    if (!task_.split)
      throw std::runtime_error(where + "Give the task a split function (tk::Task::split, with items) so that trainkit "
                               "replays the window in smaller pieces, or plan them with TRAIN.MEMORY_BUDGET" + intact);
    if (!window_.open || window_.epoch != epoch)
      throw std::runtime_error(where + "The window began " +
                               (window_.open ? "in epoch " + std::to_string(window_.epoch) : std::string("before this run resumed")) +
                               ", so it cannot be replayed; resume with a smaller micro-batch or TRAIN.MEMORY_BUDGET" + intact);
    if (last_piece_items_ <= 1)
      throw std::runtime_error(where + "Pieces of one item do not fit: recompute activations (tk::recompute), train "
                               "in half precision, or use a smaller model" + intact);
    trainer_.discard_window();
    if (!trainer_.device().is_cpu()) c10::getDeviceAllocator(trainer_.device().type())->emptyCache();
    piece_items_ = std::max<std::int64_t>(1, last_piece_items_ / 2);
    ++result_.replays;
    metrics_ = window_.metrics;
    samples_since_log_ = window_.samples_since_log;
    samples_in_epoch_ = window_.samples_in_epoch;
    say("trainkit: " + where + "The window's partial gradient is dropped and the window replayed from micro-batch " +
        std::to_string(window_.index) + " in pieces of at most " + detail::items_text(piece_items_) +
        "; the run goes on at that size, and the optimizer step is the window's as before");
    return window_.index;
  }

  // TRAIN.MEMORY_BUDGET: measures one forward+backward of micro-batch 0 of the first epoch at
  // a few piece sizes and plans the largest that fits ("Memory" above). The model's buffers,
  // the generators and the trainer's gradient are put back as they were.
  void plan_memory() {
    if (!task_.split)  // (fit() refuses a split without items)
      throw ConfigError("TRAIN.MEMORY_BUDGET", "planning the micro-batch needs a task that splits its batches "
                                               "(tk::Task::split and items); this task has no split. Set TRAIN.MEMORY_BUDGET: 0");
    const auto started = Clock::now();
    const torch::Device device = trainer_.device();
    const double budget = memory_budget_bytes(options_.memory_budget(), device);
    PeakMemory peak(device);
    if (!peak.available())
      throw ConfigError("TRAIN.MEMORY_BUDGET", "the peak memory cannot be measured here (/proc/self/clear_refs is not "
                                               "writable); set TRAIN.MEMORY_BUDGET: 0");
    const Batch batch = task_.batch(options_.begin_epoch(), 0);
    const std::int64_t total = task_.items(batch);
    TORCH_CHECK(total >= 1, "TRAIN.MEMORY_BUDGET: micro-batch 0 of epoch ", options_.begin_epoch(),
                " has no items to measure");
    std::vector<std::int64_t> sizes{1};
    for (const std::int64_t parts : {8, 4, 2, 1}) sizes.push_back((total + parts - 1) / parts);
    sizes.erase(std::unique(sizes.begin(), sizes.end()), sizes.end());
    // What the measurement would change: the buffers (batch norm's statistics), the generators.
    std::vector<torch::Tensor> buffers;
    for (const auto& b : trainer_.model().buffers()) buffers.push_back(b.clone());
    std::ostringstream generators;
    {
      torch::serialize::OutputArchive a;
      detail::save_rng_states(a, device);
      a.save_to(generators);
    }
    trainer_.model().train();
    std::vector<std::pair<std::int64_t, double>> measured;
    std::int64_t fails_from = total + 1;  // the smallest size that ran out of memory
    for (const std::int64_t size : sizes) {
      const Pieces pieces = split(batch, total, (total + size - 1) / size);
      const std::int64_t items = pieces.items[pieces.largest];
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
        peak.reset();
        {
          torch::Tensor loss;
          {
            const auto region = trainer_.precision_region();
            loss = task_.loss(pieces.batches[pieces.largest], scratch);
          }
          loss.backward();
        }
        bytes = peak.bytes();
      } catch (const std::exception& e) {
        if (!detail::is_out_of_memory(e)) throw;
        fails_from = items;
      }
      trainer_.discard_window();  // the measurement's gradient
      if (fails_from <= items) break;
      measured.emplace_back(items, bytes);
      if (bytes > budget * (1 - kMemoryMargin)) break;  // larger pieces need more
    }
    {
      torch::NoGradGuard no_grad;
      std::size_t i = 0;
      for (auto& b : trainer_.model().buffers()) b.copy_(buffers[i++]);
      std::istringstream in(generators.str());
      torch::serialize::InputArchive a;
      a.load_from(in);
      detail::load_rng_states(a, device);
    }
    if (!device.is_cpu()) c10::getDeviceAllocator(device.type())->emptyCache();
    if (measured.empty())
      throw ConfigError("TRAIN.MEMORY_BUDGET", "one forward+backward of a single item ran out of memory on " + device.str() +
                                               " before the budget of " + detail::mib_text(budget) + " was reached");
    MemoryPlan plan = plan_pieces(total, measured, budget);
    plan.piece_items = std::min(plan.piece_items, fails_from - 1);
    plan.seconds = std::chrono::duration<double>(Clock::now() - started).count();
    piece_items_ = plan.piece_items;
    planned_ = true;
    result_.plan = plan;
    say("trainkit: " + plan.text());
  }

  std::optional<StepReport> flush(std::int64_t epoch, std::int64_t batches) {
    try {
      return trainer_.flush();
    } catch (const NonFiniteGradient& e) {
      throw NonFiniteGradient("epoch " + std::to_string(epoch) + ", end of epoch (partial window after micro-batch " +
                              std::to_string(batches - 1) + "): " + e.what());
    }
  }

  // 3. After a window: every LOG_FREQUENT windows, read its report and log. Data parallel:
  // the ranks' totals are summed in one collective, which also carries each rank's stop and
  // checkpoint requests; returns those of any rank (none between log windows).
  Requests window_closed(const StepReport& report, std::int64_t epoch, std::int64_t done, std::int64_t batches,
                         Requests requests = {}) {
    ++run_windows_;
    if (report.window() % options_.log_frequent() != 0) {  // no sync: the terminal's line moves, nothing else
      if (progress_ && progress_->is_terminal()) progress_->update(progress_state(epoch, done, batches));
      return {};
    }
    const auto step = report.window();
    Metrics::Totals totals = metrics_.totals();  // one sync with the report's below
    const Requests agreed = total_over_ranks(totals, requests);
    std::map<std::string, double> interval;
    for (const auto& [name, sw] : totals.of) {
      const auto old = logged_.of.find(name);
      const double sum = sw.first - (old == logged_.of.end() ? 0.0 : old->second.first);
      const double weight = sw.second - (old == logged_.of.end() ? 0.0 : old->second.second);
      if (weight > 0) interval[name] = sum / weight;
    }
    logged_ = totals;
    const double loss = interval.count("Loss") ? interval["Loss"] : report.loss();
    check_skipped(report, epoch, done, batches, loss);
    if (!trainer_.uses_loss_scale()) {
      if (trainer_.options().nonfinite() == NonFinite::abort && !std::isfinite(loss))
        throw NonFiniteGradient(position_text(epoch, done - 1, batches) + ", optimizer step " + std::to_string(step) +
                                ": non-finite training loss " + short_number(loss) + " (mean since the last log)");
    }
    const double seconds = std::chrono::duration<double>(Clock::now() - clock_).count();
    const double speed = seconds > 0 ? static_cast<double>(samples_since_log_) / seconds : 0.0;
    clock_ = Clock::now();
    samples_since_log_ = 0;

    log_scalar(scalar_tags::train_loss, loss, step);
    for (const auto& [name, value] : interval)
      if (name != "Loss") log_scalar("Train-" + name, value, step);
    const auto& groups = trainer_.groups();
    for (size_t g = 0; g < groups.size(); ++g) {
      log_scalar(scalar_tags::initial_lr_group(g), trainer_.base_lr() * groups[g].lr_mult, step);
      log_scalar(scalar_tags::lr_group(g), report.lr() * groups[g].lr_mult, step);
    }
    log_scalar(scalar_tags::grad_norm, report.grad_norm(), step);
    log_scalar(scalar_tags::loss_scale, report.loss_scale(), step);
    log_scalar(scalar_tags::skipped_steps, static_cast<double>(report.skipped_steps()), step);
    log_scalar(scalar_tags::samples_per_second, speed, step);
    last_loss_ = loss;
    last_lr_ = report.lr();
    if (trainer_.uses_loss_scale()) last_scale_ = report.loss_scale();
    if (progress_) progress_->update(progress_state(epoch, done, batches));
    if (text_log_) {
      std::string line = position_text(epoch, done - 1, batches) + ", optimizer step " + std::to_string(step) + ": loss " +
                         short_number(loss) + ", lr " + short_number(report.lr()) + ", grad norm " + short_number(report.grad_norm());
      if (trainer_.uses_loss_scale()) line += ", loss scale " + short_number(report.loss_scale());
      line += ", skipped " + std::to_string(report.skipped_steps()) + ", " + short_number(speed) + " samples/s";
      text_log_->line(line);
    }
    return agreed;
  }

  // Skipped optimizer steps, seen at log windows from the report's counters (no sync of their
  // own). FP32/BF16 skip only on a non-finite gradient, never in a healthy run: the first skip
  // is a warning, and nonfinite_patience skips with no clean log interval between them stop the
  // run (on every rank: the counters agree). FP16's loss scale backs off by skipping: after the
  // start-up backoff, a log interval with more than a quarter of its steps skipped is reported
  // with the scale, once until an interval is clean again.
  void check_skipped(const StepReport& report, std::int64_t epoch, std::int64_t done, std::int64_t batches, double loss) {
    const std::int64_t skipped = report.skipped_steps() - skipped_at_log_, windows = report.window() - window_at_log_;
    skipped_at_log_ = report.skipped_steps();
    window_at_log_ = report.window();
    if (skipped <= 0) {
      skipped_unhealthy_ = 0;
      scale_warned_ = false;
      return;
    }
    const std::string where = position_text(epoch, done - 1, batches) + ", optimizer step " + std::to_string(report.window());
    const std::string what = std::to_string(skipped) + " of the last " + std::to_string(windows) +
                             " optimizer steps were skipped (non-finite gradients; training loss " + short_number(loss) + ")";
    if (!trainer_.uses_loss_scale()) {
      skipped_unhealthy_ += skipped;
      const std::string patience = "TRAIN.NONFINITE_PATIENCE " + std::to_string(options_.nonfinite_patience());
      if (skipped_unhealthy_ >= options_.nonfinite_patience())
        throw NonFiniteGradient(where + ": " + what + "; " + std::to_string(skipped_unhealthy_) +
                                " skipped with no clean log interval between them (" + patience +
                                "): stopping. Lower TRAIN.LR or check the data; the checkpoints written so far are intact");
      if (!skip_warned_) {
        skip_warned_ = true;
        say("trainkit: warning: " + where + ": " + what + ". " + trainer_.type_name() +
            " skips a step only when its gradient is not finite: lower TRAIN.LR or check the data (" + patience +
            " such steps stop the run; TRAIN.NONFINITE: abort stops at the first)");
      }
      return;
    }
    constexpr std::int64_t kStartup = 32;  // the scale's start-up backoff (2^16 -> 2^0 is 16 halvings)
    if (report.window() > kStartup && 4 * skipped > windows && !scale_warned_) {
      scale_warned_ = true;
      say("trainkit: warning: " + where + ": " + what + ", past the loss scale's start-up backoff; the scale is now " +
          short_number(report.loss_scale()) + ". A scale that keeps falling means the gradient overflows at any scale: "
          "lower TRAIN.LR, check the data, or train in BF16");
    }
  }

  void log_scalar(const std::string& tag, double value, std::int64_t step) {
    if (log_) log_->add_scalar(tag, value, step);
    if (callbacks_.scalar) callbacks_.scalar(tag, value, step);
  }

  // The progress line counts optimizer windows inside the epoch, and in the whole run; the
  // loss, LR and scale are the last log window's.
  ProgressState progress_state(std::int64_t epoch, std::int64_t done, std::int64_t batches) const {
    const std::int64_t n = trainer_.window_length();
    ProgressState p;
    p.epoch = epoch;
    p.epochs = options_.end_epoch();
    p.step = (done + n - 1) / n;
    p.total = (batches + n - 1) / n;
    p.run_step = run_windows_;
    p.run_total = std::max(run_total_, run_windows_);
    p.samples = samples_in_epoch_;
    p.loss = last_loss_;
    p.lr = last_lr_;
    p.loss_scale = last_scale_;
    return p;
  }

  // A line for the user (rank 0 only), below the progress line when there is one, and in the
  // text log.
  void say(const std::string& text) {
    if (!writes()) return;
    if (progress_) progress_->message(text);
    else std::cerr << text << std::endl;
    if (text_log_) text_log_->line(text);
  }
  // A line of the run's record (a validation, a checkpoint): below the progress line when there
  // is one (not on stderr without one), and in the text log.
  void report(const std::string& text) {
    if (!writes()) return;
    if (progress_) progress_->message(text);
    if (text_log_) text_log_->line(text);
  }

  // 4. A better validation metric: the epoch's checkpoint becomes the best; the plateau
  // schedule sees every value.
  bool observe_best(std::int64_t epoch, const std::map<std::string, double>& validation) {
    if (task_.best_metric.empty()) return false;
    const auto it = validation.find(task_.best_metric);
    if (it == validation.end())
      throw std::runtime_error("fit: task.best_metric is '" + task_.best_metric +
                               "', but task.validate returned no such metric");
    const double v = it->second;
    trainer_.on_epoch_end(epoch, v);
    const double best = state_.best_value;
    const bool better = std::isfinite(v) && (std::isnan(best) || (task_.higher_is_better ? v > best : v < best));
    if (!better) return false;
    state_.best_value = v;
    state_.best_path = checkpoints_.epoch_path(epoch);
    return true;
  }

  void write_checkpoint(bool epoch_end) {
    if (!writes()) return;
    // The loop's running sums, so that a resumed epoch's means and logs equal the straight
    // run's. Data parallel, inside an epoch: the mean over the ranks of their running sums,
    // which the log window this checkpoint follows has just computed (logged_). Every rank
    // resumes with it, and every later mean over the ranks is then the uninterrupted run's.
    state_.finished = finished_;
    state_.piece_items = piece_items_;
    state_.metrics = trainer_.replicas().world_size() > 1 && state_.position.index > 0 ? Metrics::from_totals(logged_)
                                                                                        : metrics_;
    state_.logged = logged_;
    try {
      const auto path = checkpoints_.save(trainer_, state_, epoch_end, callbacks_.state);
      result_.checkpoints.push_back(path);
      report("checkpoint '" + path + "' written");
    } catch (const CheckpointError& e) {
      throw CheckpointError("at epoch " + std::to_string(state_.position.epoch) + ", micro-batch " +
                            std::to_string(state_.position.index) + " (optimizer step " +
                            std::to_string(trainer_.windows()) + "): " + e.what());
    }
  }

  // The checkpoint's resolved configuration against this run's: a key that changes the
  // trajectory is refused with every difference (TRAIN.RESUME_CHANGES: allow lets it through,
  // said once); keys of length, rhythm, place and evaluation change freely.
  void check_resume_changes(const std::string& saved_json) {
    if (saved_json.empty() || options_.config_json().empty()) return;  // not written from a configuration
    const auto changes = resume_changes(saved_json, options_.config_json());
    if (changes.empty()) return;
    std::string listed;
    for (const auto& c : changes) listed += "\n  " + c.key + ": " + c.before + " -> " + c.after;
    if (!options_.allow_resume_changes())
      throw ConfigError("TRAIN.RESUME_CHANGES", "the checkpoint in '" + options_.output_path() +
                                                    "' was written with another configuration, and these keys change "
                                                    "the training trajectory (checkpoint -> this run):" + listed +
                                                    "\nResume with the checkpoint's values, start in a new directory (--model-dir), or set "
                                                    "TRAIN.RESUME_CHANGES: allow (--set TRAIN.RESUME_CHANGES=allow) to continue with this run's");
    say("trainkit: resuming with a changed configuration (TRAIN.RESUME_CHANGES: allow), checkpoint -> this run:" + listed);
  }

  FitResult stop(int signal) {
    FitResult r = finish();
    r.stopped = true;
    r.signal = signal;
    std::ostringstream msg;
    msg << "trainkit: stopped" << (signal == SIGINT ? " by SIGINT" : signal == SIGTERM ? " by SIGTERM" : "")
        << " at epoch " << state_.position.epoch << ", micro-batch " << state_.position.index;
    if (!r.checkpoints.empty()) msg << "; checkpoint '" << r.checkpoints.back() << "' written";
    msg << ". To continue, run the same command again"
        << (options_.auto_resume() ? " (TRAIN.AUTO_RESUME is on)" : " with --resume (or TRAIN.AUTO_RESUME: true)");
    r.message = msg.str();
    say(r.message);
    return r;
  }

  FitResult finish() {
    if (progress_) progress_->finish();
    if (text_log_)
      text_log_->line("end: at epoch " + std::to_string(state_.position.epoch) + ", micro-batch " +
                      std::to_string(state_.position.index) + ", optimizer step " + std::to_string(trainer_.windows()));
    if (log_) log_->close();  // errors of the last writes surface here, as exceptions
    FitResult r = result_;
    r.position = state_.position;
    r.windows = trainer_.windows();
    r.applied_steps = trainer_.applied_steps().template item<std::int64_t>();
    r.skipped_steps = trainer_.skipped_steps().template item<std::int64_t>();
    r.best_checkpoint = state_.best_path;
    r.piece_items = piece_items_;
    return r;
  }

  AnyTrainer& trainer_;
  Task<Batch>& task_;
  const FitOptions& options_;
  Callbacks callbacks_;
  CheckpointManager checkpoints_;
  std::unique_ptr<DirectoryLock> lock_;  // held while this run writes into output_path
  std::int64_t skipped_at_log_ = 0, window_at_log_ = 0;  // the counters at the last log (check_skipped)
  std::int64_t skipped_unhealthy_ = 0;                   // FP32/BF16 skips since a clean interval
  bool skip_warned_ = false, scale_warned_ = false;
  std::unique_ptr<ScalarFanout> log_;   // TensorBoard events and JSON lines
  std::unique_ptr<ProgressLine> progress_;
  std::unique_ptr<TextLog> text_log_;   // <output_path>/<prefix>-log.txt
  std::int64_t run_windows_ = 0, run_total_ = 0;  // this run's optimizer windows: done, all (progress ETA)
  std::optional<double> last_loss_;     // the last log window's, for the progress line
  double last_lr_ = std::numeric_limits<double>::quiet_NaN(), last_scale_ = std::numeric_limits<double>::quiet_NaN();
  std::string finished_;                // why a callback finished training ("": it goes on); in checkpoints
  LoopState state_;
  FitResult result_;
  Metrics metrics_;           // the epoch's running sums: "Loss" and the task's metrics
  Metrics::Totals logged_;    // the sums at the last log (the next log's interval starts there)
  Clock::time_point clock_;
  std::int64_t samples_since_log_ = 0, samples_in_epoch_ = 0;
  // Memory ("Memory" above): the largest piece of a micro-batch run at once (0: whole ones),
  // whether a budget planned it, the items of the last micro-step's largest piece, and the
  // open window's start with the loop's sums before it (for a replay).
  std::int64_t piece_items_ = 0, last_piece_items_ = -1;
  bool planned_ = false;
  struct OpenWindow {
    bool open = false;
    std::int64_t epoch = 0, index = 0;
    Metrics metrics;
    std::int64_t samples_since_log = 0, samples_in_epoch = 0;
  } window_;
};

}  // namespace detail

/// Trains `trainer` on `task` by `options` (see the file comment). Returns after END_EPOCH or
/// after a graceful stop (FitResult::stopped); throws on errors (CheckpointError,
/// NonFiniteGradient, the task's own). Any Trainer<P, A, C> is an AnyTrainer: the loop is
/// compiled once, not once per configuration.
template <class Batch>
FitResult fit(AnyTrainer& trainer, Task<Batch>& task, const FitOptions& options, Callbacks callbacks = {}) {
  options.validate();
  if (!task.batches_per_epoch || !task.batch || !task.loss)
    throw std::invalid_argument("fit: the task needs batches_per_epoch, batch and loss");
  if (task.split && !task.items)
    throw std::invalid_argument("fit: task.split needs task.items (pieces are weighted by their item counts)");
  if (options.piece_items() > 0 && !task.split)
    throw std::invalid_argument("fit: FitOptions::piece_items needs task.split (and task.items) to make pieces");
  detail::FitLoop<Batch> loop(trainer, task, options, std::move(callbacks));
  return loop.run();
}

}  // namespace trainkit
