// The overflow diagnosis names where a gradient stops being finite: per parameter on the
// device while on (nothing while off), by module in the backward's order, and the origin as the
// first non-finite module the backward reached or the backward just before it. An overflow
// injected in one known layer (its weight scaled up) is named so, in FP16 dynamic and static,
// through the trainer and through tk::fit's messages and scalar logs.
#include "../support/helpers.hpp"

#include <trainkit/fit/fit.hpp>
#include <trainkit/trainer/trainer.hpp>

#include <cmath>
#include <limits>
#include <fstream>
#include <sstream>
#include <string>

namespace test_nonfinite_names {  // this file's names, apart from those of the files it shares a unity batch with

namespace {

// l1 -> relu -> mid -> sin -> head, loss = mean of the output. mid's weight scaled by `k`: its
// output, through sin, stays in [-1, 1], so head's gradients and mid's own weight gradient stay
// finite, but the gradient mid's backward passes to l1 is k times larger and overflows float16.
struct ChainImpl : torch::nn::Module {
  explicit ChainImpl(double k) {
    torch::manual_seed(3);
    l1 = register_module("l1", torch::nn::Linear(8, 8));
    mid = register_module("mid", torch::nn::Linear(8, 8));
    head = register_module("head", torch::nn::Linear(8, 1));
    torch::NoGradGuard no_grad;
    mid->weight.mul_(k);
  }
  torch::Tensor forward(const torch::Tensor& x) { return head(torch::sin(mid(torch::relu(l1(x))))); }
  torch::nn::Linear l1{nullptr}, mid{nullptr}, head{nullptr};
};
TORCH_MODULE(Chain);

torch::Tensor inputs(std::int64_t i) {
  torch::manual_seed(100 + i);
  return torch::randn({8, 8});
}

// std::cerr into a string for the scope.
struct CaptureStderr {
  std::ostringstream text;
  std::streambuf* old = std::cerr.rdbuf(text.rdbuf());
  ~CaptureStderr() { std::cerr.rdbuf(old); }
};

}  // namespace

TEST_CASE("NonfiniteCounts: modules in the backward's order, the origin and the text") {
  tk::NonfiniteCounts c;
  c.names = {"embed.weight", "layer.0.w", "layer.0.b", "layer.1.w", "head.weight"};
  c.windows = {3, 3, 2, 0, 0};
  c.backward_order = {4, 3, 1, 2};  // head, layer.1, layer.0; embed never reached (last)
  CHECK(c.any());
  CHECK(c.module_order() == std::vector<std::string>{"head", "layer.1", "layer.0", "embed"});
  const auto m = c.modules();
  REQUIRE(m.size() == 2);
  CHECK(m[0] == std::pair<std::string, std::int64_t>{"layer.0", 3});
  CHECK(m[1] == std::pair<std::string, std::int64_t>{"embed", 3});
  CHECK(c.origin() == std::pair<std::string, std::string>{"layer.0", "layer.1"});
  const std::string text = c.text();
  INFO(text);
  CHECK(text.find("non-finite gradients in 2 modules (windows, nearest the loss first): layer.0 (3), embed (3); "
                  "it begins at layer.0") == 0);
  CHECK(text.find("or in the backward of layer.1") != std::string::npos);
  c.windows = {0, 0, 0, 0, 0};
  CHECK(!c.any());
  CHECK(c.text().empty());
  CHECK(tk::NonfiniteCounts::module_of("bias") == "bias");
}

TEST_CASE("FP16 dynamic: an overflow injected in mid's backward is named at l1, from mid; off, nothing is counted") {
  Chain model(3e3);
  tk::Trainer<tk::PrecisionPolicy<tk::FP16Dynamic>> trainer{
      model, tk::SGD{0.01}, tk::TrainerOptions().loss_scale(tk::LossScaleOptions().init_scale(16384))};
  const auto loss = [&](std::int64_t i) { return [&model, i] { return model(inputs(i)).mean(); }; };

  // Off: the window is skipped (the overflow is real) and nothing is counted.
  auto r = trainer.micro_step(loss(0));
  REQUIRE(r.window_closed);
  CHECK(r.report.skipped());
  CHECK(!trainer.watches_nonfinite());
  CHECK(!trainer.take_nonfinite_counts().any());

  trainer.watch_nonfinite(true);
  CHECK(trainer.watches_nonfinite());
  for (std::int64_t i = 1; i <= 3; ++i) {
    r = trainer.micro_step(loss(i));
    CHECK(r.report.skipped());
  }
  const tk::NonfiniteCounts c = trainer.take_nonfinite_counts();
  INFO(c.text());
  CHECK(c.names == std::vector<std::string>{"l1.weight", "l1.bias", "mid.weight", "mid.bias", "head.weight", "head.bias"});
  CHECK(c.windows == std::vector<std::int64_t>{3, 3, 0, 0, 0, 0});
  CHECK(c.module_order() == std::vector<std::string>{"head", "mid", "l1"});
  CHECK(c.origin() == std::pair<std::string, std::string>{"l1", "mid"});
  CHECK(!trainer.take_nonfinite_counts().any());  // read once: zero after

  // Off again: the counts and the hooks go; a clean model then counts nothing when on.
  trainer.watch_nonfinite(false);
  CHECK(!trainer.take_nonfinite_counts().any());
  Chain clean(1.0);
  tk::Trainer<tk::PrecisionPolicy<tk::FP16Dynamic>> clean_trainer{
      clean, tk::SGD{0.01}, tk::TrainerOptions().loss_scale(tk::LossScaleOptions().init_scale(16384))};
  clean_trainer.watch_nonfinite(true);
  CHECK(clean_trainer.micro_step([&] { return clean(inputs(0)).mean(); }).report.applied());
  CHECK(!clean_trainer.take_nonfinite_counts().any());
}

TEST_CASE("FP16 static: the patience stop names the modules and the origin, and the scalar logs count them") {
  // LOG_FREQUENT 4 and NONFINITE_PATIENCE 3: the first log window already reaches the patience,
  // before the diagnosis was on; one more window, watched and logged, names them, then the stop.
  testing::TempDir dir;
  Chain model(3e3);
  tk::Trainer<tk::PrecisionPolicy<tk::FP16Static>> trainer{
      model, tk::SGD{0.01}, tk::TrainerOptions().loss_scale(tk::LossScaleOptions().static_scale(16384))};
  tk::Task<std::int64_t> task;
  task.batches_per_epoch = [](std::int64_t) { return std::int64_t{8}; };
  task.batch = [](std::int64_t, std::int64_t index) { return index; };
  task.loss = [&](const std::int64_t& i, tk::Metrics&) { return model(inputs(i)).mean(); };
  CaptureStderr err;
  std::string stopped;
  try {
    tk::fit(trainer, task, tk::FitOptions().output_path(dir.path).end_epoch(2).log_frequent(4).progress(false)
                               .handle_signals(false).nonfinite_patience(3));
  } catch (const tk::NonFiniteGradient& e) {
    stopped = e.what();
  }
  INFO(stopped);
  CHECK(stopped.find("optimizer step 5: 1 of the last 1 optimizer steps were skipped") != std::string::npos);
  CHECK(stopped.find("5 skipped with no clean log interval between them (TRAIN.NONFINITE_PATIENCE 3): stopping") !=
        std::string::npos);
  CHECK(stopped.find("non-finite gradients in 1 module (windows, nearest the loss first): l1 (1); it begins at l1") !=
        std::string::npos);
  CHECK(stopped.find("or in the backward of mid") != std::string::npos);
  CHECK(trainer.skipped_steps().item<std::int64_t>() == 5);
  const std::string said = err.text.str();
  INFO(said);
  CHECK(said.find("trainkit: warning: epoch 0, micro-batch 4 of 8, optimizer step 5: non-finite gradients in 1 module") !=
        std::string::npos);
  std::ifstream jsonl(dir.path + "/model-scalars.jsonl");
  std::stringstream lines;
  lines << jsonl.rdbuf();
  CHECK(lines.str().find("\"nonfinite/l1\"") != std::string::npos);
  CHECK(lines.str().find("nonfinite/mid") == std::string::npos);
}

TEST_CASE("FP32: skipped steps in an epoch shorter than LOG_FREQUENT stop the run at the epoch's end, named") {
  // No log window inside the run (LOG_FREQUENT 1000): the epoch's end checks the skipped steps
  // as a log window would; the patience is reached there, unwatched, so the next window is
  // watched and logged, and the stop names where the gradient stopped being finite.
  testing::TempDir dir;
  Chain model(1.0);
  tk::Trainer<> trainer{model, tk::SGD{0.01}};
  tk::Task<std::int64_t> task;
  task.batches_per_epoch = [](std::int64_t) { return std::int64_t{8}; };
  task.batch = [](std::int64_t, std::int64_t index) { return index; };
  task.loss = [&](const std::int64_t& i, tk::Metrics&) {
    return model(inputs(i)).mean() * std::numeric_limits<float>::infinity();  // every window diverged
  };
  CaptureStderr err;
  std::string stopped;
  try {
    tk::fit(trainer, task, tk::FitOptions().output_path(dir.path).end_epoch(3).log_frequent(1000).progress(false)
                               .handle_signals(false).nonfinite_patience(5));
  } catch (const tk::NonFiniteGradient& e) {
    stopped = e.what();
  }
  INFO(stopped);
  CHECK(stopped.find("epoch 1, micro-batch 0 of 8, optimizer step 9: 1 of the last 1 optimizer steps were skipped") == 0);
  CHECK(stopped.find("9 skipped with no clean log interval between them (TRAIN.NONFINITE_PATIENCE 5): stopping; "
                     "lower TRAIN.LR or check the data") != std::string::npos);
  // The loss itself is infinite: every gradient is, and the first the backward reached is head's.
  CHECK(stopped.find("non-finite gradients in 3 modules (windows, nearest the loss first): head (1), mid (1), l1 (1); "
                     "it begins at head") != std::string::npos);
  CHECK(trainer.skipped_steps().item<std::int64_t>() == 9);
}

}  // namespace test_nonfinite_names
