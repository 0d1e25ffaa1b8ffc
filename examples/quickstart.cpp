// quickstart: a small MLP learns a synthetic regression task with a compiled Trainer
// (FP32 by default; `quickstart bf16` or `quickstart fp16` for mixed precision on this device).
#include <trainkit/trainkit.hpp>

#include <torch/torch.h>

#include <cstdio>
#include <string>

namespace tk = trainkit;

struct MlpImpl : torch::nn::Module {
  MlpImpl(int in, int hidden, int out)
      : fc1(register_module("fc1", torch::nn::Linear(in, hidden))),
        fc2(register_module("fc2", torch::nn::Linear(hidden, out))) {}
  torch::Tensor forward(torch::Tensor x) { return fc2(torch::gelu(fc1(x))); }
  torch::nn::Linear fc1, fc2;
};
TORCH_MODULE(Mlp);

template <class Trainer>
int train(const char* label) {
  torch::manual_seed(0);
  // A fixed random teacher makes the targets: the task is learnable and deterministic.
  const auto teacher = torch::randn({16, 4});
  const auto x = torch::randn({4096, 16});
  const auto y = torch::tanh(x.matmul(teacher));

  Mlp model(16, 64, 4);
  Trainer trainer(model, tk::AdamW{3e-3, 1e-4}, tk::TrainerOptions().max_grad_norm(1.0));
  std::printf("%s: %s, %lld parameters\n", label, Trainer::name().c_str(),
              static_cast<long long>(trainer.parameter_count()));
  const int micro_batch = 64;
  for (int epoch = 0; epoch < 5; ++epoch) {
    double loss_sum = 0;
    int windows = 0;
    for (int i = 0; i + micro_batch <= x.size(0); i += micro_batch) {
      const auto xb = x.narrow(0, i, micro_batch), yb = y.narrow(0, i, micro_batch);
      auto r = trainer.micro_step([&] { return torch::mse_loss(model(xb), yb); });
      if (r.window_closed) {
        loss_sum += r.report.loss();  // asks for a value: one host sync per window here
        ++windows;
      }
    }
    trainer.flush();
    std::printf("epoch %d  loss %.5f  (%d optimizer steps, %lld skipped)\n", epoch,
                loss_sum / windows, windows,
                static_cast<long long>(trainer.skipped_steps().template item<int64_t>()));
  }
  return 0;
}

constexpr const char* kUsage =
    "usage: quickstart [fp32|bf16|fp16]\n"
    "Trains a small MLP on a synthetic regression task for 5 epochs and prints each epoch's loss.\n"
    "  fp32        FP32 (the default)\n"
    "  bf16        BF16 autocast\n"
    "  fp16        FP16 with a dynamic loss scale\n"
    "  -h, --help  this text\n";

int main(int argc, char** argv) {
  const std::string mode = argc > 1 ? argv[1] : "fp32";
  if (mode == "-h" || mode == "--help") {
    std::fputs(kUsage, stdout);
    return 0;
  }
  using Acc = tk::AccumulationPolicy<4>;
  using Clip = tk::ClipPolicy<tk::ClipNorm>;
  if (mode == "fp32") return train<tk::Trainer<tk::PrecisionPolicy<tk::FP32>, Acc, Clip>>("fp32");
  if (mode == "bf16") return train<tk::Trainer<tk::PrecisionPolicy<tk::BF16>, Acc, Clip>>("bf16");
  if (mode == "fp16")
    return train<tk::Trainer<tk::PrecisionPolicy<tk::FP16Dynamic>, Acc, Clip>>("fp16");
  std::fprintf(stderr, "quickstart: unknown mode '%s'\n%s", mode.c_str(), kUsage);
  return 2;
}
