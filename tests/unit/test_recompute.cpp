// tk::recompute (recompute.hpp): a recomputed forward gives the direct call's gradients bit for
// bit (dropout and BF16 autocast included), adds into existing .grad in place, reaches the
// parameters when no input requires grad, leaves the generators and autocast as they were,
// refuses grad() and create_graph, and lowers the peak memory of a stack of layers.
#include <trainkit/step/precision.hpp>
#include <trainkit/trainer/recompute.hpp>
#include <trainkit/trainer/trainer.hpp>

#include "../support/recompute_model.hpp"

#include <doctest/doctest.h>
#include <torch/torch.h>

#include <cstdint>
#include <fstream>
#include <functional>
#include <string>
#include <vector>

#include <malloc.h>

namespace test_recompute {  // this file's names, apart from those of the files it shares a unity batch with

namespace tk = trainkit;

namespace {

using namespace trainkit_testing::recompute_model;

void check_equal_runs(const Run& a, const Run& b) {
  CHECK(torch::equal(a.output, b.output));
  if (a.input_grad.defined() || b.input_grad.defined()) CHECK(torch::equal(a.input_grad, b.input_grad));
  REQUIRE(a.grads.size() == b.grads.size());
  for (std::size_t i = 0; i < a.grads.size(); ++i) {
    CAPTURE(i);
    REQUIRE(a.grads[i].defined());
    REQUIRE(b.grads[i].defined());
    CHECK(torch::equal(a.grads[i], b.grads[i]));
  }
  CHECK(torch::equal(a.rng_after, b.rng_after));
}

}  // namespace

TEST_CASE("recompute: input and parameter gradients equal the direct call's bit for bit, dropout included") {
  auto model = make_model();
  const auto x = torch::randn({64, 32});
  const auto w = torch::randn({64, 32});
  const Run direct = run(model, x, w, /*wrapped=*/false, 123);
  const Run wrapped = run(model, x, w, /*wrapped=*/true, 123);
  check_equal_runs(direct, wrapped);
  // The dropout masks matter: another seed gives other gradients, so the equality above is the
  // recomputation drawing the forward's masks.
  const Run other = run(model, x, w, /*wrapped=*/true, 124);
  CHECK_FALSE(torch::equal(other.grads[0], direct.grads[0]));
}

TEST_CASE("recompute: gradients are added in place into the existing .grad (data_ptr kept)") {
  auto model = make_model();
  const auto x = torch::randn({64, 32});
  const auto w = torch::randn({64, 32});
  const Run reference = run(model, x, w, /*wrapped=*/false, 5);

  // As the trainer does: every .grad a view into one flat buffer, here holding 0.5.
  std::int64_t total = 0;
  for (const auto& p : model->parameters()) total += p.numel();
  auto flat = torch::full({total}, 0.5);
  std::vector<const void*> pointers;
  std::int64_t offset = 0;
  for (auto& p : model->parameters()) {
    p.mutable_grad() = flat.narrow(0, offset, p.numel()).view(p.sizes());
    offset += p.numel();
    pointers.push_back(p.grad().data_ptr());
  }

  run(model, x, w, /*wrapped=*/true, 5, true, {}, /*keep_grads=*/true);
  run(model, x, w, /*wrapped=*/true, 5, true, {}, /*keep_grads=*/true);
  const auto params = model->parameters();
  for (std::size_t i = 0; i < params.size(); ++i) {
    CAPTURE(i);
    REQUIRE(params[i].grad().defined());
    CHECK(params[i].grad().data_ptr() == pointers[i]);
    CHECK(torch::equal(params[i].grad(), (0.5 + reference.grads[i]) + reference.grads[i]));
  }
}

TEST_CASE("recompute: inputs that do not require grad still give the parameters their gradients") {
  auto model = make_model();
  const auto x = torch::randn({64, 32});
  const auto w = torch::randn({64, 32});
  const Run direct = run(model, x, w, /*wrapped=*/false, 9, /*x_requires_grad=*/false);
  const Run wrapped = run(model, x, w, /*wrapped=*/true, 9, /*x_requires_grad=*/false);
  check_equal_runs(direct, wrapped);

  SUBCASE("a callable (parameters unknown to recompute) too") {
    torch::manual_seed(3);
    torch::nn::Linear fc(8, 4);
    const auto in = torch::randn({5, 8});
    const auto y = tk::recompute([fc](const torch::Tensor& t) mutable { return torch::tanh(fc(t)); }, in);
    CHECK(y.requires_grad());
    y.sum().backward();
    const auto wrapped_grad = fc->weight.grad().clone();
    fc->weight.mutable_grad() = torch::Tensor();
    torch::tanh(fc(in)).sum().backward();
    CHECK(torch::equal(wrapped_grad, fc->weight.grad()));
  }
  SUBCASE("a frozen module with such inputs is simply called: nothing requires grad") {
    Block frozen(8, 0.0);
    for (auto& p : frozen->parameters()) p.requires_grad_(false);
    CHECK_FALSE(tk::recompute(frozen, torch::randn({2, 8})).requires_grad());
  }
  SUBCASE("grad mode off (evaluation): simply called") {
    torch::NoGradGuard no_grad;
    CHECK_FALSE(tk::recompute(model->a, torch::randn({2, 32})).requires_grad());
  }
}

TEST_CASE("recompute: under BF16 autocast (closed before backward) the gradients equal the direct call's") {
  auto model = make_model();
  const auto x = torch::randn({64, 32});
  const auto w = torch::randn({64, 32});
  const auto bf16 = [] { return std::optional<tk::AutocastRegion>(std::in_place, c10::kCPU, at::kBFloat16); };
  const Run direct = run(model, x, w, /*wrapped=*/false, 11, true, bf16);
  const Run wrapped = run(model, x, w, /*wrapped=*/true, 11, true, bf16);
  check_equal_runs(direct, wrapped);
  // Autocast matters here, so the equality is the recomputation re-entering it.
  const Run fp32 = run(model, x, w, /*wrapped=*/true, 11);
  CHECK_FALSE(torch::equal(fp32.grads[0], direct.grads[0]));
  // The backward left autocast as it found it.
  CHECK_FALSE(at::autocast::is_autocast_enabled(c10::kCPU));
  CHECK(at::autocast::is_autocast_cache_enabled());

  SUBCASE("a weight used again outside recompute in the same region still gets its full gradient") {
    // The no-grad forward must not leave a grad-less cast of fc's weight in autocast's cache
    // (AutocastCacheOff). A regression guard for LibTorch before pytorch#165068: from 2.11 on
    // the cache itself is safe, and this passes without the guard too.
    torch::manual_seed(4);
    torch::nn::Linear fc(16, 16);
    const auto in = torch::randn({8, 16});
    const auto loss_of = [&](bool wrapped) {
      fc->weight.mutable_grad() = torch::Tensor();
      torch::Tensor loss;
      {
        tk::AutocastRegion region(c10::kCPU, at::kBFloat16);
        const auto h = wrapped ? tk::recompute(fc, in) : fc(in);
        loss = fc(h).to(torch::kFloat).pow(2).sum();
      }
      loss.backward();
      return fc->weight.grad().clone();
    };
    CHECK(torch::equal(loss_of(true), loss_of(false)));
  }
}

TEST_CASE("recompute: the generators after backward are those of the direct call") {
  // Checked in every run above (rng_after); here the CPU generator between forward and backward
  // is moved on, and the recomputation still draws the forward's masks.
  auto model = make_model();
  const auto x = torch::randn({64, 32});
  torch::manual_seed(1);
  const auto direct = model->forward(x, false);
  torch::manual_seed(1);
  const auto wrapped = model->forward(x, true);
  torch::rand({1000});  // moves the generator on
  const auto state = at::detail::getDefaultCPUGenerator().get_state();
  wrapped.sum().backward();
  CHECK(torch::equal(at::detail::getDefaultCPUGenerator().get_state(), state));
  const auto g_wrapped = model->a->fc->weight.grad().clone();
  model->zero_grad();
  direct.sum().backward();
  CHECK(torch::equal(g_wrapped, model->a->fc->weight.grad()));
}

TEST_CASE("recompute: grad(), create_graph and a forward that changes are refused with a clear error") {
  torch::manual_seed(2);
  torch::nn::Linear fc(4, 4);
  const auto x = torch::randn({3, 4}, torch::requires_grad());
  CHECK_THROWS_WITH(torch::autograd::grad({tk::recompute(fc, x).sum()}, {x}),
                    doctest::Contains("torch::autograd::grad() and backward(..., inputs) are not supported"));
  CHECK_THROWS_WITH(tk::recompute(fc, x).sum().backward({}, /*retain_graph=*/true, /*create_graph=*/true),
                    doctest::Contains("create_graph=true"));
  int calls = 0;
  const auto changing = [fc, &calls](const torch::Tensor& t) mutable {
    return ++calls == 1 ? fc(t) : fc(t).narrow(0, 0, 2);
  };
  CHECK_THROWS_WITH(tk::recompute(changing, x).sum().backward(), doctest::Contains("fn must do the same on both runs"));
  CHECK_THROWS_WITH(tk::recompute(fc, torch::Tensor()), doctest::Contains("input 0 is an undefined tensor"));
}

TEST_CASE("recompute: several inputs and outputs") {
  torch::manual_seed(6);
  torch::nn::Linear fc(8, 8);
  const auto x = torch::randn({4, 8}, torch::requires_grad());
  const auto m = torch::randn({4, 8});
  const auto fn = [fc](const torch::Tensor& a, const torch::Tensor& b) mutable {
    const auto h = fc(a * b);
    return std::vector<torch::Tensor>{h, torch::relu(h) + a};
  };
  const auto outs = tk::recompute(fn, x, m);
  (outs[0].pow(2).sum() + outs[1].sum()).backward();
  const auto gx = x.grad().clone(), gw = fc->weight.grad().clone();
  x.mutable_grad() = torch::Tensor();
  fc->weight.mutable_grad() = torch::Tensor();
  auto fn2 = fn;
  const auto ref = fn2(x, m);
  (ref[0].pow(2).sum() + ref[1].sum()).backward();
  CHECK(torch::equal(gx, x.grad()));
  CHECK(torch::equal(gw, fc->weight.grad()));
}

namespace {

std::int64_t status_kb(const std::string& key) {
  std::ifstream in("/proc/self/status");
  std::string line;
  while (std::getline(in, line))
    if (line.rfind(key + ":", 0) == 0) return std::stoll(line.substr(key.size() + 1));
  return -1;
}

// The process's peak resident set during `f`, above the resident set at its start (kB).
// Resetting VmHWM: "5" into /proc/self/clear_refs (Linux >= 4.0).
std::int64_t peak_rss_growth_kb(const std::function<void()>& f) {
  malloc_trim(0);
  std::ofstream("/proc/self/clear_refs") << "5";
  const auto base = status_kb("VmRSS");
  f();
  return status_kb("VmHWM") - base;
}

}  // namespace

TEST_CASE("recompute: a torch::nn::Sequential (whose forward is a template) gives the direct call's gradients") {
  torch::manual_seed(3);
  torch::nn::Sequential seq(torch::nn::Linear(16, 32), torch::nn::GELU(), torch::nn::Dropout(0.2),
                            torch::nn::Linear(32, 16));
  const auto x0 = torch::randn({8, 16});
  const auto grads = [&](bool wrapped) {
    for (auto& p : seq->parameters()) p.mutable_grad() = torch::Tensor();
    auto x = x0.clone().requires_grad_();
    torch::manual_seed(11);
    const auto y = wrapped ? tk::recompute(seq, x) : seq->forward(x);
    y.pow(2).sum().backward();
    std::vector<torch::Tensor> out{y.detach(), x.grad()};
    for (auto& p : seq->parameters()) out.push_back(p.grad().clone());
    return out;
  };
  const auto direct = grads(false), wrapped = grads(true);
  REQUIRE(direct.size() == wrapped.size());
  for (std::size_t i = 0; i < direct.size(); ++i) {
    CAPTURE(i);
    CHECK(torch::equal(direct[i], wrapped[i]));
  }
}

TEST_CASE("recompute: a stack of 8 wrapped layers has a clearly lower peak memory (forward + backward)") {
  // Large blocks are mmapped and unmapped at free, so the resident set follows the live tensors
  // (glibc would otherwise raise its mmap threshold and keep freed activations resident).
  mallopt(M_MMAP_THRESHOLD, 256 * 1024);
  constexpr std::int64_t rows = 16384, d = 256, layers = 8;  // one activation: 16 MiB
  torch::manual_seed(0);
  std::vector<Block> stack;
  for (int i = 0; i < layers; ++i) stack.emplace_back(d, 0.1);
  const auto x = torch::randn({rows, d});
  const auto step = [&](bool wrapped) {
    auto h = x;
    for (auto& block : stack) h = wrapped ? tk::recompute(block, h) : block(h);
    h.sum().backward();
  };
  step(false);  // warm-up: .grad allocated, kernels' workspaces made
  const auto wrapped_kb = peak_rss_growth_kb([&] { step(true); });
  const auto direct_kb = peak_rss_growth_kb([&] { step(false); });
  MESSAGE("peak resident-set growth during forward+backward of 8 layers on [" << rows << ", " << d
          << "] fp32: direct " << direct_kb / 1024 << " MiB, recomputed " << wrapped_kb / 1024 << " MiB (ratio "
          << static_cast<double>(wrapped_kb) / static_cast<double>(direct_kb) << ")");
  CHECK(direct_kb > 200 * 1024);
  CHECK(wrapped_kb < direct_kb / 2);
}

TEST_CASE("recompute on CUDA: gradients, dropout masks and FP16 autocast as the direct call") {
  if (!torch::cuda::is_available()) {
    MESSAGE("skipped: no CUDA device (torch::cuda::is_available() is false)");
    return;
  }
  auto model = make_model();
  model->to(torch::kCUDA);
  const auto x = torch::randn({64, 32}).cuda();
  const auto w = torch::randn({64, 32}).cuda();
  SUBCASE("fp32, and the CUDA generator put back after the recomputation") {
    check_equal_runs(run(model, x, w, false, 21), run(model, x, w, true, 21));
    const auto cuda_state = [] {
      return at::globalContext().defaultGenerator(torch::Device(torch::kCUDA, 0)).get_state();
    };
    torch::manual_seed(21);
    const auto loss = model->forward(x.clone().requires_grad_(), true).sum();
    torch::rand({1000}, torch::kCUDA);  // moves the CUDA generator on
    const auto state = cuda_state();
    loss.backward();
    CHECK(torch::equal(cuda_state(), state));
  }
  SUBCASE("fp16 autocast") {
    const auto fp16 = [] { return std::optional<tk::AutocastRegion>(std::in_place, c10::kCUDA, at::kHalf); };
    const Run direct = run(model, x, w, false, 22, true, fp16);
    const Run wrapped = run(model, x, w, true, 22, true, fp16);
    check_equal_runs(direct, wrapped);
    CHECK_FALSE(at::autocast::is_autocast_enabled(c10::kCUDA));
  }
}

// Inside trainkit's Trainer: the .grad are views into the trainer's flat storage (fp32, or half
// with master weights), and autocast closes before backward. A model whose blocks are
// recomputed trains to the same parameters, bit for bit, as one that keeps its activations.
TEST_CASE_TEMPLATE("a Trainer over recomputed blocks trains exactly as over plain ones", Trainer,
                   tk::Trainer<tk::PrecisionPolicy<tk::FP32>, tk::AccumulationPolicy<2>>,
                   tk::Trainer<tk::PrecisionPolicy<tk::MasterWeights<tk::BF16>>, tk::AccumulationPolicy<2>>) {
  struct NetImpl : torch::nn::Module {
    NetImpl(bool recompute) : recompute(recompute) {
      for (int i = 0; i < 3; ++i) blocks.push_back(register_module("block" + std::to_string(i), Block(16, 0.1)));
      head = register_module("head", torch::nn::Linear(16, 4));
    }
    torch::Tensor forward(torch::Tensor x) {
      for (auto& b : blocks) x = recompute ? tk::recompute(b, x) : b(x);
      return head(x);
    }
    bool recompute;
    std::vector<Block> blocks;
    torch::nn::Linear head{nullptr};
  };
  auto make = [](bool recompute) {
    torch::manual_seed(5);
    return std::make_shared<NetImpl>(recompute);
  };
  auto plain = make(false), recomputed = make(true);
  Trainer a(plain, tk::AdamW{1e-2}), b(recomputed, tk::AdamW{1e-2});
  torch::manual_seed(9);
  const auto x = torch::randn({32, 16});
  const auto y = torch::randint(0, 4, {32});
  for (int i = 0; i < 6; ++i) {
    const auto xi = x.narrow(0, 8 * (i % 4), 8), yi = y.narrow(0, 8 * (i % 4), 8);
    torch::manual_seed(100 + i);  // the same dropout masks in both
    a.micro_step([&] { return torch::cross_entropy_loss(plain->forward(xi), yi); });
    torch::manual_seed(100 + i);
    b.micro_step([&] { return torch::cross_entropy_loss(recomputed->forward(xi), yi); });
  }
  CHECK(a.applied_steps().template item<std::int64_t>() == 3);
  CHECK(torch::equal(a.parameters(), b.parameters()));
}

}  // namespace test_recompute
