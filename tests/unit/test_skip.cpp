// A skipped step changes nothing: parameters, optimizer state and the LR schedule's position
// stay bit-for-bit as they were.
#include "../support/helpers.hpp"

#include <limits>

namespace test_skip {  // this file's names, apart from those of the files it shares a unity batch with

using testing::make_mlp;

namespace {

// factor(step) = 1 / (1 + step): every position has its own LR, so a wrong advance shows.
class Harmonic final : public tk::Schedule {
 public:
  double factor(std::int64_t step) const override { return 1.0 / (1.0 + step); }
  std::string describe() const override { return "harmonic"; }
};

template <class Trainer>
void check_skip_changes_nothing() {
  auto model = make_mlp(20);
  const auto data = testing::regression(32);
  Trainer trainer(model, tk::AdamW{1e-2, 0.1},
                  tk::TrainerOptions().loss_scale(tk::LossScaleOptions().init_scale(512)));
  trainer.set_schedule(std::make_shared<Harmonic>());
  auto window = [&](double factor) {
    return trainer.micro_step([&] { return torch::mse_loss(model(data.x), data.y) * factor; })
        .report;
  };
  for (int i = 0; i < 3; ++i) CHECK(window(1.0).applied());

  auto& adam = dynamic_cast<tk::detail::FusedAdam<tk::AdamW, true>&>(trainer.update_rule());
  const auto params = testing::flat(*model);
  const auto m = adam.exp_avg()[0].clone(), v = adam.exp_avg_sq()[0].clone();
  const auto step = adam.step_count().clone();
  const auto applied = trainer.applied_steps().clone();

  for (double bad : {std::numeric_limits<double>::infinity(),
                     std::numeric_limits<double>::quiet_NaN()}) {
    auto r = window(bad);
    CHECK(r.skipped());
    CHECK(torch::equal(testing::flat(*model), params));
    CHECK(torch::equal(adam.exp_avg()[0], m));
    CHECK(torch::equal(adam.exp_avg_sq()[0], v));
    CHECK(torch::equal(adam.step_count(), step));
    CHECK(torch::equal(trainer.applied_steps(), applied));
    CHECK(trainer.gradients().abs().sum().template item<double>() == 0.0);  // zeroed anyway
  }
  // The next applied step uses the 4th position of the schedule, not the 6th.
  auto r = window(1.0);
  CHECK(r.applied());
  CHECK(r.lr() == doctest::Approx(1e-2 / 4.0).epsilon(1e-6));
  CHECK(r.step() == 4);
  CHECK(r.skipped_steps() == 2);
  CHECK(trainer.windows() == 6);
}

}  // namespace

TEST_CASE_TEMPLATE("a skipped step leaves parameters, optimizer state and schedule unchanged", T,
                   tk::Trainer<tk::PrecisionPolicy<tk::FP32>>,
                   tk::Trainer<tk::PrecisionPolicy<tk::BF16>, tk::AccumulationPolicy<1>,
                               tk::ClipPolicy<tk::ClipNorm>>,
                   tk::Trainer<tk::PrecisionPolicy<tk::FP16Dynamic>, tk::AccumulationPolicy<1>,
                               tk::ClipPolicy<tk::ClipNorm>>,
                   tk::Trainer<tk::PrecisionPolicy<tk::FP16Static>, tk::AccumulationPolicy<1>,
                               tk::ClipPolicy<tk::ClipValue>>) {
  check_skip_changes_nothing<T>();
}

TEST_CASE("SGD with momentum: a skipped step leaves the momentum buffer unchanged") {
  auto model = make_mlp(21);
  const auto data = testing::regression(32);
  tk::Trainer<tk::PrecisionPolicy<tk::FP16Dynamic>> trainer(model, tk::SGD{0.1, 0.9, 1e-3, true});
  trainer.micro_step([&] { return torch::mse_loss(model(data.x), data.y); });
  auto& sgd = dynamic_cast<tk::detail::FusedSGD&>(trainer.update_rule());
  const auto buffer = sgd.momentum_buffers()[0].clone();
  const auto params = testing::flat(*model);
  auto r = trainer.micro_step([&] {
    return torch::mse_loss(model(data.x), data.y) * std::numeric_limits<double>::infinity();
  });
  CHECK(r.report.skipped());
  CHECK(torch::equal(sgd.momentum_buffers()[0], buffer));
  CHECK(torch::equal(testing::flat(*model), params));
}

TEST_CASE("NONFINITE abort: FP32 names the step and the loss") {
  auto model = make_mlp(22);
  const auto data = testing::regression(32);
  tk::Trainer<> trainer(model, tk::SGD{0.1}, tk::TrainerOptions().nonfinite(tk::NonFinite::abort));
  trainer.micro_step([&] { return torch::mse_loss(model(data.x), data.y); });
  const auto params = testing::flat(*model);
  CHECK_THROWS_WITH_AS(trainer.micro_step([&] {
    return torch::mse_loss(model(data.x), data.y) * std::numeric_limits<double>::quiet_NaN();
  }),
                       doctest::Contains("non-finite gradient at optimizer step 2 (window loss nan"),
                       tk::NonFiniteGradient);
  CHECK(torch::equal(testing::flat(*model), params));
}

TEST_CASE("a finite gradient whose fp32 norm overflows is skipped as an overflow (GradScaler would apply it)") {
  auto model = make_mlp(23);
  tk::Trainer<> trainer(model, tk::SGD{0.1});
  const auto w = model->parameters()[0];
  const auto params = testing::flat(*model);
  // Gradient elements of 2e19 are finite in fp32 (max 3.4e38); their squares are not.
  const auto huge = [&](std::int64_t n, float value) {
    return trainer.micro_step([&] { return (w.flatten().narrow(0, 0, n) * value).sum(); }).report;
  };
  auto r = huge(4, 2e19f);
  CHECK(r.skipped());
  CHECK(torch::equal(testing::flat(*model), params));
  // Two elements of 1e19: the squares' sum, 2e38, is finite; so is the norm; the step is applied.
  r = huge(2, 1e19f);
  CHECK(r.applied());
  CHECK(r.grad_norm() == doctest::Approx(1.4142135e19).epsilon(1e-6));
}

}  // namespace test_skip
