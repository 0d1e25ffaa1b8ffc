#pragma once
/// The fit loop: epochs over a Task (task.hpp), with validation, checkpoints, resume, logs and
/// graceful stops. The loop is only the loop: what it writes and says is the RunLog's
/// (run_log.hpp), micro-batches as pieces and the replay after out-of-memory are memory's
/// (memory.hpp, detail::PieceRunner), the files are the CheckpointManager's (checkpoint.hpp).
///
///   tk::Task<Batch> task;
///   task.batches_per_epoch = [&](std::int64_t epoch) { return loader_length; };
///   task.batch = [&](std::int64_t epoch, std::int64_t index) { return make_batch(seed, epoch, index); };
///   task.loss = [&](const Batch& b, tk::Metrics& metrics) { return loss_of(model, b); };
///   auto options = tk::RunPlan::from(config).fit;  // OUTPUT_PATH, LOG_FREQUENT, END_EPOCH...
///   tk::FitResult r = tk::fit(trainer, task, options);
///   return 0;                                      // also after a SIGTERM: r.stopped
///
/// One call, in order: resume (TRAIN.RESUME, AUTO_RESUME) at the exact micro-batch the
/// checkpoint was written before; epochs of task.batch(epoch, index), a pure function of its
/// position, through the trainer (windows of a task with loss terms read ahead and counted);
/// every LOG_FREQUENT windows the StepReport read (the loop's only host sync besides the epoch
/// end) and logged; at an epoch's end validation, the schedule, the callbacks and checkpoints.
/// SIGINT/SIGTERM finish the window, write a checkpoint and return FitResult::stopped. Data
/// parallel: every rank runs fit() on its shard; the main rank writes; stops are agreed at log
/// windows. Errors: CheckpointError (the files written stay intact), NonFiniteGradient, and
/// out-of-memory stops that name the micro-batch.
///
/// The user's view: docs/guide/fit.md, memory.md, checkpoints.md, data-parallel.md. Why it is
/// built this way: docs/design/memory.md, checkpoints.md, logging.md, data-parallel.md.
#include <trainkit/trainer/any_trainer.hpp>
#include <trainkit/fit/agreements.hpp>
#include <trainkit/fit/checkpoint.hpp>
#include <trainkit/fit/fit_events.hpp>
#include <trainkit/config/error.hpp>
#include <trainkit/config/resume_changes.hpp>
#include <trainkit/detail/messages.hpp>
#include <trainkit/detail/rng_state.hpp>
#include <trainkit/fit/stop_signals.hpp>
#include <trainkit/fit/fit_options.hpp>
#include <trainkit/fit/run_log.hpp>
#include <trainkit/fit/memory.hpp>
#include <trainkit/fit/metrics.hpp>
#include <trainkit/fit/prefetcher.hpp>
#include <trainkit/step/replicas.hpp>
#include <trainkit/fit/task.hpp>

#include <torch/types.h>

#include <cmath>
#include <csignal>
#include <cstdint>
#include <deque>
#include <functional>
#include <future>
#include <iostream>
#include <map>
#include <memory>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace trainkit {

/// What fit() did.
struct FitResult {
  FitPosition position;                        ///< where training would continue
  std::int64_t windows = 0;                    ///< optimizer phases so far (applied + skipped)
  std::int64_t applied_steps = 0, skipped_steps = 0;
  std::map<std::string, double> train;         ///< the last completed epoch's means (or the resumed checkpoint's)
  std::map<std::string, double> validation;    ///< the last validation (or the resumed checkpoint's)
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
  std::int64_t stand_in_pieces = 0;            ///< ZeRO stage 3: pieces this rank ran as stand-ins (fewer items than another's)
};

namespace detail {

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
        checkpoints_(options.output_path(), options.prefix(), options.checkpoint_keep()),
        pieces_(trainer, task, options.piece_items(), [this](const std::string& text) { say(text); },
                [this](const std::string& text) {
                  if (log_) log_->say_local(text);
                }),
        agreements_(trainer.replicas(), options.log_frequent()) {
    checkpoints_.set_format(options.checkpoint_format());
  }

  FitResult run() {
    StopSignals signals(options_.handle_signals());
    // 0. The output directory (locked: one job per directory), the run's log, and the memory
    //    plan (before resuming: it changes no result; it allocates the optimizer's state).
    if (writes()) {
      checkpoints_.create_directory();
      lock_ = std::make_unique<DirectoryLock>(options_.output_path());
    }
    log_.emplace(options_, trainer_, writes(), callbacks_.scalar);
    if (options_.memory_budget() > 0) result_.plan = pieces_.plan(options_.memory_budget(), options_.begin_epoch());
    state_.seed = options_.seed();
    state_.best_metric = task_.best_metric;
    state_.higher_is_better = task_.higher_is_better;
    state_.config_json = options_.config_json();
    log_->started();
    // 1. Resume.
    const FitPosition start = resume();
    if (nothing_to_train(start)) return finish();
    log_->open(!result_.resumed_from.empty(), windows_from(start));
    agreements_.start(trainer_.windows());
    Prefetcher<Batch> prefetch(task_.batch, options_.workers());

    for (std::int64_t epoch = start.epoch; epoch < options_.end_epoch(); ++epoch) {
      const std::int64_t batches = task_.batches_per_epoch(epoch);
      TORCH_CHECK(batches >= 1, "fit: task.batches_per_epoch(", epoch, ") must be >= 1, got ", batches);
      const std::int64_t first = epoch == start.epoch ? start.index : 0;
      if (first == 0) {  // a resumed epoch keeps its running sums (they are in the checkpoint)
        metrics_.reset();
        logged_ = agreed_totals_ = {};
      }
      log_->epoch_begins(epoch, first, batches);
      trainer_.model().train();
      Requests asked;  // this rank's: a signal, a callback's
      for (std::int64_t index = first; index < batches; ++index) {
        // 2. One micro-batch. Out of memory: the window again from its first micro-batch, in
        //    smaller pieces (or an error saying why it cannot be). A loss of terms: the
        //    window's counts first (its micro-batches made, counted and held).
        if (trainer_.window_position() == 0) open_window(prefetch, epoch, index, batches);
        seed_generators(epoch, index);
        const Batch batch = next_batch(prefetch, epoch, index, batches);
        if (task_.split && trainer_.reduces_each_micro_batch()) batch_sums_ = {metrics_, log_->counts()};
        MicroStepResult r;
        try {
          r = micro_step(batch, epoch, index, batches);
        } catch (const std::exception& e) {
          if (!detail::is_out_of_memory(e)) throw;
          index = replay_window(e, epoch, index, batches) - 1;
          continue;
        }
        asked.stop |= signals.received() != 0 || trainer_.replicas().store_gone();
        if (r.window_closed) held_.clear();  // (a loss of terms: the window's micro-batches)
        if (saves()) background_checked(/*wait=*/false);  // (an atomic load, unless one finished)
        // 3. After a window: a log window logs, and the ranks agree there on stops and
        //    checkpoints, in the collective that logging does anyway.
        Requests agreed;
        if (r.window_closed) agreed = window_closed(r.report, {epoch, index + 1, batches}, asked);
        if (callbacks_.batch_end) {
          BatchEnd info{epoch, index, batches, &r};
          callbacks_.batch_end(info);
          asked.checkpoint |= info.request_checkpoint;
          asked.stop |= info.request_stop;
        }
        asked.stop |= signals.received() != 0 || trainer_.replicas().store_gone();
        // Checkpoints inside an epoch fall on window boundaries: the signal's "finish the
        // current window" is this condition becoming true. One process acts on its own
        // requests; ranks on what they agreed at the last log window or agreement between
        // them (window_closed: no sync of its own; the checkpoint's running sums are then
        // every rank's, agreed_totals_: write_checkpoint).
        const Requests now = single() ? asked : agreed;
        if ((now.stop || now.checkpoint) && trainer_.window_position() == 0 && index + 1 < batches) {
          state_.position = {epoch, index + 1};
          write_checkpoint(/*epoch_end*/ false);
          asked.checkpoint = false;
          if (now.stop) return stop(signals.received());
        }
      }
      // 4. End of the epoch: the partial window, then the epoch's sums over the ranks and their
      //    stop requests in one collective.
      if (auto report = flush(epoch, batches)) window_closed(*report, {epoch, batches, batches});
      if (trainer_.window_position() == 0) held_.clear();
      log_->epoch_ends({epoch, batches, batches});
      asked.stop |= signals.received() != 0 || trainer_.replicas().store_gone();
      Metrics::Totals totals = metrics_.totals();
      if (agree({asked.stop, false, false}, &totals).stop) {  // every micro-batch ran; the epoch's end runs after resuming
        state_.position = {epoch, batches};
        if (!single()) logged_ = agreed_totals_ = totals;  // the sums over every rank (write_checkpoint)
        write_checkpoint(/*epoch_end*/ false);
        return stop(signals.received());
      }
      // Means, validation, the best checkpoint and the schedule, the callback, a checkpoint.
      EpochEnd end;
      end.epoch = epoch;
      for (const auto& [name, sw] : totals.of) end.train[name] = totals.mean(name);
      add_terms_loss(end.train);
      result_.train = state_.train = end.train;
      const bool last = epoch + 1 == options_.end_epoch();
      bool new_best = false;
      if (task_.validate && ((epoch + 1) % options_.val_frequent() == 0 || last)) {
        end.validation = validate(epoch);
        agreements_.mean(end.validation);  // the schedule and the best must agree on every rank
        result_.validation = state_.validation = end.validation;
        log_->validation(epoch, end.validation);
        new_best = observe_best(epoch, end.validation);
      }
      if (callbacks_.epoch_end) callbacks_.epoch_end(end);
      const Requests agreed = agree({asked.stop || end.request_stop || signals.received() != 0 ||
                                         trainer_.replicas().store_gone(),
                                     asked.checkpoint || end.request_checkpoint, end.request_finish});
      state_.position = {epoch + 1, 0};
      if (agreed.finish) {  // data parallel: any rank's request, the main rank's reason
        finished_ = end.finish_reason.empty() ? "a callback finished training" : end.finish_reason;
        write_checkpoint(/*epoch_end*/ true);
        result_.finished = true;
        result_.message = "trainkit: finished after epoch " + std::to_string(epoch) + ": " + finished_ +
                          "; the checkpoint is marked finished, so running this again trains no further";
        say(result_.message);
        return finish();
      }
      if ((epoch + 1) % options_.checkpoint_frequent() == 0 || last || new_best || agreed.checkpoint || agreed.stop)
        write_checkpoint(/*epoch_end*/ true);
      if (agreed.stop && !last) return stop(signals.received());
      log_->paused();
    }
    return finish();
  }

 private:
  // Checkpoints, logs and messages: on the main rank only (every rank trains and resumes).
  bool writes() const { return options_.write_files() && trainer_.replicas().is_main(); }
  // This rank calls the checkpoint manager's save: the main rank, or every rank for a set.
  bool saves() const { return options_.write_files() && (trainer_.replicas().is_main() || checkpoints_.writes_set(trainer_)); }
  bool single() const { return trainer_.replicas().world_size() == 1; }
  void say(const std::string& text) {
    if (log_) log_->say(text);
  }

  // Data parallel: what every rank must do alike (fit/agreements.hpp). A background write that
  // failed on any rank stops every rank here (write_failed_everywhere).
  Requests agree(Requests mine, Metrics::Totals* totals = nullptr, std::int64_t window = 0) {
    mine.write_failures = write_error_.empty() ? 0 : 1;
    const Requests agreed = agreements_.agree(mine, totals, window);
    if (agreed.write_failures > 0) write_failed_everywhere(agreed.write_failures - mine.write_failures);
    return agreed;
  }

  // 1. Resume, by TRAIN.RESUME / AUTO_RESUME. Returns where training starts. The checkpoint's
  // configuration is checked before anything is loaded.
  FitPosition resume();

  // A run a callback finished (early stopping) trains no further: true, said. A finished job run
  // again (resumed at END_EPOCH) is said; its loop then runs no epoch.
  bool nothing_to_train(FitPosition start);

  // The optimizer windows from `start` to the run's end (the progress line's ETA).
  std::int64_t windows_from(FitPosition start) const;

  // With more than one rank, the RNG (CPU, and the trainer's GPU) is seeded from the position:
  // dropout masks and anything task.batch draws are a pure function of (seed, rank, epoch,
  // index), so a resume is exact on every rank.
  void seed_generators(std::int64_t epoch, std::int64_t index) {
    if (single()) return;
    detail::seed_rng_states(detail::mix_seed({static_cast<std::uint64_t>(options_.seed()),
                                              static_cast<std::uint64_t>(trainer_.replicas().rank()),
                                              static_cast<std::uint64_t>(epoch), static_cast<std::uint64_t>(index)}),
                            trainer_.device());
  }

  // 2. One micro-batch through the trainer (whole or in pieces), its loss and metrics added to
  // the epoch's means.
  MicroStepResult micro_step(const Batch& batch, std::int64_t epoch, std::int64_t index, std::int64_t batches) {
    batch_mark_ = log_->forward_mark();  // (a replay drops what the failed attempt recorded)
    if (trainer_.window_position() == 0) window_mark_ = batch_mark_;
    const std::int64_t items = task_.items ? task_.items(batch) : -1;
    log_->samples(items);  // (-1: no count, the micro-batch is the unit)
    MicroStepResult r;
    try {
      r = pieces_.step(batch, items, [&](const Batch& b, double weight) { return counted_loss(b, weight); });
    } catch (const NonFiniteGradient& e) {
      throw NonFiniteGradient(detail::position_text(epoch, index, batches) + ": " + e.what());
    }
    // Loss terms: their sums were added with the pieces, their items once per micro-batch.
    if (terms()) {
      const auto counts = term_items(batch);
      for (size_t t = 0; t < counts.size(); ++t) metrics_.add_items(task_.terms[t], static_cast<double>(counts[t]));
    }
    return r;
  }

  // task.loss of a micro-batch (or a piece of one), its value added to the epoch's "Loss"
  // with `weight`; loss terms' sums each to their term (their items: micro_step).
  torch::Tensor counted_loss(const Batch& batch, double weight) {
    torch::Tensor loss;
    {
      const auto recording = log_->record_forward(trainer_.windows() + 1);  // (a log window's, when asked)
      loss = task_.loss(batch, metrics_);
    }
    if (terms()) {
      TORCH_CHECK(loss.defined() && loss.dim() <= 1 && loss.numel() == static_cast<std::int64_t>(task_.terms.size()),
                  "fit: task.loss must return the sums of the task's ", task_.terms.size(),
                  " loss terms (task.terms), one value per term");
      for (size_t t = 0; t < task_.terms.size(); ++t)
        metrics_.add_sum(task_.terms[t], loss.reshape({-1}).select(0, static_cast<std::int64_t>(t)), 0.0);
      return loss;
    }
    TORCH_CHECK(loss.defined() && loss.numel() == 1, "fit: task.loss must return a scalar tensor");
    metrics_.add("Loss", loss, weight);
    return loss;
  }

  bool terms() const { return !task_.terms.empty(); }
  // task.term_items of a batch, checked.
  std::vector<std::int64_t> term_items(const Batch& batch) const {
    auto counts = task_.term_items(batch);
    TORCH_CHECK(counts.size() == task_.terms.size(), "fit: task.term_items returned ", counts.size(),
                " counts for the task's ", task_.terms.size(), " loss terms (task.terms)");
    return counts;
  }
  // A loss of terms: "Loss" is the sum of the terms' means.
  void add_terms_loss(std::map<std::string, double>& means) const {
    if (!terms()) return;
    double loss = 0;
    for (const auto& name : task_.terms)
      if (const auto it = means.find(name); it != means.end()) loss += it->second;
    means["Loss"] = loss;
  }

  // A window opens at micro-batch `index` of `epoch`. A loss of terms: its micro-batches are
  // made now and held, their items counted and given to the trainer, which sums them over the
  // ranks (Trainer::begin_window; not again for a replay, whose counts it keeps). With a task
  // that splits: where it began and the loop's sums before it, for a replay (a Metrics copy is
  // a snapshot: metrics.hpp).
  void open_window(Prefetcher<Batch>& prefetch, std::int64_t epoch, std::int64_t index, std::int64_t batches) {
    if (terms() && !replaying_) {
      held_.clear();
      std::vector<std::int64_t> items(task_.terms.size(), 0);
      const auto positions = window_positions(epoch, index, batches);
      for (const FitPosition at : positions) {
        seed_generators(at.epoch, at.index);  // (task.batch draws nothing from them; as if it ran there)
        const std::int64_t n = at.epoch == epoch ? batches : task_.batches_per_epoch(at.epoch);
        held_.push_back({at, prefetch.next(at.epoch, at.index, n)});
        const auto counts = term_items(held_.back().batch);
        for (size_t t = 0; t < counts.size(); ++t) items[t] += counts[t];
      }
      trainer_.begin_window(items, static_cast<std::int64_t>(positions.size()));
    }
    replaying_ = false;
    if (!task_.split) return;
    pieces_.window_opens(epoch, index);
    window_sums_ = {metrics_, log_->counts()};
  }
  // The positions of the window that opens at (epoch, index): the window's length, or what is
  // left of the epoch; with PARTIAL_WINDOW span, the rest from the next epochs' first ones, past
  // END_EPOCH too (a window left open at the run's end goes on there when END_EPOCH is raised).
  std::vector<FitPosition> window_positions(std::int64_t epoch, std::int64_t index, std::int64_t batches) const {
    std::vector<FitPosition> at;
    const auto n = static_cast<size_t>(trainer_.window_length());
    for (std::int64_t i = index; i < batches && at.size() < n; ++i) at.push_back({epoch, i});
    if (trainer_.options().partial_window() != PartialWindow::span) return at;
    for (std::int64_t e = epoch + 1; at.size() < n; ++e) {
      const std::int64_t m = task_.batches_per_epoch(e);
      TORCH_CHECK(m >= 1, "fit: task.batches_per_epoch(", e, ") must be >= 1, got ", m);
      for (std::int64_t i = 0; i < m && at.size() < n; ++i) at.push_back({e, i});
    }
    return at;
  }
  // The batch at (epoch, index): held by the open window, else made (or taken from the workers).
  Batch next_batch(Prefetcher<Batch>& prefetch, std::int64_t epoch, std::int64_t index, std::int64_t batches) {
    for (const auto& h : held_)
      if (h.at.epoch == epoch && h.at.index == index) return h.batch;
    return prefetch.next(epoch, index, batches);
  }
  // Out of memory in micro-batch `index`: the window begins again at its first micro-batch,
  // which this returns, with the loop's sums as they were when it opened.
  // (A gradient reduced at each micro-batch's end: that micro-batch again, alone, with the
  // sums as they were before it.)
  std::int64_t replay_window(const std::exception& e, std::int64_t epoch, std::int64_t index, std::int64_t batches) {
    const std::int64_t first = pieces_.replay(e, epoch, index, batches);  // throws when it cannot
    const WindowSums& sums = first == index && trainer_.reduces_each_micro_batch() ? batch_sums_ : window_sums_;
    log_->forward_discard(first == index ? batch_mark_ : window_mark_);
    metrics_ = sums.metrics;
    log_->restore(sums.counts);
    replaying_ = trainer_.window_position() == 0;  // the window opens again: its counts are the trainer's
    return first;
  }

  std::optional<StepReport> flush(std::int64_t epoch, std::int64_t batches) {
    try {
      return trainer_.flush();
    } catch (const NonFiniteGradient& e) {
      throw NonFiniteGradient("epoch " + std::to_string(epoch) + ", end of epoch (partial window after micro-batch " +
                              std::to_string(batches - 1) + "): " + e.what());
    }
  }

  // 3. After a window: every LOG_FREQUENT windows, read its report and log the means since the
  // last log window; the ranks' totals and their requests go through one collective there.
  // Returns any rank's requests (none between log windows).
  Requests window_closed(const StepReport& report, LogPosition at, Requests asked = {}) {
    const std::int64_t w = report.window();
    if (!log_->logs_window(w)) {
      log_->window(report, at, nullptr);
      if (!agreements_.due(w)) return {};
      // An agreement between log windows: the requests (and, for a checkpoint, the sums).
      const Requests agreed = agree(asked, nullptr, w);
      if (agreed.stop || agreed.checkpoint) {  // (every rank: agreed)
        agreed_totals_ = metrics_.totals();
        agree({}, &agreed_totals_);
      }
      return agreed;
    }
    Metrics::Totals totals = metrics_.totals();  // one sync with the report's (log_->window)
    const Requests agreed = agree(asked, &totals, w);
    agreed_totals_ = totals;
    std::map<std::string, double> interval;
    for (const auto& [name, sw] : totals.of) {
      const auto old = logged_.of.find(name);
      const double sum = sw.first - (old == logged_.of.end() ? 0.0 : old->second.first);
      const double weight = sw.second - (old == logged_.of.end() ? 0.0 : old->second.second);
      if (weight > 0) interval[name] = sum / weight;
    }
    add_terms_loss(interval);
    logged_ = totals;
    log_->window(report, at, &interval);
    return agreed;
  }

  // 4. task.validate in eval mode (dropout off, normalisation's running statistics) and without
  // a graph, whatever the task does itself; the model's mode as it was afterwards, also when
  // validate throws. ZeRO stage 3: an evaluation by unit (FitOptions::validate_by_unit: each
  // unit gathered for its call; the ranks' shards of the validation set may hold different
  // numbers of batches, joined at the end or at the task's sum over the ranks), ended (a
  // collective) even when the validation throws, so that ranks still forwarding finish their
  // forwards (a task's sum after them then waits for this rank until the heartbeat or the
  // timeout ends it, as when held); or every unit held gathered for it, released after.
  std::map<std::string, double> validate(std::int64_t epoch) {
    struct Mode {
      torch::nn::Module& model;
      bool training;
      ~Mode() { model.train(training); }
    } restore{trainer_.model(), trainer_.model().is_training()};
    struct Gathered {
      AnyTrainer& trainer;
      bool by_unit, on;
      void end() {
        on = false;
        by_unit ? trainer.evaluate_by_unit(false) : trainer.hold_parameters(false);
      }
      ~Gathered() {
        if (!on) return;
        try {
          end();  // (the validation threw: its error goes on)
        } catch (...) {
        }
      }
    } gathered{trainer_, options_.validate_by_unit(), trainer_.shards_parameters()};
    if (gathered.on) gathered.by_unit ? trainer_.evaluate_by_unit(true) : trainer_.hold_parameters(true);
    trainer_.model().eval();
    torch::NoGradGuard no_grad;
    auto metrics = task_.validate(epoch);
    if (gathered.on) gathered.end();
    return metrics;
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

  void write_checkpoint(bool epoch_end);

  // A background checkpoint that finished (with `wait`: the one in flight, waited for) is said
  // written. One that failed stops one process here, naming the file (the checkpoints before
  // it are complete); data parallel, the error is kept (write_error_) until the ranks agree.
  void background_checked(bool wait);
  // Data parallel, where every rank calls it: the background write in flight waited for
  // (`wait`) or looked at, and the ranks agree whether one failed anywhere; if so, every rank
  // stops (write_failed_everywhere).
  void background_agreed(bool wait);
  // Every rank stops alike on a background write that failed: this rank's own write cancelled
  // (a set's main rank waits for the other ranks' files), then CheckpointError: this rank's
  // error, or that `others` other ranks failed to write their part of the checkpoint.
  [[noreturn]] void write_failed_everywhere(std::int64_t others);

  // The checkpoint's resolved configuration against this run's: a key that changes the
  // trajectory is refused with every difference (TRAIN.RESUME_CHANGES: allow lets it through,
  // said once); keys of length, rhythm, place and evaluation change freely.
  void check_resume_changes(const std::string& saved_json, const std::string& path);

  // A checkpoint of another world size resumes when the total batch is the same: the data
  // sampler gives W ranks of batch B, micro-batch by micro-batch, the samples one process of
  // batch W x B sees, so the position (epoch, micro-batch) means the same samples. Otherwise the
  // schedule and the per-sample LR would change under the run: refused.
  void check_world_size(const LoopState& saved, const std::string& path);

  FitResult stop(int signal) {
    FitResult r = finish();
    r.stopped = true;
    r.signal = signal;
    std::ostringstream msg;
    msg << "trainkit: stopped" << (signal == SIGINT ? " by SIGINT" : signal == SIGTERM ? " by SIGTERM" : "")
        << (signal == 0 && trainer_.replicas().store_gone()
                ? " because the group's store is gone (its host, torchrun's agent, was killed or died)"
                : "")
        << " at epoch " << state_.position.epoch << ", micro-batch " << state_.position.index;
    if (!r.checkpoints.empty()) msg << "; checkpoint '" << r.checkpoints.back() << "' written";
    msg << ". To continue, run the same command again"
        << (options_.auto_resume() ? " (TRAIN.AUTO_RESUME is on)" : " with --resume (or TRAIN.AUTO_RESUME: true)");
    r.message = msg.str();
    say(r.message);
    return r;
  }

  FitResult finish() {
    background_agreed(/*wait=*/true);  // the run's checkpoints complete (on every rank) before it returns
    log_->finish(state_.position.epoch, state_.position.index);
    FitResult r = result_;
    r.position = state_.position;
    r.windows = trainer_.windows();
    r.applied_steps = trainer_.applied_steps().template item<std::int64_t>();
    r.skipped_steps = trainer_.skipped_steps().template item<std::int64_t>();
    r.best_checkpoint = state_.best_path;
    r.piece_items = pieces_.piece_items();
    r.replays = pieces_.replays();
    r.stand_in_pieces = pieces_.stand_ins();
    return r;
  }

  AnyTrainer& trainer_;
  Task<Batch>& task_;
  const FitOptions& options_;
  Callbacks callbacks_;
  std::unique_ptr<DirectoryLock> lock_;  // held while this run writes into output_path (released after:)
  CheckpointManager checkpoints_;        // (destroyed first: a background write in flight completes)
  std::optional<RunLog> log_;            // made once the directory exists
  ForwardPeaks::Mark window_mark_, batch_mark_;  // the forward's records at the window's and the micro-batch's start
  PieceRunner<Batch> pieces_;            // micro-batches as pieces; the replay after out-of-memory
  std::string finished_;                 // why a callback finished training ("": it goes on); in checkpoints
  LoopState state_;
  FitResult result_;
  Metrics metrics_;         // the epoch's running sums: "Loss" and the task's metrics
  Metrics::Totals logged_;  // the sums at the last log (the next log's interval starts there)
  Metrics::Totals agreed_totals_;  // data parallel: the ranks' sums where they last agreed them (a checkpoint's)
  Agreements agreements_;   // data parallel: stops, checkpoints and sums agreed by the ranks
  std::string write_error_;        // data parallel: this rank's background write failed, until the ranks agree
  std::string background_path_;    // the checkpoint last written in the background (named by every rank)
  struct WindowSums {       // the loop's sums when the open window began (a replay puts them back)
    Metrics metrics;
    RunLog::Counts counts;
  } window_sums_, batch_sums_;  // (batch_sums_: before the current micro-batch, for replaying it alone)
  struct Held {  // a loss of terms: the open window's micro-batches, made when it opened
    FitPosition at;
    Batch batch;
  };
  std::vector<Held> held_;
  bool replaying_ = false;  // the window about to open again is a replay (its counts are the trainer's)
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
    throw std::invalid_argument("fit: FitOptions::piece_items (TRAIN.PIECE_ITEMS) needs task.split (and task.items) to make pieces");
  if (!task.terms.empty() && !task.term_items)
    throw std::invalid_argument("fit: task.terms needs task.term_items (each term's item count in a batch)");
  detail::FitLoop<Batch> loop(trainer, task, options, std::move(callbacks));
  return loop.run();
}

}  // namespace trainkit

#include <trainkit/fit/fit_checkpoints.hpp>
