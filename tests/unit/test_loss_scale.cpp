// FP16 loss scaling: GradScaler's trajectory step by step over scripted overflows, the extras
// (hysteresis, clamps, collapse error), and FP16Static's skip.
#include "../support/helpers.hpp"

#include <limits>

namespace test_loss_scale {  // this file's names, apart from those of the files it shares a unity batch with

using testing::make_mlp;

namespace {

using Dyn = tk::Trainer<tk::PrecisionPolicy<tk::FP16Dynamic>>;

// torch.amp.GradScaler's update, written out independently of trainkit (and of ATen).
struct ReferenceScaler {
  float scale;
  int tracker = 0;
  double growth, backoff;
  int interval;
  void update(bool overflow) {
    if (overflow) {
      scale = static_cast<float>(scale * backoff);
      tracker = 0;
      return;
    }
    if (++tracker == interval) {
      const float grown = static_cast<float>(scale * growth);
      if (std::isfinite(grown)) scale = grown;
      tracker = 0;
    }
  }
};

// One window; an overflow is injected by making the loss infinite.
template <class Trainer>
tk::StepReport window(Trainer& trainer, testing::TinyMlp& model, const testing::Regression& data,
                      bool overflow) {
  const double factor = overflow ? std::numeric_limits<double>::infinity() : 1.0;
  auto r = trainer.micro_step([&] { return torch::mse_loss(model(data.x), data.y) * factor; });
  REQUIRE(r.window_closed);
  return r.report;
}

}  // namespace

TEST_CASE("defaults are GradScaler's") {
  const tk::LossScaleOptions o;
  CHECK(o.init_scale() == 65536.0);
  CHECK(o.growth_factor() == 2.0);
  CHECK(o.backoff_factor() == 0.5);
  CHECK(o.growth_interval() == 2000);
  CHECK(o.hysteresis() == 1);
  // trainkit's floor and ceiling, the configuration's too (detail/loss_scale_defaults.hpp)
  CHECK(o.min_scale() == 1.0);
  CHECK(o.max_scale() == 16777216.0);
  CHECK_THROWS_WITH_AS(tk::TrainerOptions().loss_scale(tk::LossScaleOptions().init_scale(0.5)).validate(),
                       doctest::Contains("init_scale 0.500000 must lie within [min_scale, max_scale]"),
                       std::invalid_argument);
}

TEST_CASE("the floor and the ceiling alone (ATen's update, then a clamp) scale as the extras' clamps do") {
  // collapse_windows > 0 takes the element-wise path (update_with_extras); without it, ATen's
  // fused update and one clamp_. Over the same scripted overflows both give the same scales.
  auto model_a = make_mlp(14), model_b = make_mlp(14);
  const auto data = testing::regression(32);
  const auto options = tk::LossScaleOptions().init_scale(8.0).min_scale(2.0).max_scale(32.0).growth_interval(2);
  Dyn fused(model_a, tk::SGD{1e-3}, tk::TrainerOptions().loss_scale(options));
  Dyn extras(model_b, tk::SGD{1e-3}, tk::TrainerOptions().loss_scale(tk::LossScaleOptions(options).collapse_windows(1000)));
  const std::vector<int> script = {1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 0, 0};
  float lowest = 8, highest = 8;
  for (size_t i = 0; i < script.size(); ++i) {
    CAPTURE(i);
    window(fused, model_a, data, script[i] == 1);
    window(extras, model_b, data, script[i] == 1);
    const float scale = fused.loss_scale().template item<float>();
    CHECK(scale == extras.loss_scale().template item<float>());
    CHECK(fused.precision_policy().growth_tracker().template item<int>() ==
          extras.precision_policy().growth_tracker().template item<int>());
    lowest = std::min(lowest, scale);
    highest = std::max(highest, scale);
  }
  CHECK(lowest == 2.0f);   // the floor held
  CHECK(highest == 32.0f); // the ceiling held
}

TEST_CASE("FP16Dynamic follows GradScaler over a scripted sequence, growth included") {
  auto model = make_mlp(10);
  const auto data = testing::regression(32);
  const auto options = tk::LossScaleOptions().init_scale(1024.0).growth_interval(3);
  Dyn trainer(model, tk::SGD{1e-3}, tk::TrainerOptions().loss_scale(options));
  ReferenceScaler ref{1024.0f, 0, 2.0, 0.5, 3};
  const std::vector<int> script = {0, 0, 0, 0, 1, 0, 0, 1, 1, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0, 0};
  std::int64_t skipped = 0;
  float highest = ref.scale, lowest = ref.scale;
  for (size_t i = 0; i < script.size(); ++i) {
    CAPTURE(i);
    const float scale_used = ref.scale;
    auto report = window(trainer, model, data, script[i] == 1);
    ref.update(script[i] == 1);
    skipped += script[i];
    CHECK(report.loss_scale() == scale_used);  // the scale this window ran with
    CHECK(report.applied() == (script[i] == 0));
    CHECK(report.skipped_steps() == skipped);
    CHECK(trainer.loss_scale().template item<float>() == ref.scale);
    CHECK(trainer.precision_policy().growth_tracker().template item<int>() == ref.tracker);
    highest = std::max(highest, ref.scale);
    lowest = std::min(lowest, ref.scale);
  }
  CHECK(highest > 1024.0f);  // the script exercised growth and backoff
  CHECK(lowest < 1024.0f);
}

TEST_CASE("growth stops where the scale would stop being finite in fp32") {
  auto model = make_mlp(11);
  const auto data = testing::regression(8);
  const double huge = std::ldexp(1.0, 127);  // 2^127: doubling it overflows fp32
  Dyn trainer(model, tk::SGD{0.0 + 1e-12},
              tk::TrainerOptions().loss_scale(
                  tk::LossScaleOptions().init_scale(huge).max_scale(std::numeric_limits<double>::infinity()).growth_interval(1)));
  // Make every window clean whatever the scale: the loss is tiny.
  auto r = trainer.micro_step([&] { return torch::mse_loss(model(data.x), data.y) * 0.0; });
  REQUIRE(r.window_closed);
  CHECK(trainer.loss_scale().template item<float>() == static_cast<float>(huge));
  CHECK(trainer.precision_policy().growth_tracker().template item<int>() == 0);
}

TEST_CASE("hysteresis: the scale is cut only after H overflows in a row; each is skipped") {
  auto model = make_mlp(12);
  const auto data = testing::regression(32);
  Dyn trainer(model, tk::SGD{1e-3},
              tk::TrainerOptions().loss_scale(
                  tk::LossScaleOptions().init_scale(1024.0).hysteresis(2).growth_interval(100)));
  auto scale = [&] { return trainer.loss_scale().template item<float>(); };
  CHECK(window(trainer, model, data, true).skipped());
  CHECK(scale() == 1024.0f);  // first overflow: skipped, not cut
  CHECK(window(trainer, model, data, false).applied());
  CHECK(window(trainer, model, data, true).skipped());
  CHECK(scale() == 1024.0f);  // not in a row: still not cut
  CHECK(window(trainer, model, data, true).skipped());
  CHECK(scale() == 512.0f);   // two in a row: cut once
  CHECK(window(trainer, model, data, true).skipped());
  CHECK(scale() == 512.0f);   // the count restarted after the cut
}

TEST_CASE("min and max clamps, and the collapse error") {
  auto model = make_mlp(13);
  const auto data = testing::regression(32);
  SUBCASE("max clamp") {
    Dyn trainer(model, tk::SGD{1e-3},
                tk::TrainerOptions().loss_scale(tk::LossScaleOptions()
                                                    .init_scale(1024.0)
                                                    .growth_interval(1)
                                                    .max_scale(3000.0)));
    window(trainer, model, data, false);
    CHECK(trainer.loss_scale().template item<float>() == 2048.0f);
    window(trainer, model, data, false);
    CHECK(trainer.loss_scale().template item<float>() == 3000.0f);
    window(trainer, model, data, false);
    CHECK(trainer.loss_scale().template item<float>() == 3000.0f);
  }
  SUBCASE("min clamp and collapse") {
    Dyn trainer(model, tk::SGD{1e-3},
                tk::TrainerOptions().loss_scale(tk::LossScaleOptions()
                                                    .init_scale(4.0)
                                                    .min_scale(1.0)
                                                    .collapse_windows(3)));
    window(trainer, model, data, true);  // 4 -> 2
    window(trainer, model, data, true);  // 2 -> 1
    CHECK(trainer.loss_scale().template item<float>() == 1.0f);
    window(trainer, model, data, true);  // at min: 1st collapsed window (check runs at 3)
    CHECK(trainer.loss_scale().template item<float>() == 1.0f);
    window(trainer, model, data, true);  // 2nd
    window(trainer, model, data, true);  // 3rd
    CHECK_THROWS_WITH_AS(window(trainer, model, data, true),
                         doctest::Contains("loss scale collapsed at step 6"),
                         tk::LossScaleCollapsed);
  }
}

TEST_CASE("FP16Static: a fixed scale, and an overflowing window is skipped, not applied") {
  auto model = make_mlp(14);
  const auto data = testing::regression(32);
  tk::Trainer<tk::PrecisionPolicy<tk::FP16Static>> trainer(
      model, tk::SGD{0.1}, tk::TrainerOptions().loss_scale(tk::LossScaleOptions().static_scale(256)));
  const auto before = testing::flat(*model);
  auto r = window(trainer, model, data, true);
  CHECK(r.skipped());
  CHECK(torch::equal(testing::flat(*model), before));
  CHECK(trainer.loss_scale().template item<float>() == 256.0f);
  CHECK(window(trainer, model, data, false).applied());
  CHECK(trainer.loss_scale().template item<float>() == 256.0f);
  CHECK_FALSE(torch::equal(testing::flat(*model), before));
}

}  // namespace test_loss_scale
