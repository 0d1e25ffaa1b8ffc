#pragma once
/// The fit loop's checkpoints (FitLoop, fit.hpp): where a run resumes (TRAIN.RESUME,
/// AUTO_RESUME: the newest checkpoint that loads, its configuration and world size checked
/// first), what a run with nothing left to train says, and the checkpoints it writes (the main
/// rank's files, every rank's slices of a set, background writes checked at each micro-batch,
/// and data parallel a failed one agreed by every rank at the next agreement or checkpoint).
/// Included by fit.hpp after the loop's class.
#include <trainkit/fit/fit.hpp>

namespace trainkit::detail {

template <class Batch>
FitPosition FitLoop<Batch>::resume() {
  const FitPosition begin{options_.begin_epoch(), 0};
  if (!options_.resume() && !options_.auto_resume()) return begin;
  std::optional<CheckpointManager::Opened> opened;
  const bool named = options_.resume() && options_.begin_epoch() > 0;
  if (named) {
    opened = checkpoints_.open(checkpoints_.epoch_path(options_.begin_epoch() - 1));
  } else {
    opened = checkpoints_.open_newest();
    if (!opened && options_.resume())
      throw std::runtime_error("TRAIN.RESUME: no complete checkpoint '" + options_.prefix() + "-*.ckpt' in '" +
                               options_.output_path() + "' to resume from");
  }
  std::vector<std::string> without;  // callbacks the checkpoint has no state for
  while (opened) {
    check_resume_changes(opened->state.config_json, opened->path);  // before anything changes
    check_world_size(opened->state, opened->path);
    try {
      without = checkpoints_.restore(*opened, trainer_, callbacks_.state);
      break;
    } catch (const detail::DamagedArchive& e) {
      // Damage found as the state was read (a set's piece; every rank learns it in the load):
      // the trainer is as it was, and every rank goes back to the previous checkpoint alike.
      if (named) throw;
      say("trainkit: skipping checkpoint '" + opened->path + "': " + detail::first_line_of(e) + "; trying the previous one");
      opened = checkpoints_.open_newest(std::cerr, opened->path);
    }
  }
  if (!opened && options_.resume())
    throw std::runtime_error("TRAIN.RESUME: no checkpoint in '" + options_.output_path() + "' loads (each damaged one "
                             "is said above)");
  if (!opened) return begin;
  const LoopState& saved = opened->state;
  for (const auto& name : without)
    say("trainkit: the checkpoint has no state for the callback '" + name + "' (written without it): it starts afresh");
  if (terms() && trainer_.window_position() > 0 && !trainer_.window_has_terms())
    throw std::runtime_error("fit: '" + opened->path + "' was written inside a window (PARTIAL_WINDOW: span) whose loss "
                             "was one value, and this task's loss is terms (task.terms): the window's gradient cannot go "
                             "on with them. Resume from a checkpoint at a window's boundary, or set TRAIN.PARTIAL_WINDOW: flush");
  finished_ = saved.finished;
  // The last epoch's means and validation, as the run that wrote it reported them (a run
  // with nothing left to train reports these).
  result_.train = state_.train = saved.train;
  result_.validation = state_.validation = saved.validation;
  pieces_.resume_with(saved.piece_items);
  metrics_ = saved.metrics;
  logged_ = agreed_totals_ = saved.logged;
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

template <class Batch>
bool FitLoop<Batch>::nothing_to_train(FitPosition start) {
  if (!finished_.empty()) {
    result_.finished = true;
    result_.message = "trainkit: nothing to train: the run in '" + options_.output_path() + "' finished at epoch " +
                      std::to_string(start.epoch) + " (" + finished_ + "; '" + result_.resumed_from +
                      "' is marked finished); start afresh in another directory (--model-dir)";
    say(result_.message);
    return true;
  }
  if (!result_.resumed_from.empty() && start.epoch >= options_.end_epoch()) {
    result_.message = "trainkit: nothing to train: '" + result_.resumed_from + "' is at epoch " +
                      std::to_string(start.epoch) + " and TRAIN.END_EPOCH is " + std::to_string(options_.end_epoch()) +
                      "; raise TRAIN.END_EPOCH to train on, or start afresh in another directory (--model-dir)";
    say(result_.message);
  }
  return false;
}

template <class Batch>
std::int64_t FitLoop<Batch>::windows_from(FitPosition start) const {
  const std::int64_t n = trainer_.window_length();
  std::int64_t total = 0;
  for (std::int64_t epoch = start.epoch; epoch < options_.end_epoch(); ++epoch)
    total += (task_.batches_per_epoch(epoch) + n - 1) / n - (epoch == start.epoch ? start.index / n : 0);
  return total;
}

template <class Batch>
void FitLoop<Batch>::write_checkpoint(bool epoch_end) {
  // (every rank: the previous background write, complete or failed on any rank)
  if (options_.background_checkpoints()) {
    background_agreed(/*wait=*/true);
    background_path_ = epoch_end ? checkpoints_.epoch_path(state_.position.epoch - 1)
                                 : checkpoints_.position_path(state_.position);
  }
  if (!saves()) {
    // A sharded update in one file: every rank sends its slices to the main rank's archive.
    if (options_.write_files() && trainer_.saves_collectively()) {
      torch::serialize::OutputArchive discarded;
      trainer_.save(discarded);
    }
    return;
  }
  // The loop's running sums, so that a resumed epoch's means and logs equal the straight
  // run's. Data parallel, inside an epoch: the mean over the ranks of their running sums,
  // which the log window (or agreement) this checkpoint follows has just computed
  // (agreed_totals_; logged_, where the log interval resumes, is saved too). Every rank
  // resumes with it, and every later mean over the ranks is then the uninterrupted run's.
  state_.finished = finished_;
  state_.piece_items = pieces_.piece_items();
  state_.world_size = trainer_.replicas().world_size();
  state_.total_batch = options_.total_batch();
  state_.metrics = !single() && state_.position.index > 0 ? Metrics::from_totals(agreed_totals_) : metrics_;
  state_.logged = logged_;
  try {
    if (options_.background_checkpoints()) {
      result_.checkpoints.push_back(checkpoints_.save_in_background(trainer_, state_, epoch_end, callbacks_.state));
    } else {
      result_.checkpoints.push_back(checkpoints_.save(trainer_, state_, epoch_end, callbacks_.state));
      log_->report("checkpoint '" + result_.checkpoints.back() + "' written");
    }
  } catch (const CheckpointError& e) {
    throw CheckpointError("at epoch " + std::to_string(state_.position.epoch) + ", micro-batch " +
                          std::to_string(state_.position.index) + " (optimizer step " +
                          std::to_string(trainer_.windows()) + "): " + e.what());
  }
}

template <class Batch>
void FitLoop<Batch>::background_checked(bool wait) {
  std::optional<CheckpointManager::Written> done;
  try {
    done = wait ? checkpoints_.wait_background() : checkpoints_.background_done();
  } catch (const CheckpointError& e) {
    const std::string error = "at epoch " + std::to_string(state_.position.epoch) + " (optimizer step " +
                              std::to_string(trainer_.windows()) + "): " + e.what();
    if (single()) throw CheckpointError(error);
    if (write_error_.empty()) write_error_ = error;  // (the ranks agree at their next agreement)
    return;
  }
  if (done)
    log_->report("checkpoint '" + done->path + "' written (" + detail::short_number(static_cast<double>(done->bytes) / (1 << 20)) +
                 " MiB in " + detail::short_number(done->seconds) + " s, in the background)");
}

template <class Batch>
void FitLoop<Batch>::background_agreed(bool wait) {
  if (saves()) background_checked(wait);
  // (not on write_files: a rank that writes nothing, FitOptions::write_files(false) on ranks
  // other than 0, still takes part, with no failure of its own)
  if (single() || !options_.background_checkpoints()) return;
  const std::int64_t failed = trainer_.replicas().count_failures({!write_error_.empty()})[0];
  if (failed > 0) write_failed_everywhere(failed - (write_error_.empty() ? 0 : 1));
}

template <class Batch>
void FitLoop<Batch>::write_failed_everywhere(std::int64_t others) {
  checkpoints_.cancel_background();
  if (!write_error_.empty()) throw CheckpointError(write_error_);
  const std::string at =
      "at epoch " + std::to_string(state_.position.epoch) + " (optimizer step " + std::to_string(trainer_.windows()) + "): ";
  // (one file: the main rank's, in its own directory, which this rank may not know)
  if (!checkpoints_.writes_set(trainer_))
    throw CheckpointError(at + "the main rank could not write its checkpoint in the background (it says why, naming "
                          "the file); the checkpoints before it are intact");
  throw CheckpointError(at + "checkpoint '" + background_path_ + "' was not written: " + std::to_string(others) +
                        " other rank(s) could not write their part in the background (each says why); the "
                        "checkpoints before it are intact");
}

template <class Batch>
void FitLoop<Batch>::check_resume_changes(const std::string& saved_json, const std::string& path) {
  if (saved_json.empty() || options_.config_json().empty()) return;  // not written from a configuration
  const auto changes = resume_changes(saved_json, options_.config_json());
  if (changes.empty()) return;
  std::string listed;
  for (const auto& c : changes) listed += "\n  " + c.key + ": " + c.before + " -> " + c.after;
  if (!options_.allow_resume_changes())
    throw ConfigError("TRAIN.RESUME_CHANGES", "the checkpoint '" + path + "' was written with another configuration, and these keys change "
                                                  "the training trajectory (checkpoint -> this run):" + listed +
                                                  "\nResume with the checkpoint's values, start in a new directory (--model-dir), or set "
                                                  "TRAIN.RESUME_CHANGES: allow (--set TRAIN.RESUME_CHANGES=allow) to continue with this run's");
  say("trainkit: resuming with a changed configuration (TRAIN.RESUME_CHANGES: allow), checkpoint -> this run:" + listed);
}

template <class Batch>
void FitLoop<Batch>::check_world_size(const LoopState& saved, const std::string& path) {
  const std::int64_t world = trainer_.replicas().world_size();
  if (saved.world_size <= 0 || saved.world_size == world) return;
  const std::string by = "'" + path + "' was written by " + std::to_string(saved.world_size) + " process" +
                         (saved.world_size > 1 ? "es" : "") + ", this run has " + std::to_string(world);
  if (saved.total_batch > 0 && options_.total_batch() > 0 && saved.total_batch != options_.total_batch())
    throw ConfigError("TRAIN.TARGET_BATCH",
                      by + ", and its total batch was " + std::to_string(saved.total_batch) + " samples per optimizer "
                      "step where this run's is " + std::to_string(options_.total_batch()) + " (world size x "
                      "BATCH_IMAGES x GRAD_ACCUMULATE_STEPS); set TRAIN.TARGET_BATCH: " + std::to_string(saved.total_batch) +
                      " to keep it (the batch per process is then derived), or start a new run");
  // The total batch, when both runs know it (a configuration's RunPlan, or FitOptions::total_batch):
  // kept (checked above). From C++ without it, each process trains what its task gives.
  const std::string batch =
      saved.total_batch > 0 && options_.total_batch() > 0
          ? "the total batch of " + std::to_string(saved.total_batch) + " samples per optimizer step is kept"
          : "each process trains the micro-batches its task gives, so the samples per optimizer step are this run's "
            "(FitOptions::total_batch, set in both runs, has them checked)";
  say("trainkit: " + by + "; " + batch + ", the data go on at the checkpoint's micro-batch, and " +
      (world > 1 ? "each process draws its random numbers by position as a run of " + std::to_string(world) +
                       " processes does"
                 : "the random generators continue from the checkpoint's (the main rank's)"));
}

}  // namespace trainkit::detail
