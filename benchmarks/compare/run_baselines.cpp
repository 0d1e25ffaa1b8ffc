// (b) the hand-written LibTorch loop a C++ user writes without trainkit, the branching variant
// of trainkit's step (runtime_trainer.hpp), and the forward + backward alone (the limit of a
// window, with the optimizer phase's floor).
#include "harness.hpp"
#include "runtime_trainer.hpp"

#include <ATen/autocast_mode.h>
#include <torch/torch.h>

#include <optional>
#include <stdexcept>

namespace bench {
namespace {

/// What a user writes for autocast in C++: switch it on for the forward, off (and the weight
/// cache cleared) afterwards, as torch.autocast does.
class Autocast {
 public:
  Autocast(c10::DeviceType device, std::optional<at::ScalarType> dtype) : device_(device), on_(dtype) {
    if (!on_) return;
    at::autocast::set_autocast_enabled(device_, true);
    at::autocast::set_autocast_dtype(device_, *dtype);
    at::autocast::increment_nesting();
  }
  ~Autocast() {
    if (!on_) return;
    if (at::autocast::decrement_nesting() == 0) at::autocast::clear_cache();
    at::autocast::set_autocast_enabled(device_, false);
  }

 private:
  c10::DeviceType device_;
  bool on_;
};

/// A hand-rolled torch.amp.GradScaler (the same ATen kernels, the same host check in step()).
class GradScaler {
 public:
  explicit GradScaler(torch::Device device)
      : scale_(torch::full({1}, 65536.0, torch::dtype(torch::kFloat).device(device))),
        growth_tracker_(torch::zeros({1}, torch::dtype(torch::kInt).device(device))) {}
  torch::Tensor scale(const torch::Tensor& loss) const { return loss * scale_; }
  void unscale_(const std::vector<torch::Tensor>& params) {
    std::vector<torch::Tensor> grads;
    for (const auto& p : params)
      if (p.grad().defined()) grads.push_back(p.grad());
    found_inf_ = torch::zeros_like(scale_);
    at::_amp_foreach_non_finite_check_and_unscale_(grads, found_inf_, scale_.reciprocal());
  }
  void step(torch::optim::Optimizer& optimizer) {
    if (found_inf_.item<float>() == 0.0f) optimizer.step();
    else ++skipped_;
  }
  void update() { at::_amp_update_scale_(scale_, growth_tracker_, found_inf_, 2.0, 0.5, 2000); }
  int64_t skipped() const { return skipped_; }

 private:
  torch::Tensor scale_, growth_tracker_, found_inf_;
  int64_t skipped_ = 0;
};

std::optional<at::ScalarType> autocast_dtype(const std::string& precision) {
  if (precision == "fp32") return std::nullopt;
  if (precision == "bf16") return at::kBFloat16;
  if (precision == "fp16") return at::kHalf;
  throw std::invalid_argument("unknown precision '" + precision + "' (fp32, bf16, fp16)");
}

}  // namespace

Result run_libtorch(const Settings& s, Task& task) {
  const auto dtype = autocast_dtype(s.precision);
  const bool fp16 = s.precision == "fp16";
  auto params = task.module->parameters();
  torch::optim::AdamW optimizer(params, torch::optim::AdamWOptions(s.lr).weight_decay(s.weight_decay));
  GradScaler scaler(s.device);
  int64_t k = 0;
  Result r = measure(s, [&](PhaseStart& phase) -> std::function<double()> {
    auto window_loss = torch::zeros({}, torch::dtype(torch::kFloat).device(s.device));
    for (int64_t i = 0; i < s.accum; ++i) {
      torch::Tensor loss;
      {
        Autocast autocast(s.device.type(), dtype);
        loss = task.loss(k++);
      }
      loss = loss / static_cast<double>(s.accum);
      window_loss += loss.detach();
      if (fp16) scaler.scale(loss).backward();
      else loss.backward();
    }
    if (s.time_phase) {
      synchronize(s.device);
      phase.mark();
    }
    if (fp16) scaler.unscale_(params);
    torch::nn::utils::clip_grad_norm_(params, s.max_norm);
    if (fp16) {
      scaler.step(optimizer);
      scaler.update();
    } else {
      optimizer.step();
    }
    optimizer.zero_grad(/*set_to_none=*/!s.keep_grads);
    return [window_loss] { return window_loss.item<double>(); };
  });
  r.skipped = scaler.skipped();
  return r;
}

Result run_branching(const Settings& s, Task& task) {
  const auto precision = s.precision == "fp32"   ? RuntimePrecision::fp32
                         : s.precision == "bf16" ? RuntimePrecision::bf16
                         : s.precision == "fp16" ? RuntimePrecision::fp16_dynamic
                                                 : throw std::invalid_argument("unknown precision");
  RuntimeTrainer trainer(task.module, trainkit::AdamW{s.lr, s.weight_decay}, precision, s.accum,
                         RuntimeClip::norm, s.max_norm);
  int64_t k = 0;
  Result r = measure(s, [&](PhaseStart& phase) -> std::function<double()> {
    for (;;) {
      const bool closed = trainer.micro_step([&] {
        auto loss = task.loss(k++);
        return s.time_phase ? stamp_backward_end(loss, &phase, s.device) : loss;
      });
      if (closed) return [loss = trainer.last_loss()] { return loss.item<double>(); };
    }
  });
  r.skipped = trainer.skipped_steps().item<int64_t>();
  return r;
}

Result run_fwdbwd(const Settings& s, Task& task) {
  // The micro-steps of a window and nothing else: the same batches, autocast region, loss / N
  // and backward as every implementation, no optimizer phase. The gradients are never zeroed
  // (nor reset to undefined), so every backward accumulates into an existing gradient in place,
  // as into trainkit's flat gradient storage; zeroing belongs to the optimizer phase's floor.
  // The values grow over the windows, which changes nothing in the time of an add. FP16 runs
  // without a loss scale (the products cost the same; an overflow would change no timing).
  Settings timed = s;
  timed.time_phase = false;  // there is no optimizer phase
  int64_t k = 0;
  return measure(timed, [&](PhaseStart&) -> std::function<double()> {
    return [window_loss = fwdbwd_window(s, task, k)] { return window_loss.item<double>(); };
  });
}

torch::Tensor fwdbwd_window(const Settings& s, Task& task, int64_t& k) {
  const auto dtype = autocast_dtype(s.precision);
  auto window_loss = torch::zeros({}, torch::dtype(torch::kFloat).device(s.device));
  for (int64_t i = 0; i < s.accum; ++i) {
    torch::Tensor loss;
    {
      Autocast autocast(s.device.type(), dtype);
      loss = task.loss(k++);
    }
    loss = loss / static_cast<double>(s.accum);
    window_loss += loss.detach();
    loss.backward();
  }
  return window_loss;
}

double fused_adamw_ms(int64_t n, torch::Device device, int reps) {
  // One flat fp32 tensor each for p, g, m, v (as trainkit stores them), with the divisor and
  // found_inf device scalars trainkit hands the kernel, then zeroing g: the phase's update and
  // zeroing with nothing else (no norm, no bookkeeping).
  const auto f32 = torch::dtype(torch::kFloat).device(device);
  auto p = torch::randn({n}, f32), g = torch::randn({n}, f32) * 1e-3;
  auto m = torch::zeros({n}, f32), v = torch::zeros({n}, f32);
  auto step = torch::zeros({}, f32), lr = torch::full({}, 1e-4, f32);
  auto divisor = torch::ones({}, f32), found_inf = torch::zeros({}, f32);
  std::vector<double> ms;
  for (int i = 0; i < reps + 2; ++i) {
    synchronize(device);
    const double t0 = now_ms();
    at::_fused_adamw_({p}, {g}, {m}, {v}, {}, {step}, lr, 0.9, 0.999, 1e-2, 1e-8, /*amsgrad=*/false,
                      /*maximize=*/false, divisor, found_inf);
    g.zero_();
    synchronize(device);
    if (i >= 2) ms.push_back(now_ms() - t0);
  }
  return median(ms);
}

}  // namespace bench
