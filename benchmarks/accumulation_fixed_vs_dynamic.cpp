// Is a compile-time accumulation count faster than AccumulationPolicy<Dynamic>? And does the
// step through AnyTrainer (what tk::fit and make_trainer's programs run) cost anything?
//
//   build/benchmarks/accumulation_fixed_vs_dynamic [--reps R] [--windows W] [--precision FP32|BF16|FP16Dynamic]
//
// For N in {1, 2, 4, 8} and FP32 / BF16 / FP16Dynamic, on an overhead-bound MLP (4 Linear
// layers of width 256, 32 samples; where a host-side difference in the step would show most),
// trains Trainer<P, AccumulationPolicy<N>, ClipNorm> and Trainer<P, AccumulationPolicy<Dynamic>,
// ClipNorm> with accumulation_steps N on identical copies of the model and data, alternating
// W windows of each, R times; and the same Dynamic trainer type driven through an AnyTrainer&
// (one virtual call and one std::function per micro-step). Prints the median time per window of
// each, the median of the paired ratios fixed / Dynamic (< 1: the fixed count is faster) with
// their range, and AnyTrainer / concrete (> 1: the interface costs time).
// The registry (registry.hpp) compiles Dynamic only because fixed / Dynamic is 1 within noise.
#include <trainkit/trainkit.hpp>

#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

namespace tk = trainkit;

namespace {

struct MlpImpl : torch::nn::Module {
  MlpImpl() {
    int64_t width = 128;
    for (int i = 0; i < 4; ++i) {
      const int64_t next = i == 3 ? 16 : 256;
      fc.push_back(register_module("fc" + std::to_string(i), torch::nn::Linear(width, next)));
      width = next;
    }
  }
  torch::Tensor forward(torch::Tensor x) {
    for (size_t i = 0; i < fc.size(); ++i) {
      x = fc[i](x);
      if (i + 1 < fc.size()) x = torch::gelu(x);
    }
    return x;
  }
  std::vector<torch::nn::Linear> fc;
};
TORCH_MODULE(Mlp);

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const auto n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

// Seconds per window over `windows` windows of n micro-batches. With T = tk::AnyTrainer the
// micro-step goes through the interface, as in tk::fit (not inlined, so the compiler cannot
// see the concrete type and devirtualise).
template <class T>
[[gnu::noinline]] double time_windows(T& trainer, Mlp& model, const torch::Tensor& x, const torch::Tensor& y, int n,
                                      int windows) {
  const auto t0 = std::chrono::steady_clock::now();
  for (int w = 0; w < windows; ++w)
    for (int i = 0; i < n; ++i) {
      const auto xb = x.narrow(0, 32 * i, 32), yb = y.narrow(0, 32 * i, 32);
      trainer.micro_step([&] { return torch::mse_loss(model(xb), yb); });
    }
  // The step reports are never read: end on a value so that queued work is counted.
  (void)trainer.applied_steps().template item<std::int64_t>();
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / windows;
}

template <class Precision, int N>
void row(int reps, int windows) {
  using Fixed = tk::TrainerOf<Precision, N, tk::ClipNorm>;
  using Dyn = tk::TrainerOf<Precision, tk::Dynamic, tk::ClipNorm>;
  torch::manual_seed(0);
  Mlp a, b, c;
  {
    torch::NoGradGuard no_grad;
    for (size_t i = 0; i < a->parameters().size(); ++i) {
      b->parameters()[i].copy_(a->parameters()[i]);
      c->parameters()[i].copy_(a->parameters()[i]);
    }
  }
  const auto x = torch::randn({32 * N, 128}), y = torch::randn({32 * N, 16});
  const auto options = tk::TrainerOptions().max_grad_norm(1.0).accumulation_steps(N);
  Fixed fixed(a, tk::AdamW{1e-4, 1e-4}, options);
  Dyn dynamic(b, tk::AdamW{1e-4, 1e-4}, options);
  Dyn erased_trainer(c, tk::AdamW{1e-4, 1e-4}, options);
  tk::AnyTrainer& erased = erased_trainer;
  time_windows(fixed, a, x, y, N, windows / 4 + 1);  // warm-up
  time_windows(dynamic, b, x, y, N, windows / 4 + 1);
  time_windows(erased, c, x, y, N, windows / 4 + 1);
  std::vector<double> tf, td, te, ratio, erased_ratio;
  for (int r = 0; r < reps; ++r) {
    // Rotate which goes first, so drift in the machine's load hits all alike.
    double f = 0, d = 0, e = 0;
    for (int k = 0; k < 3; ++k) switch ((r + k) % 3) {
        case 0: f = time_windows(fixed, a, x, y, N, windows); break;
        case 1: d = time_windows(dynamic, b, x, y, N, windows); break;
        default: e = time_windows(erased, c, x, y, N, windows); break;
      }
    tf.push_back(f), td.push_back(d), te.push_back(e), ratio.push_back(f / d), erased_ratio.push_back(e / d);
  }
  std::printf("| %-11s | %d | %8.1f | %8.1f | %8.1f | %.3f (%.3f-%.3f) | %.3f (%.3f-%.3f) |\n", Precision::name, N,
              1e6 * median(tf), 1e6 * median(td), 1e6 * median(te), median(ratio),
              *std::min_element(ratio.begin(), ratio.end()), *std::max_element(ratio.begin(), ratio.end()),
              median(erased_ratio), *std::min_element(erased_ratio.begin(), erased_ratio.end()),
              *std::max_element(erased_ratio.begin(), erased_ratio.end()));
  std::fflush(stdout);
}

template <class Precision>
void rows(int reps, int windows) {
  row<Precision, 1>(reps, windows);
  row<Precision, 2>(reps, windows);
  row<Precision, 4>(reps, windows);
  row<Precision, 8>(reps, windows);
}

}  // namespace

int main(int argc, char** argv) {
  int reps = 9, windows = 40;
  std::string only;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string a = argv[i];
    if (a == "--reps") reps = std::atoi(argv[i + 1]);
    else if (a == "--windows") windows = std::atoi(argv[i + 1]);
    else if (a == "--precision") only = argv[i + 1];
    else {
      std::fprintf(stderr, "usage: accumulation_fixed_vs_dynamic [--reps R] [--windows W] [--precision P]\n");
      return 2;
    }
  }
  if (std::getenv("OMP_NUM_THREADS") == nullptr) torch::set_num_threads(1);
  std::printf("MLP 128-256-256-256-16, 32 samples per micro-batch, AdamW, ClipNorm; %d repetitions of %d windows, "
              "%d thread(s)\n\n",
              reps, windows, torch::get_num_threads());
  std::printf("| precision | N | fixed us/window | Dynamic us/window | Dynamic via AnyTrainer us/window | "
              "fixed / Dynamic, median (range) | AnyTrainer / concrete, median (range) |\n");
  std::printf("|---|---|---|---|---|---|---|\n");
  if (only.empty() || only == "FP32") rows<tk::FP32>(reps, windows);
  if (only.empty() || only == "BF16") rows<tk::BF16>(reps, windows);
  if (only.empty() || only == "FP16Dynamic") rows<tk::FP16Dynamic>(reps, windows);
}
