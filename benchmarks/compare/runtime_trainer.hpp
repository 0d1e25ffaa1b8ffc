#pragma once
// The branching variant: trainkit's step with its policies chosen at run time. The same storage
// (flat fp32 parameters and gradients), the same passes (one norm, the fused AdamW with the
// divisor and the overflow flag, one zero fill), the same per-window bookkeeping (LR looked up by
// the applied-step count, counters, the report's scalars), but precision, accumulation count and
// clipping are run-time values tested with if/switch inside the step. Comparing it with the
// compiled Trainer measures what compiling the configuration buys in the step itself.
#include <trainkit/step/optim.hpp>
#include <trainkit/step/precision.hpp>

#include <torch/torch.h>

#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

namespace bench {

enum class RuntimePrecision { fp32, bf16, fp16_dynamic };
enum class RuntimeClip { none, norm, value };

class RuntimeTrainer {
 public:
  RuntimeTrainer(std::shared_ptr<torch::nn::Module> model, const trainkit::AdamW& optimizer,
                 RuntimePrecision precision, int64_t accumulation, RuntimeClip clip, double bound)
      : module_(std::move(model)), precision_(precision), accumulation_(accumulation), clip_(clip),
        bound_(bound) {
    TORCH_CHECK(accumulation_ >= 1, "RuntimeTrainer: accumulation must be >= 1");
    device_ = module_->parameters().front().device();
    flatten();
    rule_ = trainkit::detail::make_rule(optimizer, groups_);
    const auto f32 = torch::dtype(torch::kFloat).device(device_);
    scale_ = torch::full({1}, precision_ == RuntimePrecision::fp16_dynamic ? 65536.0 : 1.0, f32);
    growth_tracker_ = torch::zeros({1}, torch::dtype(torch::kInt).device(device_));
    applied_ = torch::zeros({1}, torch::dtype(torch::kLong).device(device_));
    skipped_ = torch::zeros({1}, torch::dtype(torch::kLong).device(device_));
    window_loss_ = torch::zeros({}, f32);
    one_ = torch::full({}, 1.0, f32);
    bound_tensor_ = torch::full({}, bound_, f32);
    const auto lr_dtype = device_.is_cpu() ? torch::kDouble : torch::kFloat;
    lr_table_ = torch::full({1024}, optimizer.lr(), torch::dtype(lr_dtype).device(device_));
  }

  /// One micro-batch; returns true when it closed a window (last_loss() is then its loss).
  template <class Closure>
  bool micro_step(Closure&& closure) {
    torch::Tensor loss;
    {
      std::optional<trainkit::AutocastRegion> region;
      switch (precision_) {
        case RuntimePrecision::fp32: break;
        case RuntimePrecision::bf16: region.emplace(device_.type(), at::kBFloat16); break;
        case RuntimePrecision::fp16_dynamic: region.emplace(device_.type(), at::kHalf); break;
      }
      loss = closure();
    }
    const auto as_float = loss.scalar_type() == torch::kFloat ? loss : loss.to(torch::kFloat);
    auto objective = (as_float.dim() == 0 ? as_float : as_float.reshape({})) * (1.0 / static_cast<double>(accumulation_));
    {
      torch::NoGradGuard no_grad;
      if (position_ == 0) window_loss_ = objective.detach();
      else window_loss_.add_(objective);
    }
    if (precision_ == RuntimePrecision::fp16_dynamic) objective = objective * scale_;
    objective.backward();
    if (++position_ < accumulation_) return false;
    optimizer_phase();
    return true;
  }

  const torch::Tensor& last_loss() const { return last_loss_; }
  const torch::Tensor& skipped_steps() const { return skipped_; }

 private:
  void flatten() {
    std::vector<torch::Tensor> params;
    int64_t total = 0;
    for (auto& p : module_->parameters())
      if (p.requires_grad()) {
        params.push_back(p);
        total += p.numel();
      }
    const auto f32 = torch::dtype(torch::kFloat).device(device_);
    flat_params_ = torch::empty({total}, f32);
    flat_grad_ = torch::zeros({total}, f32);
    torch::NoGradGuard no_grad;
    int64_t offset = 0;
    for (auto& p : params) {
      const auto n = p.numel();
      auto view = flat_params_.narrow(0, offset, n);
      view.copy_(p.reshape({-1}));
      p.set_data(view.view(p.sizes()));
      p.mutable_grad() = flat_grad_.narrow(0, offset, n).view(p.sizes());
      offset += n;
    }
    trainkit::detail::FlatLayout layout;  // packed: this variant does not align
    layout.add(flat_params_.numel());
    groups_.push_back({flat_params_, flat_grad_, 1.0, true, layout});
  }

  // The same phase as trainkit::Trainer's (same calls), with run-time branches.
  void optimizer_phase() {
    const auto scaled_norm = at::linalg_vector_norm(flat_grad_, 2);
    const auto found_inf = at::nan_to_num(scaled_norm * 0.0, 1.0);
    const bool scaled = precision_ == RuntimePrecision::fp16_dynamic;
    torch::Tensor divisor = scaled ? scale_ : one_;
    const auto true_norm = scaled ? scaled_norm / divisor : scaled_norm;
    switch (clip_) {
      case RuntimeClip::none: break;
      case RuntimeClip::norm: divisor = divisor / at::div(bound_tensor_, true_norm + 1e-6).clamp_max(1.0); break;
      case RuntimeClip::value:
        flat_grad_.div_(divisor).clamp_(-bound_, bound_);
        divisor = torch::ones_like(divisor);
        break;
    }
    lrs_.assign(1, lr_table_.index_select(0, applied_));
    skipped_ = skipped_ + found_inf.to(torch::kLong);
    applied_ = at::rsub(skipped_, ++windows_);
    rule_->step(groups_, divisor, found_inf, lrs_, applied_);
    report_scale_ = scaled ? scale_.clone() : scale_;
    if (scaled) at::_amp_update_scale_(scale_, growth_tracker_, found_inf, 2.0, 0.5, 2000);
    report_norm_ = true_norm;
    flat_grad_.zero_();
    last_loss_ = window_loss_;
    position_ = 0;
  }

  std::shared_ptr<torch::nn::Module> module_;
  RuntimePrecision precision_;
  int64_t accumulation_;
  RuntimeClip clip_;
  double bound_;
  torch::Device device_ = torch::kCPU;
  std::unique_ptr<trainkit::detail::UpdateRule> rule_;
  std::vector<trainkit::detail::ParamGroup> groups_;
  std::vector<torch::Tensor> lrs_;
  torch::Tensor flat_params_, flat_grad_, scale_, growth_tracker_, applied_, skipped_, one_, bound_tensor_;
  int64_t windows_ = 0;
  torch::Tensor window_loss_, last_loss_, lr_table_, report_scale_, report_norm_;
  int64_t position_ = 0;
};

}  // namespace bench
