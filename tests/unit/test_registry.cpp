// make_trainer and AnyTrainer: every registered key builds its compiled type; a step through
// AnyTrainer equals the concrete Trainer's bit for bit (and a fixed accumulation count equals
// the registry's Dynamic one); the configuration's optimizer and LR; the precision region;
// tk::fit and resume through AnyTrainer; errors that name the key.
#include "../support/helpers.hpp"

#include <trainkit/fit/fit.hpp>
#include <trainkit/run/registry.hpp>

#include <ATen/autocast_mode.h>

#include <map>
#include <memory>
#include <string>
#include <vector>

namespace test_registry {  // this file's names, apart from those of the files it shares a unity batch with

using testing::make_mlp;
using testing::TempDir;

namespace {

tk::Config from_json(const std::string& text) {
  tk::Config c;
  c.load_string(text, tk::Config::Format::json);
  return c;
}

// Four windows of 3 uneven micro-batches (with item counts) through `step`.
template <class Step>
void train_windows(testing::TinyMlp& model, Step&& step) {
  const auto data = testing::regression(64);
  std::int64_t at = 0;
  for (int i = 0; i < 12; ++i) {
    const std::int64_t size = 3 + i % 4;
    const auto xb = data.x.narrow(0, at % 48, size), yb = data.y.narrow(0, at % 48, size);
    at += size;
    step([&] { return torch::mse_loss(model(xb), yb); }, size);
  }
}

}  // namespace

TEST_CASE("make_trainer builds the registered type of every key") {
  const auto names = tk::registered_trainers();
  std::size_t built = 0;
  tk::OptimizerSettings adamw;
  adamw.name = "AdamW";
  adamw.lr = 1e-3;
  for (bool master : {false, true})
    for (tk::PrecisionKind p : {tk::PrecisionKind::FP32, tk::PrecisionKind::BF16, tk::PrecisionKind::FP16Static,
                                tk::PrecisionKind::FP16Dynamic})
      for (tk::ClipKind c : {tk::ClipKind::NoClip, tk::ClipKind::ClipNorm, tk::ClipKind::ClipValue}) {
        if (master && p == tk::PrecisionKind::FP32) continue;
        const tk::TrainerKey key{p, 3, c, master};
        CAPTURE(key.name());
        auto model = make_mlp(1);
        const auto trainer = tk::make_trainer(key, model.ptr(), adamw, tk::TrainerOptions());
        CHECK(trainer->type_name() == key.dispatched().name());
        CHECK(std::find(names.begin(), names.end(), trainer->type_name()) != names.end());
        CHECK(trainer->window_length() == 3);
        CHECK(trainer->uses_loss_scale() ==
              (p == tk::PrecisionKind::FP16Static || p == tk::PrecisionKind::FP16Dynamic));
        CHECK(trainer->autocast_dtype().has_value() == (p != tk::PrecisionKind::FP32));
        ++built;
      }
  CHECK(built == names.size());
}

TEST_CASE("a step through AnyTrainer equals the concrete Trainer's, and Accumulate<3> equals Dynamic") {
  using Fixed = tk::Trainer<tk::PrecisionPolicy<tk::FP16Dynamic>, tk::AccumulationPolicy<3>,
                            tk::ClipPolicy<tk::ClipNorm>>;
  auto a = make_mlp(3), b = make_mlp(3);
  const auto options = tk::TrainerOptions().max_grad_norm(0.5);
  Fixed concrete(a, tk::AdamW{1e-2, 1e-4}.eps(1e-6), options);
  tk::OptimizerSettings adamw;
  adamw.name = "AdamW";
  adamw.lr = 1e-2;
  adamw.eps = 1e-6;
  const auto erased = tk::make_trainer(tk::TrainerKey{tk::PrecisionKind::FP16Dynamic, 3, tk::ClipKind::ClipNorm},
                                       b.ptr(), adamw, options);
  REQUIRE(erased->type_name() == "Trainer<FP16Dynamic, Accumulate<Dynamic>, ClipNorm>");
  std::vector<double> la, lb;
  train_windows(a, [&](auto&& loss, std::int64_t items) {
    auto r = concrete.micro_step(loss, items);
    if (r.window_closed) la.push_back(r.report.loss());
  });
  train_windows(b, [&](auto&& loss, std::int64_t items) {
    auto r = erased->micro_step(loss, items);
    if (r.window_closed) lb.push_back(r.report.loss());
  });
  REQUIRE(la.size() == 4);
  CHECK(la == lb);
  CHECK(testing::flat(*a).equal(testing::flat(*b)));
  CHECK(concrete.loss_scale().equal(erased->loss_scale()));
  CHECK(erased->windows() == 4);
  CHECK(erased->applied_steps().item<std::int64_t>() == concrete.applied_steps().item<std::int64_t>());
}

TEST_CASE("make_trainer(config, model): the configured optimizer, LR scaling and window length") {
  const tk::Config config = from_json(R"({"TRAIN": {"OPTIMIZER": "SGD", "MOMENTUM": 0.0, "WD": 0.0, "LR": 0.01,
      "BATCH_IMAGES": 4, "GRAD_ACCUMULATE_STEPS": 2, "CLIP_GRAD_VALUE": 0.5}})");
  auto model = make_mlp(2);
  const auto trainer = tk::make_trainer(tk::RunPlan::from(config, 1), model);
  CHECK(trainer->type_name() == "Trainer<FP32, Accumulate<Dynamic>, ClipValue>");
  CHECK(trainer->window_length() == 2);
  const auto data = testing::regression(8);
  tk::MicroStepResult r;
  for (int i = 0; i < 2; ++i)
    r = trainer->micro_step([&] { return torch::mse_loss(model(data.x.narrow(0, 4 * i, 4)), data.y.narrow(0, 4 * i, 4)); });
  REQUIRE(r.window_closed);
  CHECK(r.report.lr() == doctest::Approx(0.01 * 4 * 2));  // per-sample LR x total batch
  // World size 2 doubles the total batch and so the base LR.
  auto other = make_mlp(2);
  const auto two = tk::make_trainer(tk::RunPlan::from(config, 2), other);
  for (int i = 0; i < 2; ++i)
    r = two->micro_step([&] { return torch::mse_loss(other(data.x.narrow(0, 4 * i, 4)), data.y.narrow(0, 4 * i, 4)); });
  CHECK(r.report.lr() == doctest::Approx(0.01 * 4 * 2 * 2));
}

TEST_CASE("AnyTrainer's precision region is the trainer's autocast region") {
  auto fp32_model = make_mlp(1), bf16_model = make_mlp(1);
  tk::OptimizerSettings sgd;
  const auto fp32 = tk::make_trainer(tk::TrainerKey{}, fp32_model.ptr(), sgd, {});
  const auto bf16 = tk::make_trainer(tk::TrainerKey{tk::PrecisionKind::BF16, 1, tk::ClipKind::NoClip},
                                     bf16_model.ptr(), sgd, {});
  CHECK_FALSE(fp32->precision_region().has_value());
  {
    const auto region = bf16->precision_region();
    REQUIRE(region.has_value());
    CHECK(at::autocast::is_autocast_enabled(c10::DeviceType::CPU));
    CHECK((at::autocast::get_autocast_dtype(c10::DeviceType::CPU) == at::kBFloat16));
    CHECK((bf16_model(torch::randn({2, 8})).scalar_type() == at::kBFloat16));
  }
  CHECK_FALSE(at::autocast::is_autocast_enabled(c10::DeviceType::CPU));
}

TEST_CASE("tk::fit through make_trainer, and resume into a new AnyTrainer equals never stopping") {
  struct Run {
    testing::TinyMlp model = make_mlp(5);
    testing::Regression data = testing::regression(40);
    tk::Task<torch::Tensor> task;
    Run() {
      task.batches_per_epoch = [](std::int64_t) { return std::int64_t{5}; };
      task.batch = [](std::int64_t epoch, std::int64_t index) { return torch::tensor({epoch, index}); };
      task.loss = [this](const torch::Tensor& at, tk::Metrics&) {
        const auto i = at[1].item<std::int64_t>();
        return torch::mse_loss(model(data.x.narrow(0, 8 * i, 8)), data.y.narrow(0, 8 * i, 8));
      };
    }
  };
  const tk::Config config = from_json(R"({"TRAIN": {"OPTIMIZER": "AdamW", "LR": 1e-3, "GRAD_ACCUMULATE_STEPS": 2,
      "BF16": true, "CLIP_GRAD_NORM": 1.0}})");
  auto options = [](const std::string& dir, std::int64_t end) {
    return tk::FitOptions().output_path(dir).end_epoch(end).progress(false).handle_signals(false);
  };
  TempDir straight_dir, split_dir;
  Run straight;
  const auto a = tk::make_trainer(tk::RunPlan::from(config, 1), straight.model);
  const tk::FitResult ra = tk::fit(*a, straight.task, options(straight_dir.path, 4));
  CHECK(ra.windows == 4 * 3);  // 5 micro-batches in windows of 2: flush closes the third

  Run first, second;
  const auto b = tk::make_trainer(tk::RunPlan::from(config, 1), first.model);
  tk::fit(*b, first.task, options(split_dir.path, 2));
  const auto c = tk::make_trainer(tk::RunPlan::from(config, 1), second.model);
  const tk::FitResult rc = tk::fit(*c, second.task, options(split_dir.path, 4));
  CHECK(rc.resumed_from == split_dir / "model-0001.ckpt");
  CHECK(rc.windows == ra.windows);
  CHECK(testing::flat(*second.model).equal(testing::flat(*straight.model)));
}

TEST_CASE("make_trainer refuses what the registry does not have, naming the key") {
  auto model = make_mlp(1);
  tk::OptimizerSettings lamb;
  lamb.name = "LAMB";
  CHECK_THROWS_WITH_AS(tk::make_trainer(tk::TrainerKey{}, model.ptr(), lamb, {}),
                       doctest::Contains("TRAIN.OPTIMIZER: expected one of SGD, Adam, AdamW, got \"LAMB\""),
                       tk::ConfigError);
  CHECK_THROWS_WITH_AS(
      tk::make_trainer(tk::TrainerKey{tk::PrecisionKind::FP32, 1, tk::ClipKind::NoClip, true}, model.ptr(), {}, {}),
      doctest::Contains("TRAIN.MASTER_WEIGHTS: needs FP16 or BF16"), tk::ConfigError);
  CHECK_THROWS_WITH_AS(tk::make_trainer(tk::TrainerKey{tk::PrecisionKind::FP32, 0, tk::ClipKind::NoClip},
                                        model.ptr(), {}, {}),
                       doctest::Contains("TRAIN.GRAD_ACCUMULATE_STEPS: must be >= 1, got 0"), tk::ConfigError);
}

}  // namespace test_registry
