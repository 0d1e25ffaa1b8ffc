// tk::dispatch: every trainer key reaches its registered type (Accumulate<Dynamic>); the
// options and optimizer a config maps to; a config-driven run whose LR follows the schedule
// and does not advance on skipped steps.
#include <trainkit/run/dispatch.hpp>

#include "../support/helpers.hpp"

#include <limits>
#include <sstream>

namespace test_dispatch {  // this file's names, apart from those of the files it shares a unity batch with

using testing::make_mlp;
using nlohmann::json;

namespace {

tk::Config from_json(const std::string& text) {
  tk::Config c;
  c.load_string(text, tk::Config::Format::json);
  return c;
}

/// Captures std::clog for the scope.
class CaptureClog {
 public:
  CaptureClog() : old_(std::clog.rdbuf(out_.rdbuf())) {}
  ~CaptureClog() { std::clog.rdbuf(old_); }
  std::string text() const { return out_.str(); }

 private:
  std::ostringstream out_;
  std::streambuf* old_;
};

}  // namespace

TEST_CASE("dispatch reaches the registered type of every key") {
  const std::vector<std::string> registry = tk::registered_trainers();
  CHECK(registry.size() == 21);
  CaptureClog clog;
  std::size_t i = 0;
  for (tk::PrecisionKind p : {tk::PrecisionKind::FP32, tk::PrecisionKind::BF16, tk::PrecisionKind::FP16Static,
                              tk::PrecisionKind::FP16Dynamic})
    for (tk::ClipKind c : {tk::ClipKind::NoClip, tk::ClipKind::ClipNorm, tk::ClipKind::ClipValue}) {
      for (int n : {1, 2, 3, 4, 8, 16}) {  // every count runs on Accumulate<Dynamic>
        const tk::TrainerKey key{p, n, c};
        const std::string name = tk::dispatch(key, [](auto tag) {
          using T = typename decltype(tag)::type;
          return T::name();
        });
        CAPTURE(key.name());
        CHECK(name == key.dispatched().name());
        CHECK(name == registry[i]);
      }
      ++i;
    }
  // Master weights.
  for (tk::PrecisionKind p : {tk::PrecisionKind::BF16, tk::PrecisionKind::FP16Static, tk::PrecisionKind::FP16Dynamic})
    for (tk::ClipKind c : {tk::ClipKind::NoClip, tk::ClipKind::ClipNorm, tk::ClipKind::ClipValue}) {
      const tk::TrainerKey key{p, 4, c, /*master_weights=*/true};
      const std::string name = tk::dispatch(key, [](auto tag) { return decltype(tag)::type::name(); });
      CAPTURE(key.name());
      CHECK(name == key.dispatched().name());
      CHECK(name.rfind("Trainer<MasterWeights<", 0) == 0);
      CHECK(name == registry[i++]);
    }
  CHECK(i == registry.size());
  CHECK(clog.text().empty());  // no fallback, nothing to say
}

TEST_CASE("TRAIN.MASTER_WEIGHTS selects MasterWeights<T>, and needs FP16 or BF16") {
  const tk::Config c = from_json(R"({"TRAIN": {"FP16": true, "FP16_LOSS_SCALE": "dynamic", "MASTER_WEIGHTS": true,
      "GRAD_ACCUMULATE_STEPS": 4, "CLIP_GRAD_NORM": 1.0}})");
  CHECK(tk::RunPlan::from(c, 1).trainer.name() == "Trainer<MasterWeights<FP16Dynamic>, Accumulate<4>, ClipNorm>");
  const std::string name = tk::dispatch(tk::RunPlan::from(c, 1), [](auto tag) { return decltype(tag)::type::name(); });
  CHECK(name == "Trainer<MasterWeights<FP16Dynamic>, Accumulate<Dynamic>, ClipNorm>");
  CHECK(tk::RunPlan::from(c, 1).trainer_options.accumulation_steps() == 4);
  CHECK(tk::RunPlan::from(from_json(R"({"TRAIN": {"BF16": true, "MASTER_WEIGHTS": true}})"), 1).trainer.name() ==
        "Trainer<MasterWeights<BF16>, Accumulate<1>, NoClip>");
  CHECK_THROWS_WITH_AS(from_json(R"({"TRAIN": {"MASTER_WEIGHTS": true}})"),
                       doctest::Contains("TRAIN.MASTER_WEIGHTS: needs FP16 or BF16"), tk::ConfigError);
}

TEST_CASE("every accumulation count runs on Dynamic with the count as an option; below 1 is an error") {
  const tk::Config c = from_json(R"({"TRAIN": {"GRAD_ACCUMULATE_STEPS": 3, "BF16": true}})");
  const int steps = tk::dispatch(tk::RunPlan::from(c, 1), [](auto tag) { return decltype(tag)::type::accumulation_steps; });
  CHECK(steps == tk::Dynamic);
  CHECK(tk::RunPlan::from(c, 1).trainer_options.accumulation_steps() == 3);
  CHECK_THROWS_WITH_AS(tk::dispatch(tk::TrainerKey{tk::PrecisionKind::FP32, 0, tk::ClipKind::NoClip}, [](auto) {}),
                       doctest::Contains("TRAIN.GRAD_ACCUMULATE_STEPS: must be >= 1, got 0; the compiled trainers "
                                         "are (the count is a run-time option of each):\n  "
                                         "Trainer<FP32, Accumulate<Dynamic>, NoClip>"),
                       tk::ConfigError);
}

TEST_CASE("trainer_options maps TRAIN's numbers") {
  const tk::Config c = from_json(R"({"TRAIN": {"FP16": true, "FP16_LOSS_SCALE": 256, "FP16_INIT_SCALE": 1024,
      "FP16_GROWTH_FACTOR": 4, "FP16_BACKOFF_FACTOR": 0.25, "FP16_GROWTH_INTERVAL": 100, "FP16_HYSTERESIS": 2,
      "FP16_MIN_LOSS_SCALE": 2, "FP16_MAX_LOSS_SCALE": 4096, "CLIP_GRAD_NORM": 5, "GRAD_ACCUMULATE_STEPS": 4,
      "PARTIAL_WINDOW": "span", "NONFINITE": "abort", "LR_MULT": [["vlbert", 0.1], ["head", 2]]}})");
  const tk::TrainerOptions o = tk::RunPlan::from(c, 1).trainer_options;
  CHECK_NOTHROW(o.validate());
  const tk::LossScaleOptions& s = o.loss_scale();
  CHECK(s.static_scale() == 256);
  CHECK(s.init_scale() == 1024);
  CHECK(s.growth_factor() == 4);
  CHECK(s.backoff_factor() == 0.25);
  CHECK(s.growth_interval() == 100);
  CHECK(s.hysteresis() == 2);
  CHECK(s.min_scale() == 2);
  CHECK(s.max_scale() == 4096);
  CHECK(o.max_grad_norm() == 5);
  CHECK(o.accumulation_steps() == 4);
  CHECK(o.partial_window() == tk::PartialWindow::span);
  CHECK(o.nonfinite() == tk::NonFinite::abort);
  REQUIRE(o.lr_mult().size() == 2);
  CHECK(o.lr_mult()[0] == std::make_pair(std::string("vlbert"), 0.1));
  CHECK(o.lr_mult()[1] == std::make_pair(std::string("head"), 2.0));
  CHECK(json::parse(o.config_json()) == c.tree());

  const tk::TrainerOptions d = tk::RunPlan::from(tk::Config(), 1).trainer_options;
  CHECK_NOTHROW(d.validate());  // the defaults are valid options (clipping off keeps the defaults)
  CHECK(d.partial_window() == tk::PartialWindow::flush);
  CHECK(d.nonfinite() == tk::NonFinite::skip);
  CHECK(tk::RunPlan::from(from_json(R"({"TRAIN": {"CLIP_GRAD_VALUE": 0.5}})"), 1).trainer_options.clip_value() == 0.5);
}

TEST_CASE("with_optimizer builds VL-BERT's optimizers") {
  auto settings = [](const char* train) { return tk::RunPlan::from(from_json(std::string(R"({"TRAIN": )") + train + "}"), 1).optimizer; };
  tk::with_optimizer(settings(R"({"OPTIMIZER": "AdamW", "LR": 1e-4, "BATCH_IMAGES": 2, "WD": 0.01})"), [](auto opt) {
    using O = decltype(opt);
    REQUIRE(std::is_same_v<O, tk::AdamW>);
    if constexpr (std::is_same_v<O, tk::AdamW>) {
      CHECK(opt.lr() == doctest::Approx(2e-4));
      CHECK(opt.weight_decay() == 0.01);
      CHECK(opt.beta1() == 0.9);
      CHECK(opt.beta2() == 0.999);
      CHECK(opt.eps() == 1e-6);
    }
  });
  tk::with_optimizer(settings(R"({"OPTIMIZER": "SGD", "LR": 0.1, "MOMENTUM": 0.8})"), [](auto opt) {
    if constexpr (std::is_same_v<decltype(opt), tk::SGD>) {
      CHECK(opt.momentum() == 0.8);
      CHECK(opt.weight_decay() == 1e-4);
      CHECK_FALSE(opt.nesterov());
    } else {
      FAIL("expected tk::SGD");
    }
  });
  tk::with_optimizer(settings(R"({"OPTIMIZER": "Adam"})"), [](auto opt) {
    if constexpr (std::is_same_v<decltype(opt), tk::Adam>) CHECK(opt.eps() == 1e-8);
    else FAIL("expected tk::Adam");
  });
}

TEST_CASE("a config-driven run: Dynamic window length, the schedule, skipped steps") {
  // 3 micro-batches per window (Dynamic), ClipNorm, a triangle schedule over 2 epochs of
  // 4 windows: the LR of applied step k is base_lr * (8 - (k + 1)) / 8.
  const tk::Config config = from_json(R"({"TRAIN": {"GRAD_ACCUMULATE_STEPS": 3, "CLIP_GRAD_NORM": 1.0,
      "OPTIMIZER": "SGD", "MOMENTUM": 0.0, "WD": 0.0, "LR": 0.01, "BATCH_IMAGES": 4, "LR_SCALING": "per_sample",
      "LR_SCHEDULE": "triangle", "END_EPOCH": 2}})");
  using Expected = tk::Trainer<tk::PrecisionPolicy<tk::FP32>, tk::AccumulationPolicy<tk::Dynamic>,
                               tk::ClipPolicy<tk::ClipNorm>>;
  const auto data = testing::regression(12 * 4);
  const double base_lr = tk::RunPlan::from(config, 1).base_lr;  // 0.01 x 4 x 3 = 0.12
  CHECK(base_lr == doctest::Approx(0.12));
  tk::dispatch(tk::RunPlan::from(config, 1), [&](auto tag) {
    using T = typename decltype(tag)::type;
    if constexpr (!std::is_same_v<T, Expected>) {
      FAIL("dispatched " << T::name());
    } else {
      auto model = make_mlp(1);
      tk::with_optimizer(tk::RunPlan::from(config, 1).optimizer, [&](auto optimizer) {
        if constexpr (std::is_same_v<decltype(optimizer), tk::SGD>) {
          T trainer(model, optimizer, tk::RunPlan::from(config, 1).trainer_options);
          trainer.set_schedule(tk::RunPlan::from(config, 1).make_schedule(12));  // 12 micro-batches per epoch -> 4 windows
          std::vector<double> lrs;
          std::vector<bool> applied;
          for (int i = 0; i < 12; ++i) {
            const auto xb = data.x.narrow(0, 4 * i, 4), yb = data.y.narrow(0, 4 * i, 4);
            const bool poison = i / 3 == 1;  // the second window has a NaN loss: skipped
            auto r = trainer.micro_step([&] {
              auto loss = torch::mse_loss(model(xb), yb);
              return poison ? loss * std::numeric_limits<double>::quiet_NaN() : loss;
            });
            CHECK(r.window_closed == (i % 3 == 2));
            if (r.window_closed) {
              lrs.push_back(r.report.lr());
              applied.push_back(r.report.applied());
            }
          }
          REQUIRE(lrs.size() == 4);
          CHECK(applied == std::vector<bool>{true, false, true, true});
          // Applied steps 0, 1, 2 run at 7/8, 6/8, 5/8 of the base LR: the skipped window
          // did not move the schedule.
          CHECK(lrs[0] == doctest::Approx(base_lr * 7 / 8));
          CHECK(lrs[2] == doctest::Approx(base_lr * 6 / 8));
          CHECK(lrs[3] == doctest::Approx(base_lr * 5 / 8));
        } else {
          FAIL("expected tk::SGD");
        }
      });
    }
  });
}

}  // namespace test_dispatch
