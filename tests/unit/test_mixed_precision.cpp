// Real FP16 and BF16 autocast on the CPU: the region is active exactly around the forward,
// both train a small classifier to FP32's accuracy, and an absurd initial scale backs off and
// recovers.
#include "../support/helpers.hpp"

#include <algorithm>

namespace test_mixed_precision {  // this file's names, apart from those of the files it shares a unity batch with

using testing::make_mlp;

namespace {

template <class Precision>
std::pair<double, std::int64_t> train_classifier(double init_scale = 65536.0) {
  auto model = make_mlp(50, 8, 32, 4);
  const auto train = testing::clusters(2048, 8, 4, 7);
  const auto held_out = testing::clusters(1024, 8, 4, 8);
  tk::Trainer<Precision, tk::AccumulationPolicy<2>, tk::ClipPolicy<tk::ClipNorm>> trainer(
      model, tk::AdamW{5e-3, 1e-4},
      tk::TrainerOptions().max_grad_norm(1.0).loss_scale(
          tk::LossScaleOptions().init_scale(init_scale).max_scale(std::max(init_scale, 16777216.0)).growth_interval(50)));
  for (int epoch = 0; epoch < 4; ++epoch)
    for (int i = 0; i < 2048; i += 32) {
      auto x = train.x.narrow(0, i, 32), y = train.y.narrow(0, i, 32);
      trainer.micro_step([&] { return torch::cross_entropy_loss(model(x), y); });
    }
  return {testing::accuracy(model, held_out), trainer.skipped_steps().template item<std::int64_t>()};
}

}  // namespace

TEST_CASE("the autocast region is active in the closure only, with the policy's dtype") {
  auto model = make_mlp(51);
  const auto data = testing::regression(16);
  auto dtype_in_closure = [&](auto& trainer) {
    at::ScalarType seen = at::kFloat;
    trainer.micro_step([&] {
      auto out = model(data.x);
      seen = out.scalar_type();
      return torch::mse_loss(out.to(torch::kFloat), data.y);
    });
    CHECK_FALSE(at::autocast::is_autocast_enabled(c10::DeviceType::CPU));
    return std::string(c10::toString(seen));
  };
  {
    tk::Trainer<tk::PrecisionPolicy<tk::BF16>> t(model, tk::SGD{0.01});
    CHECK(dtype_in_closure(t) == "BFloat16");
  }
  auto model2 = make_mlp(51);
  model = model2;
  {
    tk::Trainer<tk::PrecisionPolicy<tk::FP16Dynamic>> t(model, tk::SGD{0.01});
    CHECK(dtype_in_closure(t) == "Half");
  }
  auto model3 = make_mlp(51);
  model = model3;
  {
    tk::Trainer<tk::PrecisionPolicy<tk::FP32>> t(model, tk::SGD{0.01});
    CHECK(dtype_in_closure(t) == "Float");
  }
}

TEST_CASE("FP16 and BF16 autocast train to FP32's accuracy (within 2 points)") {
  const auto [fp32, s32] = train_classifier<tk::PrecisionPolicy<tk::FP32>>();
  const auto [bf16, s16b] = train_classifier<tk::PrecisionPolicy<tk::BF16>>();
  const auto [fp16, s16] = train_classifier<tk::PrecisionPolicy<tk::FP16Dynamic>>();
  MESSAGE("held-out accuracy: fp32 " << fp32 << ", bf16 " << bf16 << ", fp16 " << fp16);
  CHECK(fp32 > 0.9);
  CHECK(std::abs(bf16 - fp32) <= 0.02);
  CHECK(std::abs(fp16 - fp32) <= 0.02);
  CHECK(s32 == 0);
  CHECK(s16b == 0);
}

TEST_CASE("FP16 started at an absurd scale backs off and recovers") {
  // 2^40 overflows fp16's backward (max 65504) at once; every such window is skipped and
  // halves the scale until the gradients fit.
  const auto [accuracy, skipped] =
      train_classifier<tk::PrecisionPolicy<tk::FP16Dynamic>>(std::ldexp(1.0, 40));
  const auto [fp32, _] = train_classifier<tk::PrecisionPolicy<tk::FP32>>();
  MESSAGE("absurd start: " << skipped << " skipped steps, accuracy " << accuracy);
  CHECK(skipped >= 20);  // 2^40 -> below 2^20 needs at least 20 cuts
  CHECK(skipped <= 40);
  CHECK(std::abs(accuracy - fp32) <= 0.02);
}

}  // namespace test_mixed_precision
