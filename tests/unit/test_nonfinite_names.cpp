// The overflow diagnosis names where a gradient stops being finite: per parameter on the
// device while on (nothing while off), by module in the backward's order, and the origin as the
// first non-finite module the backward reached or the backward just before it. An overflow
// injected in one known layer (its weight scaled up) is named so, in FP16 dynamic and static,
// through the trainer and through tk::fit's messages and scalar logs.
#include "../support/helpers.hpp"

#include <trainkit/fit/fit.hpp>
#include <trainkit/trainer/trainer.hpp>

#include <cmath>
#include <filesystem>
#include <functional>
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

// fc -> LayerNorm -> head (the LayerNorm is what keep_norm_fp32 keeps in fp32 under master weights).
struct NormedImpl : torch::nn::Module {
  NormedImpl() {
    torch::manual_seed(5);
    fc = register_module("fc", torch::nn::Linear(8, 8));
    ln = register_module("ln", torch::nn::LayerNorm(torch::nn::LayerNormOptions({8})));
    head = register_module("head", torch::nn::Linear(8, 1));
  }
  torch::Tensor forward(const torch::Tensor& x) { return head(ln(fc(x))); }
  torch::nn::Linear fc{nullptr}, head{nullptr};
  torch::nn::LayerNorm ln{nullptr};
};
TORCH_MODULE(Normed);

torch::Tensor inputs(std::int64_t i) {
  torch::manual_seed(100 + i);
  return torch::randn({8, 8});
}

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
  CHECK(text == "non-finite gradients in 2 modules (windows, nearest the loss first): layer.0 (3), embed (3); first "
                 "seen at layer.0 (nearest the loss): the overflow is in layer.0's own weight gradient or in the "
                 "backward of layer.1, which computes the gradient flowing into layer.0");
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

  // Off: the window is skipped (the overflow is real); the counts below start at the turn-on.
  auto r = trainer.micro_step(loss(0));
  REQUIRE(r.window_closed);
  CHECK(r.report.skipped());
  CHECK(!trainer.watches_nonfinite());

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
  CHECK(!trainer.watches_nonfinite());
  Chain clean(1.0);
  tk::Trainer<tk::PrecisionPolicy<tk::FP16Dynamic>> clean_trainer{
      clean, tk::SGD{0.01}, tk::TrainerOptions().loss_scale(tk::LossScaleOptions().init_scale(16384))};
  clean_trainer.watch_nonfinite(true);
  CHECK(clean_trainer.micro_step([&] { return clean(inputs(0)).mean(); }).report.applied());
  CHECK(!clean_trainer.take_nonfinite_counts().any());
}

TEST_CASE("FP16 master weights, the chunked phase: the fp32-kept normalisation's gradient is counted too") {
  // One micro-batch per window and a master_chunk below the model's size: the phase runs in
  // chunks over the half gradient, and the LayerNorm kept in fp32 has its gradient apart.
  Normed model;
  tk::Trainer<tk::PrecisionPolicy<tk::MasterWeights<tk::FP16Dynamic>>> trainer{
      model, tk::SGD{0.01}, tk::TrainerOptions().master_chunk(64)};
  trainer.watch_nonfinite(true);
  const auto r = trainer.micro_step([&] { return model(inputs(0)).mean() * std::numeric_limits<float>::infinity(); });
  CHECK(r.report.skipped());
  const tk::NonfiniteCounts c = trainer.take_nonfinite_counts();
  INFO(c.text());
  CHECK(c.names == std::vector<std::string>{"fc.weight", "fc.bias", "ln.weight", "ln.bias", "head.weight", "head.bias"});
  CHECK(c.windows == std::vector<std::int64_t>(6, 1));
}

namespace {

// tk::fit over 8 micro-batches per epoch; what it threw (empty: nothing) and said.
template <class Trainer>
std::pair<std::string, std::string> fit_run(Trainer& trainer, Chain& model, const std::string& dir, std::int64_t log_frequent,
                                            std::int64_t patience, std::function<bool(std::int64_t)> bad = {}) {
  tk::Task<std::int64_t> task;
  task.batches_per_epoch = [](std::int64_t) { return std::int64_t{8}; };
  task.batch = [](std::int64_t epoch, std::int64_t index) { return epoch * 8 + index; };
  task.loss = [&model, bad](const std::int64_t& i, tk::Metrics&) {
    const auto loss = model(inputs(i % 8)).mean();
    // A bad micro-batch keeps its loss finite and makes every gradient NaN (sqrt's at 0 is
    // infinite, times 0): an overflow in the backward, which the gradients' ranking names. (A
    // loss that is itself not finite is the forward's: test_forward_peaks.cpp.)
    return bad && bad(i) ? loss + torch::sqrt(torch::relu(loss) * 0) : loss;
  };
  testing::CaptureStderr err;
  std::string stopped;
  try {
    tk::fit(trainer, task, tk::FitOptions().output_path(dir).end_epoch(3).log_frequent(log_frequent).progress(false)
                               .handle_signals(false).nonfinite_patience(patience));
  } catch (const tk::NonFiniteGradient& e) {
    stopped = e.what();
  }
  return {stopped, err.text.str()};
}

}  // namespace

TEST_CASE("FP16 static: a patience stop before the diagnosis was on waits one watched window, then names where") {
  // LOG_FREQUENT 4 and NONFINITE_PATIENCE 3: the first log window already reaches the patience,
  // unwatched; window 5 is watched and logged, and the stop names the modules.
  testing::TempDir dir;
  Chain model(3e3);
  tk::Trainer<tk::PrecisionPolicy<tk::FP16Static>> trainer{
      model, tk::SGD{0.01}, tk::TrainerOptions().loss_scale(tk::LossScaleOptions().static_scale(16384))};
  const auto [stopped, said] = fit_run(trainer, model, dir.path, 4, 3);
  INFO(stopped);
  CHECK(stopped.find("epoch 0, micro-batch 3 of 8, optimizer step 4: 4 of the last 4 optimizer steps were skipped") == 0);
  CHECK(stopped.find("4 skipped with no clean log interval between them (TRAIN.NONFINITE_PATIENCE 3): stopping") !=
        std::string::npos);
  CHECK(stopped.find("; non-finite gradients in 1 module (windows, nearest the loss first): l1 (1); first seen at l1 "
                     "(nearest the loss): the overflow is in l1's own weight gradient or in the backward of mid") !=
        std::string::npos);
  CHECK(trainer.skipped_steps().item<std::int64_t>() == 5);
  CHECK(!trainer.watches_nonfinite());  // (the run log turned it off as the stop left: no hook stays)
  const std::string scalars = testing::read_text(dir.path + "/model-scalars.jsonl");
  CHECK(scalars.find("\"nonfinite/l1\"") != std::string::npos);
  CHECK(scalars.find("nonfinite/mid") == std::string::npos);
}

TEST_CASE("a deferred stop stops at the watched window even when that window is clean") {
  testing::TempDir dir;
  Chain model(1.0);
  tk::Trainer<> trainer{model, tk::SGD{0.01}};
  const auto [stopped, said] = fit_run(trainer, model, dir.path, 4, 3, [](std::int64_t i) { return i < 4; });
  INFO(stopped);
  CHECK(stopped.find("epoch 0, micro-batch 3 of 8, optimizer step 4: 4 of the last 4 optimizer steps were skipped") == 0);
  CHECK(stopped.find("non-finite gradients in") == std::string::npos);  // window 5 was clean: nothing to name
  CHECK(trainer.skipped_steps().item<std::int64_t>() == 4);
  CHECK(trainer.applied_steps().item<std::int64_t>() == 1);
}

TEST_CASE("FP32: the patience stop names where, nearest the loss first, once the diagnosis watched") {
  // LOG_FREQUENT 2, patience 5: the check at window 2 warns and turns the diagnosis on, the one
  // at 4 names the modules, the one at 6 stops, naming them. The loss's gradient is NaN: every
  // parameter's is, and the first the backward reaches is head's.
  testing::TempDir dir;
  Chain model(1.0);
  tk::Trainer<> trainer{model, tk::SGD{0.01}};
  const auto [stopped, said] = fit_run(trainer, model, dir.path, 2, 5, [](std::int64_t) { return true; });
  INFO(stopped);
  INFO(said);
  CHECK(stopped.find("epoch 0, micro-batch 5 of 8, optimizer step 6: 2 of the last 2 optimizer steps were skipped") == 0);
  CHECK(stopped.find("; non-finite gradients in 3 modules (windows, nearest the loss first): head (2), mid (2), l1 (2); "
                     "first seen at head (nearest the loss): the overflow is in head's own weight gradient or in the "
                     "loss's gradient; the checkpoints written so far are intact") != std::string::npos);
  CHECK(said.find("optimizer step 2: 2 of the last 2 optimizer steps were skipped") != std::string::npos);
  CHECK(said.find("trainkit now watches which modules' gradients are not finite") != std::string::npos);
  CHECK(said.find("trainkit: warning: epoch 0, micro-batch 3 of 8, optimizer step 4: non-finite gradients in 3 modules") !=
        std::string::npos);
}

TEST_CASE("FP32: an epoch shorter than LOG_FREQUENT is checked at its end, and stops there before its work") {
  // No log window inside the run (LOG_FREQUENT 1000): the epoch's end checks the skipped steps;
  // the patience is reached there, unwatched: the run stops at once (no validation, no
  // checkpoint), saying how to learn where.
  testing::TempDir dir;
  Chain model(1.0);
  tk::Trainer<> trainer{model, tk::SGD{0.01}};
  const auto [stopped, said] = fit_run(trainer, model, dir.path, 1000, 5, [](std::int64_t) { return true; });
  INFO(stopped);
  CHECK(stopped.find("epoch 0, micro-batch 7 of 8, optimizer step 8: 8 of the last 8 optimizer steps were skipped "
                     "(non-finite gradients); 8 skipped with no clean log interval between them (TRAIN.NONFINITE_PATIENCE "
                     "5): stopping; lower TRAIN.LR or check the data; where: not watched yet") == 0);
  CHECK(stopped.find("with LOG_FREQUENT below 5 windows it names the modules") != std::string::npos);
  CHECK(trainer.skipped_steps().item<std::int64_t>() == 8);
  CHECK(!std::filesystem::exists(dir.path + "/model-0000.ckpt"));
}

TEST_CASE("FP16 dynamic: a scale at its floor that still overflows stops as a static one, named") {
  // Floor 8192: one backoff from 16384 reaches it, and mid's backward overflows there too.
  testing::TempDir dir;
  Chain model(3e3);
  tk::Trainer<tk::PrecisionPolicy<tk::FP16Dynamic>> trainer{
      model, tk::SGD{0.01}, tk::TrainerOptions().loss_scale(tk::LossScaleOptions().init_scale(16384).min_scale(8192))};
  const auto [stopped, said] = fit_run(trainer, model, dir.path, 2, 3);
  INFO(stopped);
  CHECK(stopped.find("optimizer step 4: 2 of the last 2 optimizer steps were skipped") != std::string::npos);
  CHECK(stopped.find("the dynamic loss scale sits at its floor 8192 (TRAIN.FP16_MIN_LOSS_SCALE, "
                     "LossScaleOptions::min_scale) and the gradient still overflows") != std::string::npos);
  CHECK(stopped.find("l1 (2); first seen at l1") != std::string::npos);
}

TEST_CASE("FP16 dynamic: the scale's start-up search is not watched nor named") {
  // A clean model from a scale of 2^20: the first windows overflow while the scale backs off
  // (its search), then it trains; no diagnosis, no warning, no nonfinite/ scalar.
  testing::TempDir dir;
  Chain model(1.0);
  tk::Trainer<tk::PrecisionPolicy<tk::FP16Dynamic>> trainer{
      model, tk::SGD{0.01}, tk::TrainerOptions().loss_scale(tk::LossScaleOptions().init_scale(1 << 20))};
  const auto [stopped, said] = fit_run(trainer, model, dir.path, 1, 3);
  CHECK(stopped.empty());
  CHECK(trainer.skipped_steps().item<std::int64_t>() > 0);  // (not comparing nothing: there were skips)
  CHECK(said.find("non-finite gradients in") == std::string::npos);
  CHECK(testing::read_text(dir.path + "/model-scalars.jsonl").find("nonfinite/") == std::string::npos);
}

}  // namespace test_nonfinite_names
