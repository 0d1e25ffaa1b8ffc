// The optimizer phase's ATen calls. On a small model the phase is call
// overhead, a few microseconds each: these are upper bounds on the count, so that a change
// that adds calls to every window is seen. (Counted with RecordFunction, top-level calls
// only, from the end of the window's last backward to the end of micro_step.)
#include "../support/helpers.hpp"
#include "../support/host_reads.hpp"

#include <trainkit/trainer/trainer.hpp>

#include <ATen/record_function.h>
#include <torch/csrc/autograd/engine.h>

#include <atomic>
#include <functional>
#include <string>
#include <vector>

namespace test_phase_calls {  // this file's names, apart from those of the files it shares a unity batch with

namespace {

std::atomic<bool> counting{false};
std::atomic<std::int64_t> calls{0};
thread_local int depth = 0;
std::vector<std::string> names;  // (the test's thread only: the phase runs on it)

struct CallCounter {
  CallCounter() {
    handle = at::addGlobalCallback(
        at::RecordFunctionCallback(
            [](const at::RecordFunction& fn) -> std::unique_ptr<at::ObserverContext> {
              if (depth++ == 0 && counting) {
                ++calls;
                names.emplace_back(fn.name());
              }
              return nullptr;
            },
            [](const at::RecordFunction&, at::ObserverContext*) { --depth; })
            .scopes({at::RecordScope::FUNCTION}));
  }
  ~CallCounter() { at::removeCallback(handle); }
  at::CallbackHandle handle;
};

// The calls of the phase of one window of N micro-steps (the last one's phase).
template <class Trainer>
std::int64_t phase_calls(std::int64_t n) {
  auto model = testing::make_mlp(1);
  Trainer trainer(model, tk::AdamW{1e-3}, tk::TrainerOptions().max_grad_norm(1.0).accumulation_steps(n));
  const auto data = testing::regression(8);
  auto step = [&](bool last) {
    trainer.micro_step([&] {
      auto loss = torch::mse_loss(model(data.x), data.y);
      if (last)
        loss.register_hook([](const torch::Tensor&) {
          torch::autograd::Engine::get_default_engine().queue_callback([] { counting = true; });
        });
      return loss;
    });
  };
  for (int w = 0; w < 2; ++w)  // warm-up windows: the phase's one-time setup is not counted
    for (std::int64_t i = 0; i < n; ++i) step(false);
  CallCounter counter;
  calls = 0;
  names.clear();
  for (std::int64_t i = 0; i < n; ++i) step(i + 1 == n);
  counting = false;
  REQUIRE(trainer.windows() == 3);
  std::string list;
  for (const auto& name : names) list += " " + name;
  MESSAGE(Trainer::name() << ", N = " << n << ": " << calls.load() << " calls:" << list);
  return calls;
}

}  // namespace

TEST_CASE("the optimizer phase's ATen calls stay few") {
  using FP32 = tk::Trainer<tk::PrecisionPolicy<tk::FP32>, tk::AccumulationPolicy<tk::Dynamic>, tk::ClipPolicy<tk::NoClip>>;
  using FP32Clip = tk::Trainer<tk::PrecisionPolicy<tk::FP32>, tk::AccumulationPolicy<tk::Dynamic>, tk::ClipPolicy<tk::ClipNorm>>;
  using FP16Clip = tk::Trainer<tk::PrecisionPolicy<tk::FP16Dynamic>, tk::AccumulationPolicy<tk::Dynamic>, tk::ClipPolicy<tk::ClipNorm>>;
  // (The phase before it was fused into the update took 19, 23 and 28.)
  CHECK(phase_calls<FP32>(1) <= 10);
  CHECK(phase_calls<FP32Clip>(1) <= 14);
  CHECK(phase_calls<FP32Clip>(4) <= 14);
  CHECK(phase_calls<FP16Clip>(1) <= 18);
}

namespace {

using trainkit_testing::host_reads_in;

// Host reads in 3 windows of `micro_steps` micro-steps each, after 2 windows of warm-up.
// `after(trainer)`: checks of the trainer after them.
template <class Trainer>
std::int64_t host_reads_per_window(int micro_steps = 2, tk::TrainerOptions options = tk::TrainerOptions(),
                                   const std::function<void(const Trainer&)>& after = nullptr) {
  auto model = testing::make_mlp(1);
  Trainer trainer(model, tk::AdamW{1e-3}, options.max_grad_norm(1.0).accumulation_steps(micro_steps));
  const auto data = testing::regression(8);
  auto window = [&] {
    for (int i = 0; i < micro_steps; ++i) trainer.micro_step([&] { return torch::mse_loss(model(data.x), data.y); });
  };
  window(), window();
  const auto n = host_reads_in([&] { window(), window(), window(); });
  REQUIRE(trainer.windows() == 5);
  if (after) after(trainer);
  return n;
}

}  // namespace

TEST_CASE("no optimizer step reads a value to the host: no .item(), no data-dependent shape") {
  // The counter sees what it must (else its 0 proves nothing).
  CHECK(host_reads_in([] { (void)torch::ones({2}).sum().item<float>(); }) >= 1);
  CHECK(host_reads_in([] { (void)torch::ones({2}).nonzero(); }) >= 1);
  using FP32Clip = tk::Trainer<tk::PrecisionPolicy<tk::FP32>, tk::AccumulationPolicy<tk::Dynamic>, tk::ClipPolicy<tk::ClipNorm>>;
  using FP16Clip = tk::Trainer<tk::PrecisionPolicy<tk::FP16Dynamic>, tk::AccumulationPolicy<tk::Dynamic>, tk::ClipPolicy<tk::ClipNorm>>;
  CHECK(host_reads_per_window<FP32Clip>() == 0);
  CHECK(host_reads_per_window<FP16Clip>() == 0);
  // Master weights: with the fp32 sum kept through a window of 2, and with one micro-batch per
  // window and the model (195 parameters) over master_chunk, so that the phase runs in chunks
  // (gpu_check's fp16master row: BERT-base is over the default 16 Mi).
  using Master16 = tk::Trainer<tk::PrecisionPolicy<tk::MasterWeights<tk::FP16Dynamic>>, tk::AccumulationPolicy<tk::Dynamic>,
                               tk::ClipPolicy<tk::ClipNorm>>;
  CHECK(host_reads_per_window<Master16>() == 0);
  CHECK(host_reads_per_window<Master16>(1, tk::TrainerOptions().master_chunk(64),
                                        [](const Master16& t) { CHECK(t.storage().phase_chunks() > 1); }) == 0);
}

}  // namespace test_phase_calls
