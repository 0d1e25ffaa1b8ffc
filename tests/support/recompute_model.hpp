#pragma once
// The model and the run of tk::recompute's tests (tests/unit/test_recompute.cpp), shared with
// benchmarks/gpu/gpu_check.cpp, which runs the CUDA case on a GPU: two blocks, each called
// directly or through tk::recompute, and one forward and backward of it.
#include <trainkit/step/precision.hpp>
#include <trainkit/trainer/recompute.hpp>

#include <torch/torch.h>

#include <cstdint>
#include <functional>
#include <optional>
#include <vector>

namespace trainkit_testing::recompute_model {

namespace tk = trainkit;

// A transformer-ish block: x + LayerNorm(Dropout(GELU(Linear(x)))).
struct BlockImpl : torch::nn::Module {
  BlockImpl(std::int64_t d, double p)
      : fc(register_module("fc", torch::nn::Linear(d, d))),
        drop(register_module("drop", torch::nn::Dropout(p))),
        norm(register_module("norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({d})))) {}
  torch::Tensor forward(const torch::Tensor& x) { return x + norm(drop(torch::gelu(fc(x)))); }
  torch::nn::Linear fc;
  torch::nn::Dropout drop;
  torch::nn::LayerNorm norm;
};
TORCH_MODULE(Block);

// Two blocks, each either called directly or through tk::recompute.
struct TwoBlocksImpl : torch::nn::Module {
  explicit TwoBlocksImpl(std::int64_t d, double p = 0.1)
      : a(register_module("a", Block(d, p))), b(register_module("b", Block(d, p))) {}
  torch::Tensor forward(torch::Tensor x, bool wrapped) {
    if (!wrapped) return b(a(x));
    x = tk::recompute(a, x);
    return tk::recompute(b, x);
  }
  Block a, b;
};
TORCH_MODULE(TwoBlocks);

struct Run {
  torch::Tensor output, input_grad;
  std::vector<torch::Tensor> grads;  // clones, in parameters() order
  torch::Tensor rng_after;           // a draw after backward: the generator's state then
};

// Forward (inside `region` when given) and backward of sum(model(x) * w), from `seed`. The
// parameters' .grad are reset to undefined first unless `keep_grads`.
inline Run run(TwoBlocks& model, const torch::Tensor& x0, const torch::Tensor& w, bool wrapped, std::uint64_t seed,
               bool x_requires_grad = true, const std::function<std::optional<tk::AutocastRegion>()>& region = {},
               bool keep_grads = false) {
  if (!keep_grads)
    for (auto& p : model->parameters()) p.mutable_grad() = torch::Tensor();
  auto x = x0.detach().clone().requires_grad_(x_requires_grad);
  torch::manual_seed(seed);
  torch::Tensor y, loss;
  {
    auto guard = region ? region() : std::nullopt;
    y = model->forward(x, wrapped);
    loss = (y.to(torch::kFloat) * w).sum();
  }
  loss.backward();
  Run r{y.detach().clone(), x_requires_grad ? x.grad().clone() : torch::Tensor(), {}, torch::rand({16})};
  for (auto& p : model->parameters()) r.grads.push_back(p.grad().defined() ? p.grad().clone() : torch::Tensor());
  return r;
}

inline TwoBlocks make_model(std::int64_t d = 32) {
  torch::manual_seed(7);
  return TwoBlocks(d);
}

}  // namespace trainkit_testing::recompute_model
