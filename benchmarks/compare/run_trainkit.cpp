// (a) trainkit: the compiled Trainer of the configuration, fused AdamW, ClipNorm.
// Compiled types: FP32 with 1, 2, 4, 8 micro-batches (the memory sweep), BF16 and FP16Dynamic
// with 1 and 4; other FP32 counts run on AccumulationPolicy<Dynamic>, as tk::dispatch would.
// Master weights (trainkit only): FP16Dynamic with 1 and AccumulationPolicy<Dynamic>, BF16 with
// AccumulationPolicy<Dynamic>.
#include "harness.hpp"

#include <trainkit/trainkit.hpp>

#include <stdexcept>

namespace tk = trainkit;

namespace bench {
namespace {

template <class Trainer>
Result run_compiled(const Settings& s, Task& task) {
  Trainer trainer(task.module, tk::AdamW{s.lr, s.weight_decay},
                  tk::TrainerOptions().max_grad_norm(s.max_norm).accumulation_steps(s.accum));
  int64_t k = 0;
  // --interleave-fwdbwd: the forward + backward alone after each window, into the trainer's
  // gradients (which the window's phase left zeroed), zeroed again before the next window.
  std::vector<double> fwdbwd_ms;
  Settings timed = s;
  int64_t k_fwdbwd = 0;
  if (s.interleave_fwdbwd)
    timed.after_window = [&](bool counted) {
      synchronize(s.device);
      const double t0 = now_ms();
      fwdbwd_window(s, task, k_fwdbwd);
      synchronize(s.device);
      if (counted) fwdbwd_ms.push_back(now_ms() - t0);
      torch::NoGradGuard no_grad;
      for (auto& p : task.module->parameters())
        if (p.grad().defined()) p.grad().zero_();
    };
  Result r = measure(timed, [&](PhaseStart& phase) -> std::function<double()> {
    for (;;) {
      auto step = trainer.micro_step([&] {
        auto loss = task.loss(k++);
        return s.time_phase ? stamp_backward_end(loss, &phase, s.device) : loss;
      });
      if (step.window_closed) return [report = step.report] { return report.loss(); };
    }
  });
  r.skipped = trainer.skipped_steps().template item<int64_t>();
  r.fwdbwd_ms = std::move(fwdbwd_ms);
  return r;
}

template <class Mode>
Result run_precision(const Settings& s, Task& task) {
  using P = tk::PrecisionPolicy<Mode>;
  using Clip = tk::ClipPolicy<tk::ClipNorm>;
  switch (s.accum) {
    case 1: return run_compiled<tk::Trainer<P, tk::AccumulationPolicy<1>, Clip>>(s, task);
    case 4: return run_compiled<tk::Trainer<P, tk::AccumulationPolicy<4>, Clip>>(s, task);
    default: break;
  }
  if constexpr (std::is_same_v<Mode, tk::FP32>) {
    if (s.accum == 2) return run_compiled<tk::Trainer<P, tk::AccumulationPolicy<2>, Clip>>(s, task);
    if (s.accum == 8) return run_compiled<tk::Trainer<P, tk::AccumulationPolicy<8>, Clip>>(s, task);
    return run_compiled<tk::Trainer<P, tk::AccumulationPolicy<tk::Dynamic>, Clip>>(s, task);
  }
  throw std::invalid_argument(std::string("trainkit ") + Mode::name + ": accumulation " +
                              std::to_string(s.accum) + " is not compiled here (1 or 4)");
}

}  // namespace

Result run_trainkit(const Settings& s, Task& task) {
  // FP16 / BF16 with fp32 master weights (the model stored in half): trainkit only (the other
  // implementations have no such mode).
  using Clip = tk::ClipPolicy<tk::ClipNorm>;
  if (s.precision == "fp16master") {
    using P = tk::PrecisionPolicy<tk::MasterWeights<tk::FP16Dynamic>>;
    if (s.accum == 1) return run_compiled<tk::Trainer<P, tk::AccumulationPolicy<1>, Clip>>(s, task);
    return run_compiled<tk::Trainer<P, tk::AccumulationPolicy<tk::Dynamic>, Clip>>(s, task);
  }
  if (s.precision == "bf16master") {
    using P = tk::PrecisionPolicy<tk::MasterWeights<tk::BF16>>;
    return run_compiled<tk::Trainer<P, tk::AccumulationPolicy<tk::Dynamic>, Clip>>(s, task);
  }
  if (s.precision == "fp32") return run_precision<tk::FP32>(s, task);
  if (s.precision == "bf16") return run_precision<tk::BF16>(s, task);
  if (s.precision == "fp16") return run_precision<tk::FP16Dynamic>(s, task);
  throw std::invalid_argument("unknown precision '" + s.precision + "' (fp32, bf16, fp16, fp16master, bf16master)");
}

}  // namespace bench
