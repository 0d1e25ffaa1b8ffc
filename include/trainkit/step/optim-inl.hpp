#pragma once
/// The definitions of trainkit/step/optim.hpp (header-only: included by it; compiled mode:
/// by src/trainkit.cpp alone). See docs/design/compiled-mode.md.
#include <trainkit/step/optim.hpp>

namespace trainkit {
namespace detail {

TRAINKIT_INLINE FlatState::FlatState(std::string kind, const std::vector<ParamGroup>& groups)
    : kind_(std::move(kind)) {
  for (const auto& g : groups) {
    numel_ = std::max(numel_, g.state_offset + g.params.numel());
    offsets_.push_back(g.state_offset);
    sizes_.push_back(g.params.numel());
  }
  options_ = groups.front().params.options();
}

TRAINKIT_INLINE torch::Tensor FlatState::of(const ParamGroup& group, size_t g) const {
  allocate();
  const auto n = group.params.numel();
  if (g < views_.size() && offsets_[g] == group.state_offset && views_[g].numel() == n) return views_[g];
  return flat_.narrow(0, group.state_offset, n);
}

TRAINKIT_INLINE void FlatState::resize(std::int64_t numel) {
  numel_ = numel;
  flat_ = torch::Tensor();
  offsets_.clear();
  sizes_.clear();
  views_.clear();
}

TRAINKIT_INLINE const torch::Tensor& FlatState::flat() const {
  allocate();
  return flat_;
}

TRAINKIT_INLINE const std::vector<torch::Tensor>& FlatState::views() const {
  allocate();
  return views_;
}

TRAINKIT_INLINE void FlatState::allocate() const {
  if (flat_.defined()) return;
  flat_ = torch::zeros({numel_}, options_);
  for (size_t g = 0; g < offsets_.size(); ++g) views_.push_back(flat_.narrow(0, offsets_[g], sizes_[g]));
}

TRAINKIT_INLINE std::vector<const FlatState*> UpdateRule::flat_states() const {
  std::vector<const FlatState*> out;
  for (auto* s : const_cast<UpdateRule*>(this)->flat_states()) out.push_back(s);
  return out;
}

TRAINKIT_INLINE void check_lr(double lr, const char* who) {
  TORCH_CHECK(lr > 0 && std::isfinite(lr), who, ": the learning rate must be finite and > 0, got ", lr);
}

TRAINKIT_INLINE FusedSGD::FusedSGD(const SGD& options, const std::vector<ParamGroup>& groups)
    : options_(options) {
  check_lr(options.lr(), "SGD");
  TORCH_CHECK(options.momentum() >= 0, "SGD: momentum must be >= 0, got ", options.momentum());
  TORCH_CHECK(!options.nesterov() || options.momentum() > 0,
              "SGD: nesterov needs momentum > 0");
  TORCH_CHECK(options.weight_decay() >= 0, "SGD: weight_decay must be >= 0, got ",
              options.weight_decay());
  if (options.momentum() > 0) momentum_.emplace("momentum", groups);
}

TRAINKIT_INLINE void FusedSGD::step(const std::vector<ParamGroup>& groups, const torch::Tensor& divisor,
                                    const torch::Tensor& found_inf, const std::vector<torch::Tensor>& lrs,
                                    const torch::Tensor& /*applied*/) {
  for (size_t g = 0; g < groups.size(); ++g) {
    if (!groups[g].params.defined()) continue;
    // A zero-initialised buffer with dampening 0 equals torch's "buffer = grad on the first
    // step", without the host needing to know which step was the first applied one.
    const auto buffers = momentum_ ? std::vector<torch::Tensor>{momentum_->of(groups[g], g)}
                                   : std::vector<torch::Tensor>{};
    at::_fused_sgd_({groups[g].params}, {groups[g].grads}, buffers, groups[g].weight_decay(options_.weight_decay()),
                    options_.momentum(), lrs[g], /*dampening=*/0.0, options_.nesterov(),
                    /*maximize=*/false, /*is_first_step=*/false, divisor, found_inf);
  }
}

TRAINKIT_INLINE std::vector<FlatState*> FusedSGD::flat_states() {
  return momentum_ ? std::vector<FlatState*>{&*momentum_} : std::vector<FlatState*>{};
}

TRAINKIT_INLINE const std::vector<torch::Tensor>& FusedSGD::momentum_buffers() const {
  static const std::vector<torch::Tensor> none;
  return momentum_ ? momentum_->views() : none;
}

TRAINKIT_INLINE TorchOptimizer::TorchOptimizer(std::shared_ptr<torch::optim::Optimizer> optimizer)
    : optimizer_(std::move(optimizer)) {
  TORCH_CHECK(optimizer_ != nullptr, "Trainer: the torch::optim::Optimizer is null");
  for (auto& group : optimizer_->param_groups()) base_lrs_.push_back(group.options().get_lr());
}

TRAINKIT_INLINE void TorchOptimizer::step(const std::vector<ParamGroup>& groups, const torch::Tensor& divisor,
                                          const torch::Tensor& found_inf, const std::vector<torch::Tensor>& lrs,
                                          const torch::Tensor& /*applied*/) {
  // The overflow flag and the LR in one read (the one host sync of this path).
  const auto host = torch::stack({found_inf.reshape({}).to(torch::kDouble), lrs.front().reshape({}).to(torch::kDouble)}).cpu();
  const double* values = host.data_ptr<double>();
  if (values[0] != 0.0) return;
  for (const auto& g : groups) g.grads.div_(divisor);
  // The schedule's factor relative to the base LR, applied to each group's own LR.
  const double factor = values[1] / base_lr();
  auto& param_groups = optimizer_->param_groups();
  for (size_t i = 0; i < param_groups.size(); ++i)
    param_groups[i].options().set_lr(base_lrs_[i] * factor);
  optimizer_->step();
}

TRAINKIT_INLINE void TorchOptimizer::save(torch::serialize::OutputArchive& archive) const {
  torch::serialize::OutputArchive nested;
  optimizer_->save(nested);
  detail::StagedWrites::cannot_stage();  // (its records are the optimizer's own tensors)
  archive.write("optim.torch", nested);
}

TRAINKIT_INLINE void TorchOptimizer::load(torch::serialize::InputArchive& archive) {
  torch::serialize::InputArchive nested;
  archive.read("optim.torch", nested);
  optimizer_->load(nested);
}

TRAINKIT_INLINE std::unique_ptr<UpdateRule> make_rule(const SGD& o, const std::vector<ParamGroup>& g) {
  return std::make_unique<FusedSGD>(o, g);
}

TRAINKIT_INLINE std::unique_ptr<UpdateRule> make_rule(const Adam& o, const std::vector<ParamGroup>& g) {
  return std::make_unique<FusedAdam<Adam, false>>(o, g);
}

TRAINKIT_INLINE std::unique_ptr<UpdateRule> make_rule(const AdamW& o, const std::vector<ParamGroup>& g) {
  return std::make_unique<FusedAdam<AdamW, true>>(o, g);
}

}  // namespace detail
}  // namespace trainkit
