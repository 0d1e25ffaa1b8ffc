#pragma once
/// The definitions of trainkit/fit/run_log.hpp (header-only: included by it; compiled mode:
/// by src/trainkit.cpp alone). See docs/design/compiled-mode.md.
#include <trainkit/fit/run_log.hpp>

namespace trainkit {

TRAINKIT_INLINE RunLog::RunLog(const FitOptions& options, AnyTrainer& trainer, bool writes, OnScalar on_scalar)
    : options_(options), trainer_(trainer), writes_(writes), on_scalar_(std::move(on_scalar)) {
  if (options_.forward_peaks()) forward_peaks_ = std::make_unique<ForwardPeaks>(trainer_.model());  // (every rank)
  if (!writes_) return;
  if (options_.text_log())
    text_log_ = std::make_unique<TextLog>(options_.output_path() + "/" + options_.prefix() + "-log.txt");
  if (options_.progress()) {
    ProgressOptions p;
    p.every_steps = options_.log_frequent();
    progress_ = std::make_unique<ProgressLine>(p);
  }
}

TRAINKIT_INLINE void RunLog::say(const std::string& text) {
  if (!writes_) return;
  if (progress_) progress_->message(text);
  else std::cerr << text << std::endl;
  if (text_log_) text_log_->line(text);
}

TRAINKIT_INLINE void RunLog::say_local(const std::string& text) {
  if (writes_) return say(text);
  std::cerr << "(rank " << trainer_.replicas().rank() << " of " << trainer_.replicas().world_size() << ") " << text
            << std::endl;
}

TRAINKIT_INLINE void RunLog::report(const std::string& text) {
  if (!writes_) return;
  if (progress_) progress_->message(text);
  if (text_log_) text_log_->line(text);
}

TRAINKIT_INLINE void RunLog::started() {
  const int world = trainer_.replicas().world_size();
  const std::string ranks = world > 1 ? std::to_string(world) + " ranks" : "";
  if (options_.seed_drawn())
    say("trainkit: RNG_SEED is -1: this run uses seed " + std::to_string(options_.seed()) +
        (world > 1 ? " on all " + ranks : "") + " (set RNG_SEED: " + std::to_string(options_.seed()) + " to repeat it)");
  if (text_log_)
    text_log_->line("start: " + trainer_.type_name() + " on " + trainer_.device().str() + (world > 1 ? " x " + ranks : "") +
                    ", epochs until " + std::to_string(options_.end_epoch()) + ", seed " + std::to_string(options_.seed()) +
                    ", pid " + std::to_string(::getpid()));
  // The memory per rank, predicted (storage/held_bytes.hpp): on the console where the stage
  // matters (several ranks), in the text log always, with every stage at other world sizes.
  const ModelSize size = trainer_.model_size();
  const StorageShape shape = trainer_.storage_shape();
  const std::string held = "trainkit: " + held_summary(size, shape, trainer_.sharding_stage(), world);
  if (world > 1) say(held);
  if (text_log_) {
    if (world == 1) text_log_->line(held);
    text_log_->line("memory per rank between optimizer steps, by world size and ZeRO stage:");
    for (const auto& line : held_table(size, shape, world)) text_log_->line(line);
  }
}

TRAINKIT_INLINE void RunLog::open(bool resumed, std::int64_t run_windows) {
  const std::int64_t step = trainer_.windows();
  skipped_at_log_ = trainer_.skipped_steps().item<std::int64_t>();  // once per run
  window_at_log_ = step;
  first_check_window_ = step + first_check;
  if (trainer_.uses_loss_scale()) scale_at_log_ = trainer_.loss_scale().item<double>();  // (once per run)
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

TRAINKIT_INLINE void RunLog::epoch_begins(std::int64_t epoch, std::int64_t index, std::int64_t batches) {
  samples_in_epoch_ = 0;
  if (progress_) progress_->update(progress_state({epoch, index, batches}));
}

TRAINKIT_INLINE void RunLog::samples(std::int64_t n) {
  if (n < 0) unit_ = "micro-batches", n = 1;  // (no item count: the micro-batch is the unit)
  samples_since_log_ += n;
  samples_in_epoch_ += n;
}

TRAINKIT_INLINE void RunLog::restore(const Counts& c) {
  samples_since_log_ = c.since_log;
  samples_in_epoch_ = c.in_epoch;
}

TRAINKIT_INLINE void RunLog::window(const StepReport& report, LogPosition at,
                                    const std::map<std::string, double>* interval) {
  ++run_windows_;
  ++windows_since_log_;
  last_report_ = report;
  if (interval == nullptr) {  // no sync: the terminal's line moves, nothing else
    if (progress_ && progress_->is_terminal()) progress_->update(progress_state(at));
    return;
  }
  const auto step = report.window();
  const double loss = interval->count("Loss") ? interval->at("Loss") : report.loss();
  forward_due_ = false;
  forward_recorded_ = forward_peaks_ != nullptr;
  forward_origin_ = forward_peaks_ ? forward_peaks_logged(at, step) : std::string();
  check_skipped({report.skipped_steps(), report.window(), report.loss_scale()}, at, loss, /*epoch_end=*/false);
  if (!trainer_.uses_loss_scale() && trainer_.options().nonfinite() == NonFinite::abort && !std::isfinite(loss))
    throw NonFiniteGradient(detail::position_text(at.epoch, at.done - 1, at.batches) + ", optimizer step " +
                            std::to_string(step) + ": non-finite training loss " + detail::short_number(loss) +
                            " (mean since the last log)");
  const double seconds = std::chrono::duration<double>(Clock::now() - clock_).count();
  const double speed = seconds > 0 ? static_cast<double>(samples_since_log_) / seconds : 0.0;
  const double per_step = seconds / static_cast<double>(windows_since_log_);
  clock_ = Clock::now();
  samples_since_log_ = 0;
  windows_since_log_ = 0;

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
  scalar(scalar_tags::seconds_per_step, per_step, step);
  last_loss_ = loss;
  last_lr_ = report.lr();
  if (trainer_.uses_loss_scale()) last_scale_ = report.loss_scale();
  if (progress_) progress_->update(progress_state(at));
  if (text_log_) {
    std::string line = detail::position_text(at.epoch, at.done - 1, at.batches) + ", optimizer step " + std::to_string(step) +
                       ": loss " + detail::short_number(loss) + ", lr " + detail::short_number(report.lr()) +
                       ", grad norm " + detail::short_number(report.grad_norm());
    if (trainer_.uses_loss_scale()) line += ", loss scale " + detail::short_number(report.loss_scale());
    line += ", skipped " + std::to_string(report.skipped_steps()) + ", " + detail::format_step_time(per_step) + ", " +
            detail::short_number(speed) + " " + unit_ + "/s";
    text_log_->line(line);
  }
}

TRAINKIT_INLINE void RunLog::validation(std::int64_t epoch, const std::map<std::string, double>& metrics) {
  std::string shown = "epoch " + std::to_string(epoch) + " validation:";
  for (const auto& [name, value] : metrics) {
    scalar(scalar_tags::validation(name), value, trainer_.windows());
    shown += " " + name + " " + detail::short_number(value);
  }
  report(shown);
}

TRAINKIT_INLINE NonFiniteGradient RunLog::unwatched_stop(const std::string& stop) const {
  return NonFiniteGradient(stop + "; where: not watched yet (trainkit watches from the first check that finds skipped "
                                  "steps: with LOG_FREQUENT below " + std::to_string(options_.nonfinite_patience()) +
                           " windows it names the modules before this stop); the checkpoints written so far are intact");
}

TRAINKIT_INLINE RunLog::~RunLog() {
  try {
    trainer_.watch_nonfinite(false);  // (a stop throws with it on: the model keeps no hook of it)
  } catch (...) {
  }
}

TRAINKIT_INLINE void RunLog::epoch_ends(LogPosition at) {
  // A stop that waited for the next window to say where, and the epoch ended first: the epoch's
  // work (validation, checkpoints, callbacks) must not run for a run that is stopping.
  if (!pending_stop_.empty()) throw unwatched_stop(std::exchange(pending_stop_, std::string()));
  // Skipped steps since the last log window are checked here too, from the epoch's last report
  // (one copy, as at a log window; the epoch's end reads the device anyway): an epoch shorter
  // than LOG_FREQUENT windows is never silent about them.
  forward_origin_.clear();  // (a log window's: no forward was recorded since)
  forward_recorded_ = false;
  if (!last_report_.empty() && last_report_.window() > window_at_log_)
    check_skipped({last_report_.skipped_steps(), last_report_.window(), last_report_.loss_scale()}, at, std::nullopt,
                  /*epoch_end=*/true);
  last_report_ = StepReport();
  if (progress_) progress_->update(progress_state(at));
}

TRAINKIT_INLINE void RunLog::paused() {
  clock_ = Clock::now();
  samples_since_log_ = 0;
  windows_since_log_ = 0;
}

TRAINKIT_INLINE void RunLog::finish(std::int64_t epoch, std::int64_t index) {
  if (!pending_stop_.empty())  // (the run ended before the window that was to say where)
    throw unwatched_stop(std::exchange(pending_stop_, std::string()));
  if (progress_) progress_->finish();
  if (text_log_)
    text_log_->line("end: at epoch " + std::to_string(epoch) + ", micro-batch " + std::to_string(index) +
                    ", optimizer step " + std::to_string(trainer_.windows()));
  if (writers_) writers_->close();  // errors of the last writes surface here, as exceptions
}

TRAINKIT_INLINE void RunLog::scalar(const std::string& tag, double value, std::int64_t step) {
  if (writers_) writers_->add_scalar(tag, value, step);
  if (on_scalar_) on_scalar_(tag, value, step);
}

TRAINKIT_INLINE void RunLog::check_skipped(const Skips& now, LogPosition at, std::optional<double> loss, bool epoch_end) {
  const std::int64_t skipped = now.skipped - skipped_at_log_, windows = now.window - window_at_log_;
  const double scale_before = scale_at_log_;
  skipped_at_log_ = now.skipped;
  window_at_log_ = now.window;
  scale_at_log_ = now.loss_scale;
  // A training loss that is not finite (the interval's mean, agreed by the ranks): the forward
  // or the loss overflowed before any gradient existed. The loss scale is not the cause, and
  // the gradients' ranking would only name the layer nearest the loss: the forward's peaks say
  // where (recorded by themselves from here on when FitOptions::forward_peaks is off).
  const bool forward_broke = loss && !std::isfinite(*loss);
  // Which parameters: counted since the diagnosis went on (below, at a check with skips that
  // are not a dynamic scale's search). Read at every check while on (the ranks alike).
  const bool watched = trainer_.watches_nonfinite();
  const std::string names = watched ? nonfinite_names(now.window) : std::string();
  const std::string ranked = forward_broke ? std::string() : names;
  const std::string named = (ranked.empty() ? std::string() : "; " + ranked) +
                            (forward_origin_.empty() ? std::string() : "; " + forward_origin_);
  const std::string intact = "; the checkpoints written so far are intact";
  if (!pending_stop_.empty())  // a stop that waited one watched window to say where: due, clean window or not
    throw NonFiniteGradient(std::exchange(pending_stop_, std::string()) + named + intact);
  if (skipped <= 0) {
    skipped_unhealthy_ = 0;
    scale_warned_ = false;
    named_ = false;
    trainer_.watch_nonfinite(false);  // (a clean interval: the diagnosis off, its hooks gone)
    if (forward_auto_) forward_peaks_.reset(), forward_auto_ = false;  // (and the forward's, if it turned them on)
    return;
  }
  const std::string where = detail::position_text(at.epoch, at.done - 1, at.batches) + ", optimizer step " +
                            std::to_string(now.window);
  const std::string what = std::to_string(skipped) + " of the last " + std::to_string(windows) +
                           " optimizer steps were skipped (non-finite gradients" +
                           (loss ? "; training loss " + detail::short_number(*loss) : std::string()) + ")";
  const std::string promise =
      forward_broke ? "; trainkit now records the forward's peaks, and names the first module whose output is not "
                      "finite at the next window"
                    : "; trainkit now watches which modules' gradients are not finite, and names them at the next "
                      "check that finds skipped steps";
  // Names said once per episode, where no warning or stop of this check carries them.
  const auto say_names = [&] {
    if (ranked.empty() || named_) return;
    named_ = true;
    say("trainkit: warning: " + where + ": " + ranked);
  };
  // FP32, BF16, a static loss scale and a dynamic one at its floor (or, with no floor, below 1,
  // where the start-up backoff from 2^16 ends): nothing backs off, so skips in a row mean a run
  // that trains nothing. So does a loss that is not finite, whatever the scale. (A dynamic
  // scale's other skips are its search for a scale: warned about below.) The scale is a float:
  // compared as one.
  const LossScaleOptions& scaling = trainer_.options().loss_scale();
  const double floor = scaling.min_scale();
  const bool dynamic = trainer_.uses_loss_scale() && trainer_.dynamic_loss_scale();
  const double lowest = std::max(floor, std::min(1.0, scaling.init_scale()));
  const bool at_floor = dynamic && static_cast<float>(now.loss_scale) <= static_cast<float>(lowest);
  if (forward_broke || !dynamic || at_floor) {
    if (forward_broke) record_forward_peaks();
    else trainer_.watch_nonfinite(true);
    // A dynamic scale that reached its floor in this interval searched on the way: those skips
    // were its backoff, the rest count (the loss not finite: every skip counts).
    skipped_unhealthy_ += dynamic && !forward_broke
                              ? std::max<std::int64_t>(0, skipped - search_skips(scale_before, now.loss_scale))
                              : skipped;
    const std::string patience = "TRAIN.NONFINITE_PATIENCE " + std::to_string(options_.nonfinite_patience());
    const std::string overflows = "and the gradient still overflows: lower TRAIN.LR, check the data, train in BF16";
    const std::string remedy =
        forward_broke ? forward_remedy()
        : at_floor && floor >= lowest
            ? "the dynamic loss scale sits at its floor " + detail::short_number(floor) +
                  " (TRAIN.FP16_MIN_LOSS_SCALE, LossScaleOptions::min_scale) " + overflows + ", or lower the floor (0: none)"
        : at_floor
            ? "the dynamic loss scale fell to " + detail::short_number(now.loss_scale) + ", below its start-up range (" +
                  detail::short_number(scaling.init_scale()) + " down to 1), " + overflows
        : trainer_.uses_loss_scale()
            ? "the static loss scale " + detail::short_number(now.loss_scale) +
                  " overflows the gradient: set TRAIN.FP16_LOSS_SCALE to a smaller one (a power of 2), or to 'dynamic', "
                  "whose scale backs off after an overflow"
            : "lower TRAIN.LR or check the data";
    // Where it went wrong is known when the gradients were watched, or, for a loss that is not
    // finite, when this interval's log window recorded the forward.
    const bool located = forward_broke ? forward_recorded_ : watched;
    if (skipped_unhealthy_ >= options_.nonfinite_patience()) {
      const std::string stop = where + ": " + what + "; " + std::to_string(skipped_unhealthy_) +
                               " skipped with no clean log interval between them (" + patience + "): stopping; " +
                               remedy;
      if (located) throw NonFiniteGradient(stop + named + intact);
      // Not located yet. At a log window one more window, watched and logged, says where, and the
      // run stops at it whatever it finds. At an epoch's end the epoch's work (validation,
      // checkpoints, callbacks) would come first: the run stops now, saying how to learn where.
      if (epoch_end) throw unwatched_stop(stop);
      pending_stop_ = stop;  // (diagnosis_due(): the loop makes the next window a log window)
      return;
    }
    if (forward_broke && !located) forward_due_ = true;  // (the next window names the module: forward_peaks_logged)
    if (!skip_warned_) {
      skip_warned_ = true;
      say("trainkit: warning: " + where + ": " + what + ". " + trainer_.type_name() +
          " skips a step only when its gradient is not finite: " + remedy + " (" + patience +
          " such steps stop the run; TRAIN.NONFINITE: abort stops at the first)" + (located ? named : promise));
      named_ = named_ || !ranked.empty();
    }
    say_names();
    return;
  }
  constexpr std::int64_t kStartup = 32;  // the scale's start-up backoff (2^16 -> 2^0 is 16 halvings)
  if (now.window <= kStartup || 4 * skipped <= windows) {  // the scale's search: nothing new to watch
    if (watched) say_names();
    return;
  }
  trainer_.watch_nonfinite(true);
  if (!scale_warned_) {
    scale_warned_ = true;
    say("trainkit: warning: " + where + ": " + what + ", past the loss scale's start-up backoff; the scale is now " +
        detail::short_number(now.loss_scale) + ". A scale that keeps falling means the gradient overflows at any "
        "scale: lower TRAIN.LR, check the data, or train in BF16" + (watched ? named : promise));
    named_ = named_ || !ranked.empty();
  }
  say_names();
}

TRAINKIT_INLINE std::int64_t RunLog::search_skips(double from, double to) const {
  const LossScaleOptions& scaling = trainer_.options().loss_scale();
  if (!(from > to) || !(to > 0)) return 0;
  const double halvings = std::log(from / to) / std::log(1.0 / scaling.backoff_factor());
  return static_cast<std::int64_t>(std::llround(halvings)) * scaling.hysteresis();
}

TRAINKIT_INLINE std::string RunLog::forward_remedy() const {
  return std::string("the training loss itself is not finite, so the forward (or the loss) overflowed before any "
                     "gradient existed: the loss scale is not the cause") +
         (trainer_.uses_loss_scale()
              ? "; in FP16 a module's output passed 65504: scale that module's input or weights down, or train in "
                "BF16 (fp32's range)"
              : "; check the data and the loss (log(0), a division by zero) and the activations' growth");
}

TRAINKIT_INLINE void RunLog::record_forward_peaks() {
  if (forward_peaks_) return;
  forward_peaks_ = std::make_unique<ForwardPeaks>(trainer_.model());  // (every rank: the loss is agreed)
  forward_auto_ = true;
}

TRAINKIT_INLINE std::string RunLog::nonfinite_names(std::int64_t step) {
  NonfiniteCounts counts = trainer_.take_nonfinite_counts();
  if (trainer_.replicas().world_size() > 1) {  // (sharded: each rank counted its slices)
    std::vector<double> windows(counts.windows.begin(), counts.windows.end());
    trainer_.replicas().all_reduce(windows, Reduce::max);
    for (size_t i = 0; i < windows.size(); ++i) counts.windows[i] = static_cast<std::int64_t>(windows[i]);
  }
  for (const auto& [module, windows] : counts.modules())
    scalar(scalar_tags::nonfinite_prefix + module, static_cast<double>(windows), step);
  return counts.text();
}

TRAINKIT_INLINE std::string RunLog::forward_peaks_logged(LogPosition at, std::int64_t step) {
  ForwardPeakTable table = forward_peaks_->take();
  if (table.missed > 0)
    say_local("trainkit: warning: forward peaks: " + std::to_string(table.missed) +
              " output(s) of this log window's forward not measured (" + table.error + ")");
  if (trainer_.replicas().world_size() > 1) trainer_.replicas().all_reduce(table.peaks, Reduce::max);
  if (!table.any()) return {};
  for (const auto& row : table.rows()) scalar(scalar_tags::forward_peak_prefix + row.module, row.peak, step);
  const std::string where = detail::position_text(at.epoch, at.done - 1, at.batches) + ", optimizer step " +
                            std::to_string(step);
  if (text_log_) text_log_->line(where + ": forward peaks: " + table.text());
  const std::string origin = table.first_nonfinite();
  if (origin.empty()) {
    forward_warned_ = false;
    return {};
  }
  const std::string what = "the forward's output is first not finite in " + origin;
  if (!forward_warned_) {
    forward_warned_ = true;
    say("trainkit: warning: " + where + ": " + what +
        " (every module after it receives it; in half precision its output passed the dtype's range: train in BF16, "
        "or scale down what that module receives)");
  }
  return what;
}

TRAINKIT_INLINE ProgressState RunLog::progress_state(LogPosition at) const {
  const std::int64_t n = trainer_.window_length();
  ProgressState p;
  p.epoch = at.epoch;
  p.epochs = options_.end_epoch();
  p.step = (at.done + n - 1) / n;
  p.total = (at.batches + n - 1) / n;
  p.run_step = run_windows_;
  p.run_total = std::max(run_total_, run_windows_);
  p.samples = samples_in_epoch_;
  p.unit = unit_;
  p.loss = last_loss_;
  p.lr = last_lr_;
  p.loss_scale = last_scale_;
  return p;
}

}  // namespace trainkit
