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
///   samples(n)                     n more samples trained (speed, progress); counts() and
///                                  restore() put them back for a replayed window
///   window(report, position, interval)
///                                  after each optimizer window; `interval` (the means since the
///                                  last log window) only at log windows: then it logs, checks
///                                  health (throws NonFiniteGradient when it is time to stop)
///   validation(epoch, metrics)     after a validation (the metrics agreed over the ranks)
///   epoch_ends(position), paused() between epochs (validation and checkpoints are not
///                                  training time)
///   say(text), report(text)        a message for the user / a line of the run's record
///   finish(epoch, index)           once, at the end (errors of the last writes surface here)
#include <trainkit/any_trainer.hpp>
#include <trainkit/detail/messages.hpp>
#include <trainkit/fit_options.hpp>
#include <trainkit/log/progress.hpp>
#include <trainkit/log/scalars.hpp>
#include <trainkit/log/tensorboard.hpp>
#include <trainkit/log/text_log.hpp>
#include <trainkit/optim.hpp>
#include <trainkit/options.hpp>
#include <trainkit/step_report.hpp>

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

  RunLog(const FitOptions& options, const AnyTrainer& trainer, bool writes, OnScalar on_scalar)
      : options_(options), trainer_(trainer), writes_(writes), on_scalar_(std::move(on_scalar)) {
    if (!writes_) return;
    if (options_.text_log())
      text_log_ = std::make_unique<TextLog>(options_.output_path() + "/" + options_.prefix() + "-log.txt");
    if (options_.progress()) {
      ProgressOptions p;
      p.every_steps = options_.log_frequent();
      progress_ = std::make_unique<ProgressLine>(p);
    }
  }

  /// A line for the user (the writing rank only), below the progress line when there is one,
  /// and in the text log.
  void say(const std::string& text) {
    if (!writes_) return;
    if (progress_) progress_->message(text);
    else std::cerr << text << std::endl;
    if (text_log_) text_log_->line(text);
  }
  /// A line of the run's record (a validation, a checkpoint): below the progress line when there
  /// is one (not on stderr without one), and in the text log.
  void report(const std::string& text) {
    if (!writes_) return;
    if (progress_) progress_->message(text);
    if (text_log_) text_log_->line(text);
  }

  /// The run's start: the seed when it was drawn, the trainer, the device and the ranks.
  void started() {
    const int world = trainer_.replicas().world_size();
    const std::string ranks = world > 1 ? std::to_string(world) + " ranks" : "";
    if (options_.seed_drawn())
      say("trainkit: RNG_SEED is -1: this run uses seed " + std::to_string(options_.seed()) +
          (world > 1 ? " on all " + ranks : "") + " (set RNG_SEED: " + std::to_string(options_.seed()) + " to repeat it)");
    if (text_log_)
      text_log_->line("start: " + trainer_.type_name() + " on " + trainer_.device().str() + (world > 1 ? " x " + ranks : "") +
                      ", epochs until " + std::to_string(options_.end_epoch()) + ", seed " + std::to_string(options_.seed()) +
                      ", pid " + std::to_string(::getpid()));
  }

  /// The scalar logs, continued from where training continues (the trainer's step): a run
  /// stopped after its last checkpoint logged points that the resumed run logs again, so the
  /// JSON lines past that step are cut, and TensorBoard is told to hide them (a session
  /// start). Also where the health checks and the run's ETA count from: `run_windows` optimizer
  /// windows lie ahead.
  void open(bool resumed, std::int64_t run_windows) {
    const std::int64_t step = trainer_.windows();
    skipped_at_log_ = trainer_.skipped_steps().item<std::int64_t>();  // once per run
    window_at_log_ = step;
    run_total_ = run_windows;
    clock_ = Clock::now();
    if (!writes_) return;
    const std::string jsonl = options_.output_path() + "/" + options_.prefix() + "-scalars.jsonl";
    if (const std::size_t dropped = drop_points_after(jsonl, step))
      say("trainkit: dropped " + std::to_string(dropped) + " line(s) past optimizer step " + std::to_string(step) +
          " from '" + jsonl + "' (" +
          (resumed ? "logged after the checkpoint: training continues from it"
                   : "an earlier run's: this run starts afresh in the directory") + ")");
    writers_ = std::make_unique<ScalarFanout>();
    writers_->emplace<TensorBoardWriter>(options_.output_path() + "/tensorboard").session_start(step + 1);
    writers_->emplace<JsonlScalarWriter>(jsonl);
  }

  void epoch_begins(std::int64_t epoch, std::int64_t index, std::int64_t batches) {
    samples_in_epoch_ = 0;
    if (progress_) progress_->update(progress_state({epoch, index, batches}));
  }
  void samples(std::int64_t n) {
    samples_since_log_ += n;
    samples_in_epoch_ += n;
  }
  /// The sample counts, to put back when a window is replayed from its start.
  struct Counts {
    std::int64_t since_log = 0, in_epoch = 0;
  };
  Counts counts() const { return {samples_since_log_, samples_in_epoch_}; }
  void restore(const Counts& c) {
    samples_since_log_ = c.since_log;
    samples_in_epoch_ = c.in_epoch;
  }

  /// After an optimizer window; `interval` at log windows only (see the file comment).
  void window(const StepReport& report, LogPosition at, const std::map<std::string, double>* interval) {
    ++run_windows_;
    if (interval == nullptr) {  // no sync: the terminal's line moves, nothing else
      if (progress_ && progress_->is_terminal()) progress_->update(progress_state(at));
      return;
    }
    const auto step = report.window();
    const double loss = interval->count("Loss") ? interval->at("Loss") : report.loss();
    check_skipped(report, at, loss);
    if (!trainer_.uses_loss_scale() && trainer_.options().nonfinite() == NonFinite::abort && !std::isfinite(loss))
      throw NonFiniteGradient(detail::position_text(at.epoch, at.done - 1, at.batches) + ", optimizer step " +
                              std::to_string(step) + ": non-finite training loss " + detail::short_number(loss) +
                              " (mean since the last log)");
    const double seconds = std::chrono::duration<double>(Clock::now() - clock_).count();
    const double speed = seconds > 0 ? static_cast<double>(samples_since_log_) / seconds : 0.0;
    clock_ = Clock::now();
    samples_since_log_ = 0;

    scalar(scalar_tags::train_loss, loss, step);
    for (const auto& [name, value] : *interval)
      if (name != "Loss") scalar("Train-" + name, value, step);
    const auto& groups = trainer_.groups();
    for (size_t g = 0; g < groups.size(); ++g) {
      scalar(scalar_tags::initial_lr_group(g), trainer_.base_lr() * groups[g].lr_mult, step);
      scalar(scalar_tags::lr_group(g), report.lr() * groups[g].lr_mult, step);
    }
    scalar(scalar_tags::grad_norm, report.grad_norm(), step);
    scalar(scalar_tags::loss_scale, report.loss_scale(), step);
    scalar(scalar_tags::skipped_steps, static_cast<double>(report.skipped_steps()), step);
    scalar(scalar_tags::samples_per_second, speed, step);
    last_loss_ = loss;
    last_lr_ = report.lr();
    if (trainer_.uses_loss_scale()) last_scale_ = report.loss_scale();
    if (progress_) progress_->update(progress_state(at));
    if (text_log_) {
      std::string line = detail::position_text(at.epoch, at.done - 1, at.batches) + ", optimizer step " + std::to_string(step) +
                         ": loss " + detail::short_number(loss) + ", lr " + detail::short_number(report.lr()) +
                         ", grad norm " + detail::short_number(report.grad_norm());
      if (trainer_.uses_loss_scale()) line += ", loss scale " + detail::short_number(report.loss_scale());
      line += ", skipped " + std::to_string(report.skipped_steps()) + ", " + detail::short_number(speed) + " samples/s";
      text_log_->line(line);
    }
  }

  /// A validation's metrics, logged at the trainer's step and shown.
  void validation(std::int64_t epoch, const std::map<std::string, double>& metrics) {
    std::string shown = "epoch " + std::to_string(epoch) + " validation:";
    for (const auto& [name, value] : metrics) {
      scalar(scalar_tags::validation(name), value, trainer_.windows());
      shown += " " + name + " " + detail::short_number(value);
    }
    report(shown);
  }

  /// The epoch's line ends complete.
  void epoch_ends(LogPosition at) {
    if (progress_) progress_->update(progress_state(at));
  }
  /// Validation and checkpoints are not training time.
  void paused() {
    clock_ = Clock::now();
    samples_since_log_ = 0;
  }

  void finish(std::int64_t epoch, std::int64_t index) {
    if (progress_) progress_->finish();
    if (text_log_)
      text_log_->line("end: at epoch " + std::to_string(epoch) + ", micro-batch " + std::to_string(index) +
                      ", optimizer step " + std::to_string(trainer_.windows()));
    if (writers_) writers_->close();  // errors of the last writes surface here, as exceptions
  }

 private:
  using Clock = std::chrono::steady_clock;

  void scalar(const std::string& tag, double value, std::int64_t step) {
    if (writers_) writers_->add_scalar(tag, value, step);
    if (on_scalar_) on_scalar_(tag, value, step);
  }

  // Skipped optimizer steps, seen at log windows from the report's counters (no sync of their
  // own). FP32/BF16 skip only on a non-finite gradient, never in a healthy run: the first skip
  // is a warning, and nonfinite_patience skips with no clean log interval between them stop the
  // run (on every rank: the counters agree). FP16's loss scale backs off by skipping: after the
  // start-up backoff, a log interval with more than a quarter of its steps skipped is reported
  // with the scale, once until an interval is clean again.
  void check_skipped(const StepReport& report, LogPosition at, double loss) {
    const std::int64_t skipped = report.skipped_steps() - skipped_at_log_, windows = report.window() - window_at_log_;
    skipped_at_log_ = report.skipped_steps();
    window_at_log_ = report.window();
    if (skipped <= 0) {
      skipped_unhealthy_ = 0;
      scale_warned_ = false;
      return;
    }
    const std::string where = detail::position_text(at.epoch, at.done - 1, at.batches) + ", optimizer step " +
                              std::to_string(report.window());
    const std::string what = std::to_string(skipped) + " of the last " + std::to_string(windows) +
                             " optimizer steps were skipped (non-finite gradients; training loss " +
                             detail::short_number(loss) + ")";
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
          detail::short_number(report.loss_scale()) + ". A scale that keeps falling means the gradient overflows at any "
          "scale: lower TRAIN.LR, check the data, or train in BF16");
    }
  }

  // The progress line counts optimizer windows inside the epoch, and in the whole run; the
  // loss, LR and scale are the last log window's.
  ProgressState progress_state(LogPosition at) const {
    const std::int64_t n = trainer_.window_length();
    ProgressState p;
    p.epoch = at.epoch;
    p.epochs = options_.end_epoch();
    p.step = (at.done + n - 1) / n;
    p.total = (at.batches + n - 1) / n;
    p.run_step = run_windows_;
    p.run_total = std::max(run_total_, run_windows_);
    p.samples = samples_in_epoch_;
    p.loss = last_loss_;
    p.lr = last_lr_;
    p.loss_scale = last_scale_;
    return p;
  }

  const FitOptions& options_;
  const AnyTrainer& trainer_;
  bool writes_;
  OnScalar on_scalar_;
  std::unique_ptr<ScalarFanout> writers_;  // TensorBoard events and JSON lines
  std::unique_ptr<ProgressLine> progress_;
  std::unique_ptr<TextLog> text_log_;      // <output_path>/<prefix>-log.txt
  std::int64_t skipped_at_log_ = 0, window_at_log_ = 0;  // the counters at the last log (check_skipped)
  std::int64_t skipped_unhealthy_ = 0;                   // FP32/BF16 skips since a clean interval
  bool skip_warned_ = false, scale_warned_ = false;
  std::int64_t run_windows_ = 0, run_total_ = 0;  // this run's optimizer windows: done, all (progress ETA)
  std::optional<double> last_loss_;               // the last log window's, for the progress line
  double last_lr_ = std::numeric_limits<double>::quiet_NaN(), last_scale_ = std::numeric_limits<double>::quiet_NaN();
  Clock::time_point clock_ = Clock::now();
  std::int64_t samples_since_log_ = 0, samples_in_epoch_ = 0;
};

}  // namespace trainkit
