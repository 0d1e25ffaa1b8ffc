// optimizer_phase: a first figure of the optimizer phase (unscale + clip + AdamW update + zero)
// on a BERT-tiny-sized parameter set (~70 tensors, ~5 M parameters), trainkit's fused phase
// against torch::optim::AdamW + torch::nn::utils::clip_grad_norm_, measured in the same run,
// repetitions interleaved, medians printed, with the memory-bandwidth floor of the update.
//
// Both sides run the same trivial closure (loss = sum_i <p_i, c_i>, whose backward writes
// each gradient once); the closure + backward alone is timed too and subtracted, so the
// "phase" column is what each does after the backward.
#include <trainkit/trainkit.hpp>

#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <vector>

namespace tk = trainkit;

namespace {

struct BertTinyParams : torch::nn::Module {
  std::vector<torch::Tensor> params;
  BertTinyParams() {
    auto add = [&](std::vector<int64_t> shape) {
      params.push_back(register_parameter("p" + std::to_string(params.size()),
                                          torch::randn(shape) * 0.02));
    };
    add({8192, 256});  // word embeddings
    add({512, 256});   // positions
    add({2, 256});     // segments
    add({256});
    add({256});        // embedding layer norm
    for (int layer = 0; layer < 4; ++layer) {
      for (int i = 0; i < 4; ++i) {  // q, k, v, output
        add({256, 256});
        add({256});
      }
      add({256});
      add({256});  // attention layer norm
      add({1024, 256});
      add({1024});
      add({256, 1024});
      add({256});
      add({256});
      add({256});  // ffn layer norm
    }
    add({256, 256});
    add({256});  // pooler
  }
};

double now_ms() {
  return std::chrono::duration<double, std::milli>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}
double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  const int reps = argc > 1 ? std::atoi(argv[1]) : 15;
  const int iters = 10;
  torch::manual_seed(0);
  auto model_a = std::make_shared<BertTinyParams>();
  auto model_b = std::make_shared<BertTinyParams>();
  auto model_c = std::make_shared<BertTinyParams>();
  std::vector<torch::Tensor> coef;
  int64_t n = 0;
  for (auto& p : model_a->params) {
    coef.push_back(torch::randn_like(p));
    n += p.numel();
  }
  auto loss_of = [&](BertTinyParams& m) {
    torch::Tensor loss = torch::zeros({});
    for (size_t i = 0; i < m.params.size(); ++i) loss = loss + (m.params[i] * coef[i]).sum();
    return loss;
  };

  tk::Trainer<tk::PrecisionPolicy<tk::FP32>, tk::AccumulationPolicy<1>, tk::ClipPolicy<tk::ClipNorm>>
      trainer(model_a, tk::AdamW{1e-4, 1e-2}, tk::TrainerOptions().max_grad_norm(1.0));
  torch::optim::AdamW reference(model_b->parameters(), torch::optim::AdamWOptions(1e-4).weight_decay(1e-2));
  // Bandwidth floor: AdamW must read p, g, m, v and write p, m, v (7 fp32 values per
  // parameter), and zeroing writes g once more: 8 x 4 bytes per parameter.
  auto src = torch::randn({n}), dst = torch::empty({n});

  std::vector<double> t_trainkit, t_torch, t_backward, t_copy;
  for (int r = 0; r < reps; ++r) {
    double t0 = now_ms();
    for (int i = 0; i < iters; ++i) trainer.micro_step([&] { return loss_of(*model_a); });
    double t1 = now_ms();
    for (int i = 0; i < iters; ++i) {
      auto loss = loss_of(*model_b);
      loss.backward();
      torch::nn::utils::clip_grad_norm_(model_b->parameters(), 1.0);
      reference.step();
      reference.zero_grad();
    }
    double t2 = now_ms();
    for (int i = 0; i < iters; ++i) {
      auto loss = loss_of(*model_c);
      loss.backward();
      for (auto& p : model_c->params) p.mutable_grad() = torch::Tensor();
    }
    double t3 = now_ms();
    for (int i = 0; i < iters; ++i) dst.copy_(src);
    double t4 = now_ms();
    t_trainkit.push_back((t1 - t0) / iters);
    t_torch.push_back((t2 - t1) / iters);
    t_backward.push_back((t3 - t2) / iters);
    t_copy.push_back((t4 - t3) / iters);
  }
  const double bw = median(t_backward), copy = median(t_copy);
  const double tk_phase = median(t_trainkit) - bw, torch_phase = median(t_torch) - bw;
  const double bytes_per_ms = 8.0 * n / copy;  // a copy moves 8 bytes per element
  const double floor = 32.0 * n / bytes_per_ms;
  std::printf("optimizer phase, %zu tensors, %.2f M parameters, %d threads, median of %d x %d\n",
              model_a->params.size(), n / 1e6, torch::get_num_threads(), reps, iters);
  std::printf("  copy bandwidth            %8.2f GB/s\n", bytes_per_ms / 1e6);
  std::printf("  closure + backward        %8.3f ms\n", bw);
  std::printf("  %-26s%8.3f ms  (%.2fx the bandwidth floor)\n", "trainkit fused phase", tk_phase,
              tk_phase / floor);
  std::printf("  %-26s%8.3f ms  (%.2fx the bandwidth floor)\n", "torch::optim + clip_grad", torch_phase,
              torch_phase / floor);
  std::printf("  %-26s%8.3f ms\n", "bandwidth floor (32 B/p)", floor);
  std::printf("  speed-up of the phase     %8.2fx\n", torch_phase / tk_phase);
  std::printf("  whole step: trainkit %.3f ms, hand-written %.3f ms (%.2fx)\n", median(t_trainkit),
              median(t_torch), median(t_torch) / median(t_trainkit));
  return 0;
}
