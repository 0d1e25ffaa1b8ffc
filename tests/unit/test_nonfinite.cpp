// Skipped optimizer steps are never silent: in FP32 the first skip is a
// warning naming the position, and TRAIN.NONFINITE_PATIENCE skips with no clean log interval
// between them stop the run with NonFiniteGradient; one transient skip only warns.
#include "../support/helpers.hpp"

#include <trainkit/fit/fit.hpp>
#include <trainkit/trainer/trainer.hpp>

#include <cmath>
#include <limits>
#include <sstream>
#include <string>

namespace test_nonfinite {  // this file's names, apart from those of the files it shares a unity batch with

namespace {

// An FP32 run of 2 epochs x 8 micro-batches (accumulation 1, a log every window) whose loss is
// infinite at the micro-batches `bad` says.
struct Run {
  testing::TempDir dir;
  testing::TinyMlp model = testing::make_mlp(3);
  tk::Trainer<> trainer{model, tk::SGD{0.05}};
  testing::Regression data = testing::regression(64);
  tk::Task<std::int64_t> task;
  explicit Run(std::function<bool(std::int64_t epoch, std::int64_t index)> bad) {
    task.batches_per_epoch = [](std::int64_t) { return std::int64_t{8}; };
    task.batch = [](std::int64_t epoch, std::int64_t index) { return epoch * 8 + index; };
    task.loss = [this, bad](const std::int64_t& b, tk::Metrics&) {
      const auto i = b % 8;
      auto loss = torch::mse_loss(model(data.x.narrow(0, 8 * i, 8)), data.y.narrow(0, 8 * i, 8));
      return bad(b / 8, i) ? loss * std::numeric_limits<float>::infinity() : loss;
    };
  }
  tk::FitOptions options(std::int64_t patience) const {
    return tk::FitOptions().output_path(dir.path).end_epoch(2).log_frequent(1).progress(false).handle_signals(false)
        .nonfinite_patience(patience);
  }
};

}  // namespace

TEST_CASE("FP32: skipped steps warn at the first and stop the run after NONFINITE_PATIENCE") {
  Run run([](std::int64_t epoch, std::int64_t index) { return epoch == 0 && index >= 2; });  // diverged from step 3 on
  testing::CaptureStderr err;
  std::string stopped;
  try {
    tk::fit(run.trainer, run.task, run.options(3));
  } catch (const tk::NonFiniteGradient& e) {
    stopped = e.what();
  }
  INFO(stopped);
  CHECK(stopped.find("epoch 0, micro-batch 4 of 8, optimizer step 5: 1 of the last 1 optimizer steps were skipped "
                     "(non-finite gradients; training loss ") == 0);
  CHECK(stopped.find("3 skipped with no clean log interval between them (TRAIN.NONFINITE_PATIENCE 3): stopping") !=
        std::string::npos);
  const std::string said = err.text.str();
  INFO(said);
  CHECK(said.find("trainkit: warning: epoch 0, micro-batch 2 of 8, optimizer step 3: 1 of the last 1 optimizer steps were "
                  "skipped") != std::string::npos);
  CHECK(said.find("skips a step only when its gradient is not finite") != std::string::npos);
  CHECK(run.trainer.skipped_steps().item<std::int64_t>() == 3);
}

TEST_CASE("FP32: one transient skip warns once and the run goes on") {
  Run run([](std::int64_t epoch, std::int64_t index) { return epoch == 0 && index == 4; });
  testing::CaptureStderr err;
  const tk::FitResult r = tk::fit(run.trainer, run.task, run.options(3));
  CHECK(r.skipped_steps == 1);
  CHECK(r.applied_steps == 15);
  const std::string said = err.text.str();
  INFO(said);
  CHECK(said.find("trainkit: warning: epoch 0, micro-batch 4 of 8, optimizer step 5") != std::string::npos);
  CHECK(said.find("warning", said.find("warning") + 1) == std::string::npos);  // once
}

TEST_CASE("FP16 with a static loss scale that overflows every window stops after NONFINITE_PATIENCE, naming the key") {
  // A scale of 2^100: every gradient overflows float16 (or its fp32 norm), every window is
  // skipped, and a static scale never backs off: a run that trains nothing, stopped as FP32's.
  testing::TempDir dir;
  auto model = testing::make_mlp(4);
  tk::Trainer<tk::PrecisionPolicy<tk::FP16Static>> trainer{
      model, tk::SGD{0.05}, tk::TrainerOptions().loss_scale(tk::LossScaleOptions().static_scale(std::pow(2.0, 100)))};
  const auto data = testing::regression(64);
  tk::Task<std::int64_t> task;
  task.batches_per_epoch = [](std::int64_t) { return std::int64_t{8}; };
  task.batch = [](std::int64_t, std::int64_t index) { return index; };
  task.loss = [&](const std::int64_t& i, tk::Metrics&) {
    return torch::mse_loss(model(data.x.narrow(0, 8 * i, 8)), data.y.narrow(0, 8 * i, 8));
  };
  testing::CaptureStderr err;
  std::string stopped;
  try {
    tk::fit(trainer, task, tk::FitOptions().output_path(dir.path).end_epoch(2).log_frequent(1).progress(false)
                               .handle_signals(false).nonfinite_patience(4));
  } catch (const tk::NonFiniteGradient& e) {
    stopped = e.what();
  }
  INFO(stopped);
  CHECK(stopped.find("4 skipped with no clean log interval between them (TRAIN.NONFINITE_PATIENCE 4): stopping") !=
        std::string::npos);
  CHECK(stopped.find("the static loss scale 1.26765e+30 overflows the gradient: set TRAIN.FP16_LOSS_SCALE") !=
        std::string::npos);
  CHECK(stopped.find("'dynamic'") != std::string::npos);
  CHECK(trainer.skipped_steps().item<std::int64_t>() == 4);
  CHECK(trainer.applied_steps().item<std::int64_t>() == 0);
  CHECK(err.text.str().find("the static loss scale") != std::string::npos);  // the first skip's warning
}

TEST_CASE("FP16Dynamic from C++ with its defaults: a gradient that overflows at any scale is said within 20 steps, and stops") {
  // The loss is finite, but its gradient overflows float16 at any scale >= 1: the scale backs
  // off from 2^16 to its floor 1 in 16 windows (its search), then sits there. The first check
  // comes at window 20 although LOG_FREQUENT is 100, and the epoch's end stops the run.
  const tk::LossScaleOptions defaults;
  CHECK(defaults.min_scale() == 1.0);
  testing::TempDir dir;
  auto model = testing::make_mlp(5);
  tk::Trainer<tk::PrecisionPolicy<tk::FP16Dynamic>> trainer{model, tk::SGD{0.05}};
  const auto data = testing::regression(64);
  tk::Task<std::int64_t> task;
  task.batches_per_epoch = [](std::int64_t) { return std::int64_t{60}; };
  task.batch = [](std::int64_t, std::int64_t index) { return index; };
  task.loss = [&](const std::int64_t& i, tk::Metrics&) {
    const auto out = model(data.x.narrow(0, 8 * (i % 8), 8)).to(torch::kFloat);
    return out.pow(2).mean() * 1e9;  // (its gradient, 2.5e8 x the output, passes 65504 in float16)
  };
  testing::CaptureStderr err;
  std::string stopped;
  try {
    tk::fit(trainer, task, tk::FitOptions().output_path(dir.path).end_epoch(1).log_frequent(100).progress(false)
                               .handle_signals(false).nonfinite_patience(20));
  } catch (const tk::NonFiniteGradient& e) {
    stopped = e.what();
  }
  const std::string said = err.text.str();
  INFO(said);
  INFO(stopped);
  CHECK(said.find("trainkit: warning: epoch 0, micro-batch 19 of 60, optimizer step 20: 20 of the last 20 optimizer "
                  "steps were skipped") != std::string::npos);
  CHECK(said.find("the dynamic loss scale sits at its floor 1 (TRAIN.FP16_MIN_LOSS_SCALE, LossScaleOptions::min_scale) "
                  "and the gradient still overflows") != std::string::npos);
  // Window 20 counted 4 skips at the floor (16 were the search); the epoch's end 40 more.
  CHECK(stopped.find("44 skipped with no clean log interval between them (TRAIN.NONFINITE_PATIENCE 20): stopping; the "
                     "dynamic loss scale sits at its floor 1") != std::string::npos);
  CHECK(trainer.loss_scale().item<float>() == 1.0f);
  CHECK(trainer.applied_steps().item<std::int64_t>() == 0);
}

}  // namespace test_nonfinite
