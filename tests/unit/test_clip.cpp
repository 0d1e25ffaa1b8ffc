// Clipping acts on unscaled gradients and matches torch::nn::utils::clip_grad_norm_; the
// reported norm is the one before clipping.
#include "../support/helpers.hpp"

namespace test_clip {  // this file's names, apart from those of the files it shares a unity batch with

using testing::make_mlp;

namespace {

// SGD with lr 1 and nothing else: the parameter change is exactly minus the clipped gradient.
struct Reference {
  torch::Tensor clipped;  // the clipped gradient, flat
  double norm;            // the norm before clipping
};
Reference reference_clip_norm(const testing::Regression& data, double max_norm, bool fp16) {
  auto model = make_mlp(30);
  std::optional<tk::AutocastRegion> region;
  if (fp16) region.emplace(c10::DeviceType::CPU, at::kHalf);
  auto loss = torch::mse_loss(model(data.x), data.y).to(torch::kFloat);
  region.reset();
  loss.backward();
  const double norm = torch::nn::utils::clip_grad_norm_(model->parameters(), max_norm);
  std::vector<torch::Tensor> grads;
  for (auto& p : model->parameters()) grads.push_back(p.grad().reshape({-1}));
  return {torch::cat(grads), norm};
}

template <class Precision>
std::pair<torch::Tensor, tk::StepReport> trainer_clip_norm(const testing::Regression& data,
                                                           double max_norm) {
  auto model = make_mlp(30);
  const auto before = testing::flat(*model);
  tk::Trainer<Precision, tk::AccumulationPolicy<1>, tk::ClipPolicy<tk::ClipNorm>> trainer(
      model, tk::SGD{1.0},
      tk::TrainerOptions().max_grad_norm(max_norm).loss_scale(
          tk::LossScaleOptions().init_scale(4096).static_scale(4096)));
  auto r = trainer.micro_step([&] { return torch::mse_loss(model(data.x), data.y); });
  return {before - testing::flat(*model), r.report};
}

}  // namespace

TEST_CASE("ClipNorm matches clip_grad_norm_ and reports the norm before clipping (FP32)") {
  const auto data = testing::regression(64);
  const auto ref = reference_clip_norm(data, 0.05, false);
  REQUIRE(ref.norm > 0.05 * 2);  // clipping is active
  auto [step, report] = trainer_clip_norm<tk::PrecisionPolicy<tk::FP32>>(data, 0.05);
  // fp32 rounding: one norm over the flat gradient vs torch's norm of per-tensor norms.
  CHECK(testing::relative_error(step, ref.clipped) <= 1e-5);
  CHECK(report.grad_norm() == doctest::Approx(ref.norm).epsilon(1e-6));
  CHECK(step.norm().item<double>() == doctest::Approx(0.05).epsilon(1e-4));
}

TEST_CASE("ClipNorm under FP16 loss scaling clips the unscaled gradient") {
  const auto data = testing::regression(64);
  const auto ref = reference_clip_norm(data, 0.05, true);
  for (int mode = 0; mode < 2; ++mode) {
    CAPTURE(mode);
    auto [step, report] =
        mode == 0 ? trainer_clip_norm<tk::PrecisionPolicy<tk::FP16Dynamic>>(data, 0.05)
                  : trainer_clip_norm<tk::PrecisionPolicy<tk::FP16Static>>(data, 0.05);
    CHECK(report.loss_scale() == 4096.0);
    // Clipping a scaled gradient would give a norm 4096x off (or no clipping at all).
    CHECK(report.grad_norm() == doctest::Approx(ref.norm).epsilon(1e-2));
    CHECK(step.norm().item<double>() == doctest::Approx(0.05).epsilon(1e-3));
    CHECK(testing::relative_error(step, ref.clipped) <= 1e-2);
  }
}

TEST_CASE("ClipNorm leaves a gradient under the max norm alone") {
  const auto data = testing::regression(64);
  const auto ref = reference_clip_norm(data, 1e6, false);
  auto [step, report] = trainer_clip_norm<tk::PrecisionPolicy<tk::FP32>>(data, 1e6);
  CHECK(testing::relative_error(step, ref.clipped) <= 1e-6);
  CHECK(step.norm().item<double>() == doctest::Approx(ref.norm).epsilon(1e-6));
}

TEST_CASE("ClipValue clamps the unscaled gradient to [-v, v]") {
  const auto data = testing::regression(64);
  auto ref_model = make_mlp(31);
  torch::mse_loss(ref_model(data.x), data.y).backward();
  std::vector<torch::Tensor> grads;
  for (auto& p : ref_model->parameters()) grads.push_back(p.grad().reshape({-1}));
  const auto raw = torch::cat(grads);
  const double v = raw.abs().max().item<double>() / 4;  // a quarter of the entries or more clip
  const auto expected = raw.clamp(-v, v);

  auto model = make_mlp(31);
  const auto before = testing::flat(*model);
  tk::Trainer<tk::PrecisionPolicy<tk::FP16Static>, tk::AccumulationPolicy<1>,
              tk::ClipPolicy<tk::ClipValue>>
      trainer(model, tk::SGD{1.0}, tk::TrainerOptions().clip_value(v));
  auto r = trainer.micro_step([&] { return torch::mse_loss(model(data.x), data.y); });
  const auto step = before - testing::flat(*model);
  CHECK(step.abs().max().item<double>() <= v * (1 + 1e-6));
  CHECK(testing::relative_error(step, expected) <= 1e-2);  // fp16 forward
  CHECK(r.report.grad_norm() == doctest::Approx(raw.norm().item<double>()).epsilon(1e-2));
}

}  // namespace test_clip
