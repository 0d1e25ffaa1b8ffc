#pragma once
/// AnyTrainer: every compiled Trainer<P, A, C> seen through one interface, so that the code
/// around the step (the fit loop, checkpoints, logs, an application's driver) compiles once
/// instead of once per trainer type. The step itself stays compiled per configuration: a
/// micro-step through AnyTrainer is one virtual call into Trainer<P, A, C>'s own micro_step,
/// whose phases have no branch on a policy.
///
///   std::unique_ptr<tk::AnyTrainer> trainer = tk::make_trainer(tk::RunPlan::from(config), model);  // plan.hpp
///   auto r = trainer->micro_step([&] { return loss_of(model, batch); }, batch.size());
///   if (r.window_closed) log(r.report);
///   trainer->flush();
///
/// Contract — what an implementation guarantees (Trainer<P, A, C> is the only one):
///   run_micro_step(loss, items)  exactly Trainer::micro_step(loss[, items]) (items < 0: none);
///                                the loss closure runs inside the precision region
///   run_micro_step_pieces        exactly Trainer::micro_step_pieces
///   begin_window, flush, discard_window, set_schedule, on_epoch_end, set_replicas
///                                exactly the Trainer members of the same names
///   save(archive), load(archive, source)
///                                every record of the training state; load checks what it can
///                                before changing anything (type, optimizer, shapes)
///   restore(snapshot)            a snapshot of this trainer's own save() back, with no checks
///                                and no collectives (the rollback of a failed load)
///   type_name()                  Trainer<P, A, C>::name(), the name checkpoints record
///   window_length()              micro-batches per window (AccumulationPolicy's N, or the
///                                run-time count of AccumulationPolicy<Dynamic>)
///   autocast_dtype()             the dtype of the forward's autocast region; none for FP32
/// Costs: one indirect call and one std::function call per micro-step (nanoseconds against a
/// forward and backward); nothing per optimizer phase beyond what Trainer does.
#include <trainkit/archive/checkpoint_io.hpp>
#include <trainkit/archive/checkpoint_set.hpp>
#include <trainkit/step/options.hpp>
#include <trainkit/step/precision.hpp>
#include <trainkit/step/replicas.hpp>
#include <trainkit/step/schedule.hpp>
#include <trainkit/step/step_report.hpp>
#include <trainkit/storage/held_bytes.hpp>
#include <trainkit/trainer/nonfinite_watch.hpp>

#include <torch/nn/module.h>
#include <torch/serialize/archive.h>
#include <torch/types.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace trainkit {

namespace detail {
struct ParamGroup;
}  // namespace detail

/// See the file comment. Not copyable; held by reference or std::unique_ptr.
class AnyTrainer {
 public:
  /// The forward of one micro-batch: returns the loss as a scalar tensor.
  using LossClosure = std::function<torch::Tensor()>;

  AnyTrainer() = default;
  AnyTrainer(const AnyTrainer&) = delete;
  AnyTrainer& operator=(const AnyTrainer&) = delete;
  virtual ~AnyTrainer() = default;

  // --- the step -----------------------------------------------------------------------------
  /// Trainer::micro_step(closure).
  MicroStepResult micro_step(const LossClosure& loss) { return run_micro_step(loss, -1); }
  /// Trainer::micro_step(closure, items): the window's gradient is the mean over its items.
  MicroStepResult micro_step(const LossClosure& loss, std::int64_t items);
  /// The forward of piece j of a micro-batch (micro_step_pieces): returns its loss.
  using PieceLoss = std::function<torch::Tensor(std::int64_t)>;
  /// Trainer::micro_step_pieces(loss, items): one micro-batch as pieces of items[j] items.
  MicroStepResult micro_step_pieces(const PieceLoss& loss, const std::vector<std::int64_t>& items);
  /// Trainer::begin_window(items, micro_batches): the next window's loss is terms, term t
  /// having items[t] items in this rank's `micro_batches` micro-batches of the window (-1: the
  /// window's length); each micro-step's loss is then the terms' sums, one value per term.
  virtual void begin_window(const std::vector<std::int64_t>& items, std::int64_t micro_batches = -1) = 0;
  /// Whether the open window's loss is terms (a window begun with begin_window).
  virtual bool window_has_terms() const = 0;
  /// Whether each micro-batch's gradient leaves for the other ranks when it ends (a sharded
  /// gradient, Sharding::gradients, with several ranks): a micro-batch that fails is then
  /// replayed alone (discard_micro_batch), the window's earlier ones being summed already.
  virtual bool reduces_each_micro_batch() const = 0;
  /// Trainer::discard_micro_batch(): the micro-batch that failed (out of memory) forgotten,
  /// the window's earlier micro-batches kept.
  virtual void discard_micro_batch() = 0;
  /// Trainer::discard_window(): the open window's gradient and counts dropped.
  virtual void discard_window() = 0;
  /// End of epoch: the partial window by TrainerOptions::partial_window
  /// (docs/design/optimizer-phase.md).
  virtual std::optional<StepReport> flush() = 0;

  // --- what it is ----------------------------------------------------------------------------
  /// "Trainer<FP16Dynamic, Accumulate<Dynamic>, ClipNorm>": the compiled type behind this one.
  virtual std::string type_name() const = 0;
  /// Whether the loss is multiplied by a loss scale (FP16 modes).
  virtual bool uses_loss_scale() const = 0;
  /// Whether the loss scale backs off after an overflow (FP16Dynamic); a static one (FP16Static)
  /// overflows alike every time, so its skips stop a run as FP32's do (TRAIN.NONFINITE_PATIENCE),
  /// and so do a dynamic one's at its floor (LossScaleOptions::min_scale).
  virtual bool dynamic_loss_scale() const = 0;
  /// The overflow diagnosis (nonfinite_watch.hpp): while on, each optimizer phase counts, per
  /// trainable parameter, the windows whose gradient was not finite there (a few ATen calls per
  /// phase; off, none). The fit loop turns it on after a log window with skipped steps.
  virtual void watch_nonfinite(bool on) = 0;
  virtual bool watches_nonfinite() const = 0;
  /// What the diagnosis counted since the last call (one host read; this rank's slices where
  /// sharded), then zero. All zero while off.
  virtual NonfiniteCounts take_nonfinite_counts() = 0;
  /// The optimizer's LR before the schedule's factor (a group's is this times its LR_MULT).
  virtual double base_lr() const = 0;
  /// Micro-batches per window.
  virtual std::int64_t window_length() const = 0;
  /// The autocast dtype of the forward (bf16, fp16); std::nullopt for FP32.
  virtual std::optional<at::ScalarType> autocast_dtype() const = 0;
  virtual const TrainerOptions& options() const = 0;
  virtual torch::nn::Module& model() = 0;
  virtual torch::Device device() const = 0;
  virtual const std::vector<detail::ParamGroup>& groups() const = 0;

  /// The precision region of the forward as an RAII guard, for code that runs the model outside
  /// micro_step (validation): `{ auto region = trainer.precision_region(); model(x); }`.
  std::optional<AutocastRegion> precision_region() const;

  // --- schedule and replicas -----------------------------------------------------------------
  virtual void set_schedule(std::shared_ptr<Schedule> schedule) = 0;
  virtual void schedule_changed() = 0;
  virtual const Schedule& schedule() const = 0;
  virtual bool on_epoch_end(std::int64_t epoch, double metric) = 0;
  virtual void set_replicas(std::shared_ptr<Replicas> replicas) = 0;
  virtual Replicas& replicas() = 0;
  virtual const Replicas& replicas() const = 0;

  // --- state -------------------------------------------------------------------------------
  /// Optimizer phases run (applied + skipped); host value, no sync.
  virtual std::int64_t windows() const = 0;
  /// Micro-batches in the current, open window.
  virtual std::int64_t window_position() const = 0;
  /// Applied and skipped optimizer steps, the loss scale: device scalars (`.item()` syncs).
  virtual const torch::Tensor& applied_steps() const = 0;
  virtual const torch::Tensor& skipped_steps() const = 0;
  virtual const torch::Tensor& loss_scale() const = 0;
  /// The optimizer's state allocated now (zeros), as the first optimizer phase would allocate
  /// it: memory measured before that phase then counts it (the fit loop's memory plan). Returns
  /// false where that cannot be done: the state of a torch::optim optimizer (tk::TorchOptimizer)
  /// is that optimizer's own and appears at its first step.
  virtual bool allocate_optimizer_state() = 0;
  /// The gradient's memory allocated now (zeros) where it is released between windows
  /// (Sharding::gradients): a backward outside micro_step (the memory plan's measurement)
  /// accumulates into it, and discard_window() releases it again.
  virtual void allocate_gradient() = 0;
  /// One forward+backward of `loss` as a micro-step runs it (the precision's region and loss
  /// scale; ZeRO stage 3: each unit gathered for its forward and backward and its gradient
  /// reduce-scattered, so every rank calls it alike), its gradient then dropped: the window,
  /// the parameters, the optimizer's state and the step counters are as they were (the units'
  /// gather statistics count it). The memory plan's measurement at stage 3, where a forward
  /// outside the step finds the units' parameters released. Between windows. When it throws
  /// after a unit's reduction has left (overlapped, several ranks), the trainer cannot go on.
  virtual void trial_backward(const LossClosure& loss) = 0;

  /// The whole training state as records of `archive` (Trainer::save). When
  /// saves_collectively() (a sharded update), every rank must call it: the main rank's archive
  /// receives every rank's part.
  virtual void save(torch::serialize::OutputArchive& archive) const = 0;
  virtual bool saves_collectively() const { return false; }
  /// Whether the model's units' parameters are sharded over the ranks (ZeRO stage 3): each
  /// forward and backward then gathers them in step on every rank.
  virtual bool shards_parameters() const { return false; }
  /// With shards_parameters(): `true` gathers every unit's parameters (one all-gather per unit;
  /// every rank calls it) and keeps them until `false`, so that forwards in between make no
  /// collective (a weights export; FitOptions::validate_by_unit false); a load in between is
  /// refused (the held copies would keep the old values). Otherwise nothing.
  virtual void hold_parameters(bool) {}
  /// With shards_parameters(): between `true` and `false` (every rank calls both; `false` is a
  /// collective), forwards outside the step under torch::NoGradGuard gather each unit for its
  /// call and release it after, so that a rank holds one unit at a time: the ranks' forwards
  /// may differ in number (a rank done early gathers with the others until every rank is, at
  /// `false` or at a Replicas::all_reduce in between: any other collective of its own there
  /// would meet their gathers), but call the units in one order. The fit loop's validation runs
  /// so (FitOptions::validate_by_unit). Otherwise nothing.
  virtual void evaluate_by_unit(bool) {}
  /// The model as predict_held (storage/held_bytes.hpp) sees it, and how this trainer stores it:
  /// with held_table(model_size(), storage_shape(), world), the bytes per rank of every stage.
  virtual ModelSize model_size() const = 0;
  virtual StorageShape storage_shape() const = 0;
  /// predict_held for this trainer's stage over its replicas (one rank: stage 0's).
  virtual HeldBytes predicted_held() const = 0;
  virtual int sharding_stage() const = 0;
  /// The bytes of every tensor this trainer holds now, each storage counted once: the model's
  /// parameters and gradients, the storage's buffers and the optimizer's flat state. Between
  /// optimizer steps it is what predicted_held().total() predicts.
  virtual std::int64_t held_bytes() const = 0;
  /// This rank's state as it holds it, without collectives (the rollback of a failed load).
  virtual void snapshot(torch::serialize::OutputArchive& archive) const { save(archive); }
  /// The state from `archive`, opened from `source` (named in errors): Trainer::load.
  virtual void load(torch::serialize::InputArchive& archive, const std::string& source) = 0;
  /// A snapshot() of this trainer back, unchecked (the rollback of a load).
  virtual void restore(torch::serialize::InputArchive& snapshot) = 0;

  /// The state written to `path` atomically (a temporary file in the same directory, flushed,
  /// renamed): a crash never leaves a partial file under that name. Sharded, every rank calls
  /// it and the main rank writes the file.
  void save(const std::string& path) const;
  /// The state read from `path` (its CRCs checked). Changes nothing when it fails: a mismatch
  /// is refused before anything changes, and a later failure puts the previous state back.
  void load(const std::string& path);

 protected:
  /// The compiled micro-step; items < 0 means no item count.
  virtual MicroStepResult run_micro_step(const LossClosure& loss, std::int64_t items) = 0;
  virtual MicroStepResult run_micro_step_pieces(const PieceLoss& loss, const std::vector<std::int64_t>& items) = 0;
};

inline MicroStepResult AnyTrainer::micro_step(const LossClosure& loss, std::int64_t items) {
  TORCH_CHECK(items >= 0, "micro_step: the item count must be >= 0, got ", items);
  return run_micro_step(loss, items);
}

inline MicroStepResult AnyTrainer::micro_step_pieces(const PieceLoss& loss,
                                                     const std::vector<std::int64_t>& items) {
  return run_micro_step_pieces(loss, items);
}

inline std::optional<AutocastRegion> AnyTrainer::precision_region() const {
  const auto dtype = autocast_dtype();
  if (!dtype) return std::nullopt;
  return std::optional<AutocastRegion>(std::in_place, device().type(), *dtype);
}

inline void AnyTrainer::save(const std::string& path) const {
  torch::serialize::OutputArchive archive;
  save(archive);
  if (saves_collectively() && !replicas().is_main()) return;
  detail::write_archive_atomically(archive, path);
}

inline void AnyTrainer::load(const std::string& path) {
  torch::serialize::InputArchive archive;
  const auto set = detail::open_checkpoint_file(archive, path);
  std::optional<detail::ShardReads> reads;
  if (set) reads.emplace(archive, *set);
  detail::load_or_restore(*this, archive, path);
}

}  // namespace trainkit
