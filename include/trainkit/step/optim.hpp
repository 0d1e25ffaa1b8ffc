#pragma once
/// Optimizers: SGD (momentum, Nesterov), Adam and AdamW, fused over all parameters, plus any
/// torch::optim::Optimizer as the unfused alternative.
///
/// The option structs (`tk::AdamW{1e-4, 1e-2}.betas(0.9, 0.999).eps(1e-6)`) say what to run.
/// The trainer turns them into an update rule over its flat parameter storage: one fused ATen
/// call per parameter group and step (`at::_fused_adamw_` and friends; each group is one
/// contiguous tensor), with the gradient divisor (loss scale / clip coefficient) and the
/// overflow flag handed to the kernel, so unscaling, clipping and skipping happen inside the
/// update and nothing is read back to the host.
///
/// Update-rule contract (detail::UpdateRule), called by the trainer in optimizer phase 9:
///   step(groups, divisor, found_inf, lr, applied)  device scalars. The true gradient is
///       grad / divisor; found_inf = 1 means: change nothing, bit for bit; applied: the count
///       of applied steps, this one included when it applies (a step count to follow).
///       `groups` are the groups the rule was made with, or chunks of them (state_offset;
///       undefined params: nothing of that group), called once per chunk with the same scalars.
///   flat_states()                         the state laid out as the storage's local buffer
///                                         (moments, momentum), which the storage saves by
///                                         parameter name
///   save / load                           the rest of the state (the step count)
#include <trainkit/detail/inline.hpp>
#include <trainkit/archive/checkpoint_io.hpp>
#include <trainkit/detail/flat_layout.hpp>
#include <trainkit/detail/type_traits.hpp>

#include <torch/arg.h>
#include <torch/optim/optimizer.h>
#include <torch/serialize/archive.h>
#include <torch/types.h>

#include <algorithm>
#include <memory>
#include <optional>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace trainkit {

/// SGD with optional momentum, Nesterov momentum and L2 weight decay (torch::optim::SGD's rule;
/// dampening is 0).
struct SGD {
  explicit SGD(double lr, double momentum = 0.0, double weight_decay = 0.0, bool nesterov = false)
      : lr_(lr), momentum_(momentum), weight_decay_(weight_decay), nesterov_(nesterov) {}
  TORCH_ARG(double, lr);
  TORCH_ARG(double, momentum);
  TORCH_ARG(double, weight_decay);
  TORCH_ARG(bool, nesterov);
};

namespace detail {

/// The options Adam and AdamW share (torch::optim's defaults). The setters return the derived
/// struct, not this base: `AdamW{lr}.eps(1e-6)` must stay an AdamW, since make_rule chooses the
/// update rule by the type.
template <class Derived>
class AdamOptions {
 public:
  double lr() const { return lr_; }
  double weight_decay() const { return weight_decay_; }
  double beta1() const { return beta1_; }
  double beta2() const { return beta2_; }
  double eps() const { return eps_; }

  Derived& lr(double value) { return set(lr_, value); }
  Derived& weight_decay(double value) { return set(weight_decay_, value); }
  Derived& beta1(double value) { return set(beta1_, value); }
  Derived& beta2(double value) { return set(beta2_, value); }
  Derived& eps(double value) { return set(eps_, value); }
  Derived& betas(double beta1, double beta2) {
    beta1_ = beta1;
    return set(beta2_, beta2);
  }

 protected:
  AdamOptions(double lr, double weight_decay) : lr_(lr), weight_decay_(weight_decay) {}

 private:
  Derived& set(double& member, double value) {
    member = value;
    return static_cast<Derived&>(*this);
  }

  double lr_;
  double weight_decay_;
  double beta1_ = 0.9;
  double beta2_ = 0.999;
  double eps_ = 1e-8;
};

}  // namespace detail

/// Adam with L2 weight decay added to the gradient (torch::optim::Adam's rule).
struct Adam : detail::AdamOptions<Adam> {
  explicit Adam(double lr, double weight_decay = 0.0) : AdamOptions(lr, weight_decay) {}
};

/// AdamW with decoupled weight decay (torch::optim::AdamW's rule), on every parameter as in
/// VL-BERT. VL-BERT's own settings: `AdamW{lr, wd}.eps(1e-6)`.
struct AdamW : detail::AdamOptions<AdamW> {
  explicit AdamW(double lr, double weight_decay = 1e-2) : AdamOptions(lr, weight_decay) {}
};

namespace detail {

/// One parameter group: a contiguous slice of the flat parameter and gradient storage.
struct ParamGroup {
  torch::Tensor params;  ///< 1-D view into the flat parameter storage
  torch::Tensor grads;   ///< 1-D view into the flat gradient storage, same extent
  double lr_mult = 1.0;
  bool decay = true;     ///< false: no weight decay (TrainerOptions::no_decay)
  FlatLayout layout;     ///< the parameters inside `params` (gaps between them are zeros)
  /// Where `params` starts in the rule's flat state (FlatState): the group's offset in the
  /// flat buffer, or, for a chunk of a group (the chunked master-weights phase, a rank's slice
  /// when sharded), the chunk's place in the state. A chunk that misses the group has
  /// undefined `params` and is skipped.
  std::int64_t state_offset = 0;
  /// The optimizer's weight decay for this group.
  double weight_decay(double optimizer_decay) const { return decay ? optimizer_decay : 0.0; }
};

/// One kind of optimizer state (a moment, the momentum): one flat tensor laid out as the
/// storage's local buffer (the whole flat buffer, or this rank's slices when sharded; gaps and
/// padding stay zero), with the views of the rule's own groups made once.
class FlatState {
 public:
  FlatState(std::string kind, const std::vector<ParamGroup>& groups);
  /// The part of the state `group` (the rule's group g, or a chunk of it) covers.
  torch::Tensor of(const ParamGroup& group, size_t g) const;
  /// For `numel` local elements (set_replicas with sharding: the state of this rank's slices
  /// only); the groups' views go.
  void resize(std::int64_t numel);
  /// "exp_avg", "exp_avg_sq", "momentum": checkpoints hold it as optim.<kind>.<parameter name>.
  const std::string& kind() const { return kind_; }
  /// The state; zeros until the first step. (Allocated on first use, not at construction: a
  /// trainer sharded by set_replicas never holds the whole state.)
  const torch::Tensor& flat() const;
  /// The rule's groups' parts (empty once resized).
  const std::vector<torch::Tensor>& views() const;
  /// Allocates the state now (zeros) if it is not yet: what its first use would do.
  void allocate() const;
  /// Whether it is allocated (flat() would allocate it).
  bool allocated() const { return flat_.defined(); }

 private:
  std::string kind_;
  torch::TensorOptions options_;
  std::int64_t numel_ = 0;
  std::vector<std::int64_t> offsets_, sizes_;  // the rule's own groups
  mutable torch::Tensor flat_;
  mutable std::vector<torch::Tensor> views_;
};

class UpdateRule {
 public:
  virtual ~UpdateRule() = default;
  /// `lrs[g]`: learning rate of group g, a device scalar.
  virtual void step(const std::vector<ParamGroup>& groups, const torch::Tensor& divisor,
                    const torch::Tensor& found_inf, const std::vector<torch::Tensor>& lrs,
                    const torch::Tensor& applied) = 0;
  virtual double base_lr() const = 0;
  virtual std::string name() const = 0;
  virtual bool fused() const { return true; }
  /// The state laid out as the storage's local buffer, one per kind: the storage writes and
  /// reads it by parameter name (storage.hpp), so checkpoints do not depend on the layout or
  /// on the world size.
  virtual std::vector<FlatState*> flat_states() { return {}; }
  std::vector<const FlatState*> flat_states() const;
  /// Whether flat_states() is all of the state that grows with the parameters (false: a
  /// torch::optim optimizer's own, which it makes at its first step).
  virtual bool state_is_flat() const { return true; }
  /// The rest of the state (step counts; a torch::optim optimizer's own archive).
  virtual void save(torch::serialize::OutputArchive& archive) const = 0;
  virtual void load(torch::serialize::InputArchive& archive) = 0;
};

void check_lr(double lr, const char* who);

/// Adam and AdamW share moments and the step count; only the decay rule differs.
template <class Options, bool Decoupled>
class FusedAdam final : public UpdateRule {
 public:
  FusedAdam(const Options& options, const std::vector<ParamGroup>& groups)
      : options_(options), exp_avg_("exp_avg", groups), exp_avg_sq_("exp_avg_sq", groups) {
    check_lr(options.lr(), Decoupled ? "AdamW" : "Adam");
    TORCH_CHECK(options.beta1() >= 0 && options.beta1() < 1 && options.beta2() >= 0 &&
                    options.beta2() < 1,
                "Adam(W): betas must be in [0, 1), got (", options.beta1(), ", ", options.beta2(), ")");
    TORCH_CHECK(options.eps() > 0, "Adam(W): eps must be > 0, got ", options.eps());
    TORCH_CHECK(options.weight_decay() >= 0, "Adam(W): weight_decay must be >= 0, got ",
                options.weight_decay());
    // One step count for all groups (they always step together); fp32 as the kernels expect.
    step_ = torch::zeros({}, groups.front().params.options());
    step_as_1d_ = step_.view({1});
  }

  void step(const std::vector<ParamGroup>& groups, const torch::Tensor& divisor,
            const torch::Tensor& found_inf, const std::vector<torch::Tensor>& lrs,
            const torch::Tensor& applied) override {
    // The step count is the applied count (torch.optim's fused path counts the step, lets the
    // kernel skip and takes the count back: the same value, in one call).
    step_as_1d_.copy_(applied);
    for (size_t g = 0; g < groups.size(); ++g) {
      const ParamGroup& group = groups[g];
      if (!group.params.defined()) continue;
      const torch::Tensor& lr = lrs[g];
      const auto m = exp_avg_.of(group, g), v = exp_avg_sq_.of(group, g);
      if constexpr (Decoupled)
        at::_fused_adamw_({group.params}, {group.grads}, {m}, {v}, {}, {step_}, lr, options_.beta1(),
                          options_.beta2(), group.weight_decay(options_.weight_decay()), options_.eps(),
                          /*amsgrad=*/false, /*maximize=*/false, divisor, found_inf);
      else
        at::_fused_adam_({group.params}, {group.grads}, {m}, {v}, {}, {step_}, lr, options_.beta1(),
                         options_.beta2(), group.weight_decay(options_.weight_decay()), options_.eps(),
                         /*amsgrad=*/false, /*maximize=*/false, divisor, found_inf);
    }
  }
  double base_lr() const override { return options_.lr(); }
  std::string name() const override { return Decoupled ? "AdamW(fused)" : "Adam(fused)"; }
  std::vector<FlatState*> flat_states() override { return {&exp_avg_, &exp_avg_sq_}; }
  void save(torch::serialize::OutputArchive& archive) const override { write_tensor(archive, "optim.step", step_); }
  void load(torch::serialize::InputArchive& archive) override { read_into(archive, "optim.step", step_); }

  /// The moments of the rule's groups (one view per group; empty once sharded).
  const std::vector<torch::Tensor>& exp_avg() const { return exp_avg_.views(); }
  const std::vector<torch::Tensor>& exp_avg_sq() const { return exp_avg_sq_.views(); }
  const torch::Tensor& step_count() const { return step_; }

 private:
  Options options_;
  FlatState exp_avg_, exp_avg_sq_;
  torch::Tensor step_, step_as_1d_;  // (the same storage)
};

class FusedSGD final : public UpdateRule {
 public:
  FusedSGD(const SGD& options, const std::vector<ParamGroup>& groups);

  TRAINKIT_INLINE void step(const std::vector<ParamGroup>& groups, const torch::Tensor& divisor, const torch::Tensor& found_inf,
                            const std::vector<torch::Tensor>& lrs, const torch::Tensor& /*applied*/) override;
  double base_lr() const override { return options_.lr(); }
  std::string name() const override { return "SGD(fused)"; }
  TRAINKIT_INLINE std::vector<FlatState*> flat_states() override;
  void save(torch::serialize::OutputArchive&) const override {}
  void load(torch::serialize::InputArchive&) override {}
  /// The momentum of the rule's groups (one view per group; none without momentum).
  const std::vector<torch::Tensor>& momentum_buffers() const;

 private:
  SGD options_;
  std::optional<FlatState> momentum_;
};

/// Any torch::optim::Optimizer: gradients are unscaled and clipped in place, and the overflow
/// flag is read on the host (one sync per window) because torch::optim cannot skip on device.
class TorchOptimizer final : public UpdateRule {
 public:
  explicit TorchOptimizer(std::shared_ptr<torch::optim::Optimizer> optimizer);
  TRAINKIT_INLINE void step(const std::vector<ParamGroup>& groups, const torch::Tensor& divisor, const torch::Tensor& found_inf,
                            const std::vector<torch::Tensor>& lrs, const torch::Tensor& /*applied*/) override;
  double base_lr() const override { return base_lrs_.empty() ? 1.0 : base_lrs_.front(); }
  std::string name() const override { return "torch::optim(unfused)"; }
  bool fused() const override { return false; }
  bool state_is_flat() const override { return false; }
  TRAINKIT_INLINE void save(torch::serialize::OutputArchive& archive) const override;
  TRAINKIT_INLINE void load(torch::serialize::InputArchive& archive) override;
  torch::optim::Optimizer& optimizer() { return *optimizer_; }

 private:
  std::shared_ptr<torch::optim::Optimizer> optimizer_;
  std::vector<double> base_lrs_;
};

/// True for std::shared_ptr<O> with O a torch::optim::Optimizer (the unfused path).
template <class T>
struct is_torch_optimizer : std::false_type {};
template <class O>
struct is_torch_optimizer<std::shared_ptr<O>> : std::is_base_of<torch::optim::Optimizer, O> {};

std::unique_ptr<UpdateRule> make_rule(const SGD& o, const std::vector<ParamGroup>& g);
std::unique_ptr<UpdateRule> make_rule(const Adam& o, const std::vector<ParamGroup>& g);
std::unique_ptr<UpdateRule> make_rule(const AdamW& o, const std::vector<ParamGroup>& g);
template <class O, class = std::enable_if_t<std::is_base_of_v<torch::optim::Optimizer, O>>>
std::unique_ptr<UpdateRule> make_rule(std::shared_ptr<O> o, const std::vector<ParamGroup>& groups) {
  for (const auto& g : groups)
    TORCH_CHECK(g.decay, "Trainer: TrainerOptions::no_decay (TRAIN.NO_DECAY) applies to trainkit's optimizers; a "
                "torch::optim optimizer keeps its own parameter groups: give it a group with weight_decay 0 instead");
  return std::make_unique<TorchOptimizer>(std::move(o));
}

}  // namespace detail
}  // namespace trainkit

#ifndef TRAINKIT_COMPILED_LIB
#include <trainkit/step/optim-inl.hpp>
#endif
