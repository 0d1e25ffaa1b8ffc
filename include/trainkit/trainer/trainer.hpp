#pragma once
/// The Trainer: a training configuration as a type.
///
///   using Trainer = tk::Trainer<tk::PrecisionPolicy<tk::FP16Dynamic>,
///                               tk::AccumulationPolicy<4>, tk::ClipPolicy<tk::ClipNorm>>;
///   Trainer trainer(model, tk::AdamW{1e-4, 1e-4}, tk::TrainerOptions().max_grad_norm(1.0));
///   for (auto& batch : loader) {
///     auto r = trainer.micro_step([&] { return loss_of(model, batch); });
///     if (r.window_closed && want_log) log(r.report.loss());
///   }
///   trainer.flush();
///
/// The step's order is written once, in micro_step() and optimizer_phase() below, with the
/// phases numbered as in docs/design/optimizer-phase.md. Each policy is a member whose calls compile to straight-line
/// code for its configuration: there is no branch on a policy inside the step.
///
/// Storage: the trainer holds its precision's parameter storage (storage.hpp): at construction
/// the trainable parameters are moved into one flat fp32 buffer (parameters become views into
/// it, grouped by LR multiplier), and their .grad into a flat gradient; with master weights
/// the model holds half views and the buffer the fp32 masters (master_storage.hpp). Move the
/// model to its device *before* constructing the trainer, and do not replace parameters or
/// their .grad afterwards (the trainer checks and says so).
///
/// State: save(archive) writes every part's records (the model through the storage, the
/// update rule, the precision's scaler, the accumulation's window, the counters, the schedule,
/// the generators); load(archive) checks the type, the optimizer and every parameter's shape
/// before it changes anything. save(path) and load(path) add the atomic file and the rollback.
#include <trainkit/detail/inline.hpp>
#include <trainkit/step/accumulation.hpp>
#include <trainkit/trainer/any_trainer.hpp>
#include <trainkit/step/clip.hpp>
#include <trainkit/archive/checkpoint_io.hpp>
#include <trainkit/detail/module_of.hpp>
#include <trainkit/detail/out_of_memory.hpp>
#include <trainkit/detail/rng_state.hpp>
#include <trainkit/storage/master_storage.hpp>
#include <trainkit/step/optim.hpp>
#include <trainkit/step/options.hpp>
#include <trainkit/step/precision.hpp>
#include <trainkit/step/replicas.hpp>
#include <trainkit/step/schedule.hpp>
#include <trainkit/step/step_report.hpp>
#include <trainkit/storage/storage.hpp>
#include <trainkit/storage/released_use.hpp>
#include <trainkit/storage/unit_gathers.hpp>
#include <trainkit/trainer/trainer_core.hpp>
#include <trainkit/trainer/trainer_key.hpp>
#include <trainkit/version.hpp>

#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>
#include <torch/serialize/archive.h>
#include <torch/types.h>

#include <algorithm>
#include <cstdint>
#include <iostream>
#include <limits>
#include <memory>
#include <mutex>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace trainkit {

/// A training configuration as a type. See the file comment for use; docs/design/optimizer-phase.md
/// for semantics.
/// It is also an AnyTrainer (any_trainer.hpp): code that takes AnyTrainer& (tk::fit, the
/// checkpoint manager, a driver) compiles once for every configuration.
template <class Precision = PrecisionPolicy<FP32>, class Accumulation = AccumulationPolicy<1>,
          class Clip = ClipPolicy<NoClip>>
class Trainer final : public detail::TrainerCore {
  static_assert(is_precision_policy<Precision>::value,
                "trainkit::Trainer<P, A, C>: P (the first argument) must be "
                "tk::PrecisionPolicy<tk::FP32 | tk::BF16 | tk::FP16Static | tk::FP16Dynamic>, or "
                "tk::PrecisionPolicy<tk::MasterWeights<tk::BF16 | tk::FP16Static | tk::FP16Dynamic>>");
  static_assert(is_accumulation_policy<Accumulation>::value,
                "trainkit::Trainer<P, A, C>: A (the second argument) must be "
                "tk::AccumulationPolicy<N> with N >= 1, or tk::AccumulationPolicy<tk::Dynamic>");
  static_assert(is_clip_policy<Clip>::value,
                "trainkit::Trainer<P, A, C>: C (the third argument) must be "
                "tk::ClipPolicy<tk::NoClip | tk::ClipNorm | tk::ClipValue>");

 public:
  using precision = Precision;
  using accumulation = Accumulation;
  using clip = Clip;
  using precision_mode = typename Precision::mode;
  using clip_mode = typename Clip::mode;
  /// The parameter storage of the precision (storage.hpp).
  using storage_type = typename Precision::storage;
  /// Micro-batches per window; tk::Dynamic when chosen at run time.
  static constexpr int accumulation_steps = Accumulation::steps;
  static constexpr bool scales_loss = Precision::scales_loss;

  /// The configuration as values (trainer_key.hpp).
  static constexpr TrainerKey key() { return TrainerKey::of<precision_mode, accumulation_steps, clip_mode>(); }
  /// "Trainer<FP16Dynamic, Accumulate<4>, ClipNorm>": for logs, and checked on load().
  static std::string name() { return key().name(); }

  /// `optimizer`: tk::SGD, tk::Adam, tk::AdamW (fused), or a std::shared_ptr to any
  /// torch::optim::Optimizer built over the model's parameters (unfused).
  template <class Model, class Optimizer>
  Trainer(Model& model, Optimizer optimizer, TrainerOptions options = {})
      : TrainerCore(validated(std::move(options)), detail::module_of(model)),
        precision_(options_.loss_scale(), device_),
        accumulation_(options_),
        clip_(options_),
        storage_(*module_, options_, device_, Precision::storage_dtype) {
    static_assert(storage_type::accepts_torch_optimizer || !detail::is_torch_optimizer<Optimizer>::value,
                  "trainkit::Trainer with MasterWeights<T>: a torch::optim::Optimizer would update "
                  "the model's half parameters, not the fp32 masters; use the fused tk::SGD, "
                  "tk::Adam or tk::AdamW, or PrecisionPolicy<T> without MasterWeights");
    start(detail::make_rule(std::move(optimizer), storage_.groups()),
          detail::autocast_dtype_of<precision_mode>() == at::kHalf);
  }

  Trainer(const Trainer&) = delete;
  Trainer& operator=(const Trainer&) = delete;

  /// One micro-batch: `closure` computes the loss (forward) and returns it as a scalar tensor.
  /// Closes the window on its N-th call and then runs the optimizer phase.
  template <class Closure>
  MicroStepResult micro_step(Closure&& closure) {
    return micro_step_impl(std::forward<Closure>(closure), -1);
  }
  /// As above, with the micro-batch's item count (tokens, samples): the window's gradient is
  /// then the gradient of the mean over all its items, whatever the counts are.
  template <class Closure>
  MicroStepResult micro_step(Closure&& closure, std::int64_t items) {
    TORCH_CHECK(items >= 0, "micro_step: the item count must be >= 0, got ", items);
    return micro_step_impl(std::forward<Closure>(closure), items);
  }

  /// One micro-batch of `items[0] + items[1] + ...` items run as pieces: `loss(j)` computes
  /// piece j's loss, a mean over its items[j] items, and each piece has its own forward and
  /// backward (the activations of one piece at a time). The step is micro_step(closure, total)
  /// on the whole micro-batch whose loss is the items-weighted mean of the pieces' losses: the
  /// window's position advances once. The fit loop's planned micro-batches and its replay after
  /// an out-of-memory error run through this (fit.hpp, "Memory"). ZeRO stage 3: every rank
  /// calls it with as many pieces (each gathers every unit; a piece with 0 items and its loss
  /// times 0 stands in where a rank has fewer), and each piece's gradient is reduce-scattered
  /// as its backward leaves each unit.
  template <class PieceLoss>
  MicroStepResult micro_step_pieces(PieceLoss&& loss, const std::vector<std::int64_t>& items) {
    static_assert(std::is_invocable_r_v<torch::Tensor, PieceLoss&, std::int64_t>,
                  "micro_step_pieces(loss, items): loss(j) must return piece j's loss as a torch::Tensor");
    return micro_step_pieces_impl(loss, items);
  }

  /// Opens a window whose loss is several terms, each the sum of a loss over its own items
  /// (MLM over labelled tokens, region classification over labelled regions): `items[t]` is
  /// term t's item count in this rank's micro-batches of the window, known before they run
  /// (read from the batches). Each micro-step's closure then returns the terms' sums, one
  /// value per term (torch::stack({mlm_sum, mvrc_sum})), and the window's gradient is that of
  /// the sum over the terms of each term's mean over all its items in the window, on every
  /// rank: exactly what one micro-batch holding the whole global batch gives, however it is
  /// split (micro-batches, pieces, ranks). The counts are summed over the ranks here (one
  /// small collective on the device, no host sync): every rank calls it, for every window.
  ///
  ///   trainer.begin_window({mlm_tokens, masked_regions});  // this rank's, over the window
  ///   for (const auto& b : window)
  ///     trainer.micro_step([&] { auto o = model(b); return torch::stack({o.mlm_sum, o.mvrc_sum}); });
  /// `micro_batches`: how many micro-batches the counts cover (the window's length, fewer for a
  /// partial window); running more in the window is refused, since their items were not counted.
  void begin_window(const std::vector<std::int64_t>& items, std::int64_t micro_batches = -1) override {
    TORCH_CHECK(accumulation_.position() == 0, "begin_window: a window is open (", accumulation_.position(),
                " micro-batches of ", accumulation_.window(), "); call it before a window's first micro-batch");
    TORCH_CHECK(micro_batches <= accumulation_.window(), "begin_window: counts of ", micro_batches,
                " micro-batches for a window of ", accumulation_.window());
    count_terms(items);
    terms_.micro_batches = micro_batches < 0 ? accumulation_.window() : micro_batches;
  }
  /// Whether the open window's loss is terms (begin_window).
  bool window_has_terms() const override { return terms_.active(); }

  /// Whether each micro-batch's gradient is reduced over the ranks when it ends (a sharded
  /// gradient, Sharding::gradients, with several ranks).
  bool reduces_each_micro_batch() const override { return storage_.reduces_each_micro_batch(); }
  /// With a gradient reduced at each micro-batch's end (reduces_each_micro_batch()): forgets
  /// the micro-batch whose forward or backward failed (out of memory), its loss, counts and
  /// unreduced gradient, and keeps the window's earlier micro-batches, which every rank has
  /// summed already; the fit loop then replays that micro-batch alone, in smaller pieces, and
  /// every rank's collectives still line up. Throws where the failed backward had sent
  /// buckets to the other ranks (TrainerOptions::overlap_reduction).
  void discard_micro_batch() override;

  /// Discards the open window: its gradient, loss and item count, as if none of its
  /// micro-batches had run (the fit loop, before replaying a window after an out-of-memory
  /// error). Parameters, optimizer state, counters and the schedule are untouched. The loss
  /// terms' counts of begin_window stay: a replay runs the same micro-batches (and calling
  /// begin_window again would be a collective the other ranks do not make).
  void discard_window() override;

  /// End of epoch: handle a partial window by TrainerOptions::partial_window
  /// (docs/design/optimizer-phase.md).
  /// Returns the report when an optimizer phase ran.
  std::optional<StepReport> flush() override;

  /// Data parallel (replicas.hpp): attaches the other ranks; every rank's parameters and
  /// buffers become rank 0's now, and phase 5 sums the gradients once per window. Call it on
  /// every rank, between windows, before load(). The default is SingleProcess. With
  /// TrainerOptions::sharding and more than one rank the optimizer's state then covers this
  /// rank's slices only: call it before the first optimizer step.
  void set_replicas(std::shared_ptr<Replicas> replicas) override;
  void allocate_gradient() override { storage_.allocate_gradient(); }
  /// One forward+backward of `closure` as a micro-step runs it, its gradient then dropped
  /// (AnyTrainer::trial_backward): phases 1-3 with weight 1 in a window that opens and is
  /// discarded.
  void trial_backward(const LossClosure& closure) override;
  // --- state ----------------------------------------------------------------------------
  /// Micro-batches in the current, open window.
  std::int64_t window_position() const override { return accumulation_.position(); }
  /// The current loss scale (device scalar; 1 without loss scaling).
  const torch::Tensor& loss_scale() const override { return precision_.scale(); }
  Precision& precision_policy() { return precision_; }
  Accumulation& accumulation_policy() { return accumulation_; }
  const Clip& clip_policy() const { return clip_; }
  /// Where the parameters, gradients and masters live (storage.hpp, master_storage.hpp).
  const storage_type& storage() const { return storage_; }
  /// The flat gradient (every trainable parameter's .grad is a view into it). With master
  /// weights: the fp32 gradient of the optimizer phase, undefined between windows.
  const torch::Tensor& gradients() const { return storage_.gradients(); }
  /// The flat fp32 parameter storage: the model's parameters, or with master weights the
  /// masters. Each parameter starts 64-byte aligned; the gaps between them are zeros
  /// (layout().pack(parameters()) gives the parameters back to back, as checkpoints hold them).
  const torch::Tensor& parameters() const { return storage_.parameters(); }
  /// Where each parameter lives in parameters() and the storage's other flat buffers.
  const detail::FlatLayout& layout() const { return storage_.layout(); }
  /// Trainable parameters (elements), without the gaps.
  std::int64_t parameter_count() const { return storage_.parameter_count(); }
  const std::vector<detail::ParamGroup>& groups() const override { return storage_.groups(); }

  // --- AnyTrainer: what the loop asks of any configuration --------------------------------
  std::string type_name() const override { return name(); }
  bool uses_loss_scale() const override { return Precision::scales_loss; }
  bool dynamic_loss_scale() const override { return std::is_same_v<scaling_mode_t<precision_mode>, FP16Dynamic>; }
  void watch_nonfinite(bool on) override {
    std::vector<torch::Tensor> trainable;
    for (const auto& p : module_->parameters(true))
      if (p.requires_grad()) trainable.push_back(p);
    nonfinite_.set(on, trainable, device_);
  }
  bool watches_nonfinite() const override { return nonfinite_.on(); }
  NonfiniteCounts take_nonfinite_counts() override {
    std::vector<std::string> names;
    for (const auto& p : module_->named_parameters(true))
      if (p.value().requires_grad()) names.push_back(p.key());
    return nonfinite_.take(std::move(names));
  }
  std::int64_t window_length() const override { return accumulation_.window(); }
  std::optional<at::ScalarType> autocast_dtype() const override {
    return detail::autocast_dtype_of<precision_mode>();
  }

  using AnyTrainer::load;
  using AnyTrainer::save;
  /// Every record of the trainer's state: each part writes its own. The parameters and the
  /// optimizer's state are keyed by parameter name with the parameters' shapes, whatever the
  /// layout or the world size. Sharded (saves_collectively()): every rank calls it, and the
  /// main rank's archive receives everything.
  void save(torch::serialize::OutputArchive& archive) const override { write_state(archive, /*snapshot=*/false); }
  /// This rank's state as it holds it, with no collective (a failed load's rollback).
  void snapshot(torch::serialize::OutputArchive& archive) const override { write_state(archive, /*snapshot=*/true); }
  bool saves_collectively() const override { return storage_.sharded(); }
  bool shards_parameters() const override { return storage_.shards_parameters(); }
  ModelSize model_size() const override { return storage_.model_size(*module_); }
  StorageShape storage_shape() const override {
    // (master weights: the weights are half already, autocast makes no copies)
    return shape_of(Precision::master_weights,
                    !Precision::master_weights && detail::autocast_dtype_of<precision_mode>().has_value());
  }
  std::int64_t held_bytes() const override {
    std::vector<torch::Tensor> tensors;
    storage_.held_tensors(tensors);
    return distinct_bytes(std::move(tensors));
  }
  void hold_parameters(bool hold) override { storage_.hold_parameters(hold); }
  void evaluate_by_unit(bool on) override { storage_.evaluate_by_unit(on); }

  /// Restores the state save() wrote. A checkpoint of another trainer type or optimizer, or
  /// with other parameter names or shapes, is refused before anything changes (the message
  /// names `source` and the first mismatch). A failure after that (an optimizer state that
  /// does not fit, ranks that loaded different states) leaves the trainer partly loaded:
  /// load(path) and the checkpoint manager put the previous state back. (trainer_records.hpp)
  void load(torch::serialize::InputArchive& archive, const std::string& source) override;
  /// A snapshot() of this trainer back (the rollback of a failed load): no checks, no
  /// collectives.
  void restore(torch::serialize::InputArchive& snapshot) override;

 protected:
  MicroStepResult run_micro_step(const LossClosure& loss, std::int64_t items) override {
    return micro_step_impl(loss, items);
  }
  MicroStepResult run_micro_step_pieces(const PieceLoss& loss, const std::vector<std::int64_t>& items) override {
    return micro_step_pieces_impl(loss, items);
  }

 private:
  // The records of every part, in this order: the shared ones (TrainerCore) around the
  // storage's and the policies' (trainer_records.hpp).
  void write_state(torch::serialize::OutputArchive& archive, bool snapshot) const;
  // Sets the trainer's state from the records save() wrote (checked by check_checkpoint
  // first), or from a snapshot() of this trainer's. `prefix` names the archive in errors.
  void read_state(torch::serialize::InputArchive& archive, const std::string& prefix, bool snapshot);

  static TrainerOptions validated(TrainerOptions options) {
    options.validate();
    storage_type::validate(options, name());
    return options;
  }

  template <class Closure>
  MicroStepResult micro_step_impl(Closure&& closure, std::int64_t items) {
    static_assert(std::is_invocable_v<Closure&>,
                  "micro_step(closure): the closure must take no arguments");
    static_assert(std::is_convertible_v<std::invoke_result_t<Closure&>, torch::Tensor>,
                  "micro_step(closure): the closure must return the loss as a torch::Tensor");
    started_ = {accumulation_.state(), window_loss_};
    const torch::Tensor loss = forward(closure);
    // 2. Weight: 1/N, or items_i / items_window (exact mean over the window's items); loss
    //    terms carry their own (begin_window).
    const bool opens = accumulation_.position() == 0;
    const double weight = weigh(items);
    const bool closes = accumulation_.closes();
    const detail::BackwardDone done{closes, /*micro_batch_ends=*/true, window_weights()};
    backward(loss, weight, opens, done);
    // 4. Data parallel: no communication inside the window (except Sharding::gradients, which
    //    reduce-scatters each micro-batch into this rank's slices of the window's sum).
    storage_.backward_done(done);
    if (!closes) return {};
    return {true, close_window()};
  }

  // micro_step_pieces: phases 1-3 once per piece, each weighted by its share of the
  // micro-batch's weight; the position advances once (after the first piece's forward, as in
  // micro_step, so a failing first forward leaves the window as it was).
  template <class PieceLoss>
  MicroStepResult micro_step_pieces_impl(PieceLoss& loss_of, const std::vector<std::int64_t>& items) {
    TORCH_CHECK(!items.empty(), "micro_step_pieces: no pieces");
    std::int64_t total = 0;
    for (size_t j = 0; j < items.size(); ++j) {
      TORCH_CHECK(items[j] >= 0, "micro_step_pieces: piece ", j, " has ", items[j], " items; counts must be >= 0");
      total += items[j];
    }
    const bool opens = accumulation_.position() == 0;
    started_ = {accumulation_.state(), window_loss_};
    double weight = 0;
    for (size_t j = 0; j < items.size(); ++j) {
      const auto piece = static_cast<std::int64_t>(j);
      const torch::Tensor loss = forward([&] { return loss_of(piece); });
      if (j == 0) weight = weigh(terms_.active() ? -1 : total);
      // (Loss terms are sums weighted by their window's counts: a piece's sums need no share.)
      const double share = terms_.active() ? 1.0
                           : total > 0   ? static_cast<double>(items[j]) / static_cast<double>(total)
                                         : 0.0;
      const bool last = j + 1 == items.size();
      const detail::BackwardDone done{last && accumulation_.closes(), last, window_weights()};
      backward(loss, weight * share, opens && j == 0, done);
      storage_.backward_done(done);
    }
    if (!accumulation_.closes()) return {};
    return {true, close_window()};
  }

  // 1. Forward + loss inside the precision policy's region (autocast for BF16/FP16); the
  //    region closes before any backward bookkeeping.
  //    ZeRO stage 3: the storage's units' schedule is active for the forward (tk::unit gathers
  //    each unit's parameters there; the hooks it leaves gather them for the backward).
  template <class Closure>
  torch::Tensor forward(Closure&& closure) {
    torch::Tensor loss;
    {
      std::optional<detail::UnitScheduleScope> units;
      if (auto schedule = storage_.begin_forward()) units.emplace(std::move(schedule));
      [[maybe_unused]] const auto region = precision_.region();
      const auto* gathers = units ? storage_.unit_gathers() : nullptr;
      // The first forward at stage 3: a released parameter read by any operator is named
      // (storage/released_use.hpp), not a crash; later forwards name a refused view of one.
      std::optional<detail::ReleasedUseGuard> guard;
      if (gathers != nullptr && !units_checked_) guard.emplace(*gathers), units_checked_ = true;
      try {
        loss = closure();
      } catch (const c10::Error& e) {  // (a unit called without tk::unit: said in the model's terms)
        if (const std::string said = gathers ? detail::released_use(*gathers, e.what_without_backtrace()) : std::string();
            !said.empty())
          throw std::logic_error(said);
        throw;
      }
      if (guard) guard->check();
    }
    check_loss(loss);
    return loss;
  }

  // 2. The host factor of this micro-step (and its position in the window).
  double weigh(std::int64_t items) {
    if (!terms_.active()) return accumulation_.weight(items);
    TORCH_CHECK(items < 0, "micro_step: the window's loss is terms (begin_window), whose counts were given "
                "there; this micro-batch gives an item count (", items, ") as well");
    TORCH_CHECK(accumulation_.position() < terms_.micro_batches, "micro_step: the window's loss terms were counted "
                "over ", terms_.micro_batches, " micro-batches (begin_window), and this is micro-batch ",
                accumulation_.position() + 1, " of the window: its items are not in the counts");
    accumulation_.weight(-1);  // (the position; the terms carry their own weights: the factor is 1)
    return 1.0;
  }

  // 2-3. The loss times its weight, added to the window's loss; FP16: times the loss scale.
  //    Loss terms: each term's sum times its weight, 1 / (its window's items over every rank).
  //    Backward; gradients accumulate in fp32 in the storage (master weights: the half
  //    gradient of each backward joins an fp32 sum, storage_.backward_done()).
  //    Data parallel: the reduction of a closing backward may start during it, bucket by
  //    bucket (TrainerOptions::overlap_reduction): `done` tells the storage what follows.
  void backward(const torch::Tensor& loss, double weight, bool first_of_window, const detail::BackwardDone& done) {
    const auto as_float = loss.scalar_type() == torch::kFloat ? loss : loss.to(torch::kFloat);
    torch::Tensor objective, kept;  // kept: what the window's loss adds (the terms' sums, or the objective)
    if (terms_.active()) {
      kept = as_float.reshape({-1});
      objective = (kept * terms_.weights).sum();
    } else {
      objective = kept = (as_float.dim() == 0 ? as_float : as_float.reshape({})) * weight;
    }
    {
      // The window's loss, a running sum outside the graph (a new tensor each time: the last
      // report holds the previous window's).
      torch::NoGradGuard no_grad;
      window_loss_ = first_of_window ? kept.detach() : window_loss_ + kept.detach();
    }
    if constexpr (Precision::scales_loss) objective = objective * precision_.scale();
    storage_.backward_begins(done);
    objective.backward();
  }

  // The optimizer phase of a closing micro-step. Memory that runs out here cannot be given
  // back by replaying the window (the update may be half applied): it is reported as such,
  // not as an out-of-memory error the fit loop would replay.
  StepReport close_window() {
    try {
      return optimizer_phase();
    } catch (const std::exception& e) {
      if (!detail::is_out_of_memory(e)) throw;
      optimizer_phase_out_of_memory(e);
    }
  }

  // The optimizer phase, after the window's last micro-step (phases 5-11, docs/design/optimizer-phase.md).
  StepReport optimizer_phase() {
    storage_.check();  // the parameters and their .grad are still the storage's views
    // 5. Data parallel: the sum over ranks (bucket by bucket, once per window); `factor` makes
    //    it the mean over every rank's micro-batches, items or terms.
    const GradientFactor factor = storage_.reduce(*replicas_, window_weights());
    // 6-7. One pass over the gradient: the norm of the still-scaled gradient, both the overflow
    //    check and, unscaled, the logged and clipped norm.
    const Unscaled norm = unscale(factor, storage_.norm());
    //    With the overflow diagnosis on: which parameters' gradients are not finite.
    if (nonfinite_.on()) nonfinite_.count(storage_);
    // 8. Clipping on the true gradient, folded into the optimizer's divisor where it can be.
    const torch::Tensor optimizer_divisor = clip_.divisor(norm.divisor, norm.true_norm);
    // 9. The counters, then the update over the storage's chunks, skipped on the device when
    //    found_inf (parameters and optimizer state unchanged, bit for bit); the LR is the
    //    schedule's at the applied-step position, which the update rule's step count follows.
    const torch::Tensor lr = scheduled_lr();
    skipped_ = skipped_ + norm.found_inf.to(torch::kLong);  // new tensors: the last report keeps its values
    applied_ = at::rsub(skipped_, windows_ + 1);            // applied + skipped = optimizer phases run
    storage_.update([&](const std::vector<detail::ParamGroup>& groups, torch::Tensor& gradient) {
      clip_.apply(gradient, norm.divisor);  // (ClipValue clamps the true gradient itself)
      rule_->step(groups, optimizer_divisor, norm.found_inf, lrs_, applied_);
    });
    // 10. The loss scale's update (the report keeps the scale this window ran with).
    torch::Tensor scale = Precision::scales_loss ? precision_.scale().clone() : precision_.scale();
    precision_.update(norm.found_inf);
    ++windows_;
    StepReport report = window_report(std::move(scale), norm, lr);
    // 11. Zero the gradient: one fill of the flat storage. (The window's loss is not zeroed:
    //     the next window's first micro-step replaces it.)
    storage_.zero();
    accumulation_.reset();
    terms_ = {};
    host_checks(report);
    return report;
  }

  // 6-7 unscaled: the accumulated gradient is the true gradient times `divisor` (the loss scale,
  // the accumulation's rescale, the ranks' item total; no ATen call where it is the loss scale
  // or a constant: the phase is ~15 calls, each a few microseconds). A non-finite gradient has a
  // non-finite norm; so has a finite one whose norm overflows fp32 (its squares are summed in
  // fp32: elements from ~1.8e19 on), skipped as an overflow too, where torch.amp.GradScaler
  // checks elements and applies it: a norm beyond fp32 is as unusable as an inf (test_skip).
  struct Unscaled {
    torch::Tensor divisor, true_norm, found_inf;
  };
  Unscaled unscale(const GradientFactor& factor, const torch::Tensor& scaled_norm) {
    Unscaled u;
    if constexpr (Precision::scales_loss)
      u.divisor = factor.rescale == 1.0 ? precision_.scale() : precision_.scale() / factor.rescale;
    else
      u.divisor = constant(1.0 / factor.rescale);
    if (factor.total.defined()) u.divisor = u.divisor * factor.total;  // the ranks' item total
    const bool unit = !Precision::scales_loss && factor.rescale == 1.0 && !factor.total.defined();
    u.true_norm = unit ? scaled_norm : scaled_norm / u.divisor;
    // found_inf = 1.0 when the norm is not finite (x * 0 is 0 for finite x and NaN otherwise).
    // (A window with no items on any rank has divisor 0: a non-finite true norm, skipped.)
    u.found_inf = at::nan_to_num((factor.total.defined() ? u.true_norm : scaled_norm) * 0.0, /*nan=*/1.0);
    return u;
  }

  // The LR of the window about to be applied, from the schedule's device table at the applied
  // count (each group's times its multiplier, in lrs_).
  torch::Tensor scheduled_lr() {
    ensure_lr_table();
    auto lr = lr_table_.index_select(0, applied_);
    lrs_.clear();
    for (const auto& g : storage_.groups()) lrs_.push_back(g.lr_mult == 1.0 ? lr : lr * g.lr_mult);
    return lr;
  }

  // The closed window's report: device values, read on the host only when asked for.
  StepReport window_report(torch::Tensor scale, const Unscaled& norm, const torch::Tensor& lr) {
    StepReport::Device v;
    v.loss_scale = std::move(scale);
    // The window's mean loss; loss terms: this rank's terms, each the mean over this rank's items.
    const double rescale = accumulation_.rescale();
    v.loss = terms_.active() ? (window_loss_ * terms_.local_weights).sum()
             : rescale == 1.0 ? window_loss_
                              : window_loss_ * rescale;
    v.grad_norm = norm.true_norm;
    v.lr = lr;
    v.found_inf = norm.found_inf;
    v.skipped = skipped_;
    v.applied = applied_;
    return StepReport(std::move(v), windows_, accumulation_.position(), accumulation_.items());
  }

  // What phase 5 (and a sharded reduction inside the window) weights each rank's gradient by:
  // host values only.
  WindowWeights window_weights() const {
    if (terms_.active()) return {1.0, -1, accumulation_.position(), /*normalized=*/true};
    const bool counted = accumulation_.counted();
    // (A window whose items so far are 0 has a zero gradient so far: any rescale will do until
    // its end, where rescale() refuses a window of no items.)
    const double rescale = counted && accumulation_.items() <= 0 && !accumulation_.closes() ? 1.0 : accumulation_.rescale();
    return {rescale, counted ? accumulation_.items() : -1, accumulation_.position()};
  }

  // Checks that need a host value, run only where they were asked for.
  void host_checks(const StepReport& report) {
    const auto collapse = options_.loss_scale().collapse_windows();
    if constexpr (std::is_same_v<scaling_mode_t<precision_mode>, FP16Dynamic>)
      if (collapse > 0 && windows_ % collapse == 0) precision_.check(windows_);
    if constexpr (!Precision::scales_loss) {
      if (options_.nonfinite() == NonFinite::abort && report.skipped()) {
        std::ostringstream msg;
        msg << "non-finite gradient at optimizer step " << windows_ << " (window loss "
            << report.loss() << ", gradient norm " << report.grad_norm()
            << "); the update was not applied. Look for log(0), a division by zero or an "
               "exploding activation, or set TRAIN.NONFINITE: skip to skip such steps";
        throw NonFiniteGradient(msg.str());
      }
    }
  }

  Precision precision_;
  Accumulation accumulation_;
  Clip clip_;
  storage_type storage_;
  detail::NonfiniteWatch nonfinite_;
  bool units_checked_ = false;  // stage 3: the first forward ran under a ReleasedUseGuard (forward())
  struct MicroBatchStart {  // the window as the current micro-batch found it (discard_micro_batch)
    typename Accumulation::State accumulation{};
    torch::Tensor window_loss;
  } started_;
};

}  // namespace trainkit

#include <trainkit/trainer/trainer_records.hpp>
#include <trainkit/trainer/trainer_windows.hpp>
