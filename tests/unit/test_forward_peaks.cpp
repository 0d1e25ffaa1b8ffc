// The forward's peaks: the largest |output| of each module, from ATen's operator observer while
// a recording lives (nothing registered otherwise). Outermost operators only, views skipped,
// parameter-free operators counted to the parent of the last module whose parameters were used;
// an overflow injected in one known layer (its weight scaled up) under FP16 is named where it
// begins, by the table and by tk::fit's warning, stop and scalar logs.
#include "../support/helpers.hpp"

#include <trainkit/fit/fit.hpp>
#include <trainkit/trainer/forward_peaks.hpp>
#include <trainkit/trainer/trainer.hpp>

#include <ATen/autocast_mode.h>
#include <ATen/record_function.h>

#include <cmath>
#include <fstream>
#include <limits>
#include <sstream>
#include <string>

namespace test_forward_peaks {  // this file's names, apart from those of the files it shares a unity batch with

namespace {

// a -> gelu -> attention-like block (query, key, their product, softmax-weighted) -> b.
struct BlockImpl : torch::nn::Module {
  BlockImpl() {
    query = register_module("query", torch::nn::Linear(8, 8));
    key = register_module("key", torch::nn::Linear(8, 8));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    const auto q = query(x);
    const auto k = key(x);
    const auto scores = torch::matmul(q, k.transpose(0, 1));  // (the transpose: a view)
    return torch::matmul(torch::softmax(scores, -1), x);
  }
  torch::nn::Linear query{nullptr}, key{nullptr};
};
TORCH_MODULE(Block);

struct NetImpl : torch::nn::Module {
  explicit NetImpl(double k = 1.0) {
    torch::manual_seed(11);
    a = register_module("a", torch::nn::Linear(8, 8));
    block = register_module("block", Block());
    b = register_module("b", torch::nn::Linear(8, 4));
    torch::NoGradGuard no_grad;
    a->weight.mul_(k);
  }
  torch::Tensor forward(const torch::Tensor& x) { return b(block(torch::gelu(a(x)))); }
  torch::nn::Linear a{nullptr}, b{nullptr};
  Block block{nullptr};
};
TORCH_MODULE(Net);

torch::Tensor inputs(std::int64_t i) {
  torch::manual_seed(200 + i);
  return torch::randn({6, 8});
}

double max_abs(const torch::Tensor& t) { return t.abs().max().item<double>(); }

size_t index_of(const tk::ForwardPeakTable& t, const std::string& module) {
  const auto it = std::find(t.modules.begin(), t.modules.end(), module);
  REQUIRE(it != t.modules.end());
  return static_cast<size_t>(it - t.modules.begin());
}

}  // namespace

TEST_CASE("each module's peak is the largest |output| of its operators, parameter-free ones its parent's") {
  Net net;
  tk::ForwardPeaks peaks(*net);
  const auto x = inputs(0);
  {
    auto recording = peaks.record();
    net(x);
  }
  // Linear a, gelu, query, key, matmul, softmax, matmul, Linear b: the transpose is a view.
  CHECK(peaks.outputs_recorded() == 8);
  const tk::ForwardPeakTable t = peaks.take();
  CHECK(t.modules == std::vector<std::string>{"(model)", "a", "block", "block.query", "block.key", "b"});
  // The same values computed apart, with nothing recording.
  torch::NoGradGuard no_grad;
  const auto ax = net->a(x), g = torch::gelu(ax), q = net->block->query(g), k = net->block->key(g);
  const auto scores = torch::matmul(q, k.transpose(0, 1));
  const auto mixed = torch::matmul(torch::softmax(scores, -1), g);
  const auto out = net->b(mixed);
  const int f32 = tk::ForwardPeakTable::wider;
  CHECK(t.peak(index_of(t, "a"), f32) == max_abs(ax));
  CHECK(t.peak(index_of(t, "(model)"), f32) == max_abs(g));  // gelu after a: a's parent
  CHECK(t.peak(index_of(t, "block.query"), f32) == max_abs(q));
  CHECK(t.peak(index_of(t, "block.key"), f32) == max_abs(k));
  CHECK(t.peak(index_of(t, "block"), f32) == std::max(max_abs(scores), max_abs(mixed)));
  CHECK(t.peak(index_of(t, "b"), f32) == max_abs(out));
  CHECK(t.peak(index_of(t, "a"), tk::ForwardPeakTable::half) == -1);
  // The forward's order, as first reached: a, gelu's (model), query, key, block (the product), b.
  CHECK(t.forward_order == std::vector<std::int64_t>{1, 0, 3, 4, 2, 5});
  CHECK(t.first_nonfinite().empty());
  // Taken: a fresh start.
  CHECK(peaks.outputs_recorded() == 0);
  CHECK(!peaks.take().any());
}

TEST_CASE("a Linear on 3-D input (its result returned as a view) is counted; fp64 outputs are measured in fp64") {
  Net net;
  tk::ForwardPeaks peaks(*net);
  const auto x = torch::randn({2, 6, 8});
  {
    auto recording = peaks.record();
    net->a(x);
  }
  auto t = peaks.take();
  {
    torch::NoGradGuard no_grad;
    CHECK(t.peak(index_of(t, "a"), tk::ForwardPeakTable::wider) == max_abs(net->a(x)));
  }
  // A double output (a loss computed in fp64), past fp32's range: its peak is kept, not inf.
  const auto big = torch::full({3}, 1e300, torch::kDouble);
  {
    auto recording = peaks.record();
    big.mul(2);
  }
  t = peaks.take();
  CHECK(t.missed == 0);
  CHECK(t.peak(index_of(t, "(model)"), tk::ForwardPeakTable::wider) == 2e300);
  CHECK(t.first_nonfinite().empty());
}

TEST_CASE("not recording, nothing is registered or counted; one recording at a time") {
  Net net;
  tk::ForwardPeaks peaks(*net);
  CHECK(!at::hasThreadLocalCallbacks());
  net(inputs(0));
  CHECK(peaks.outputs_recorded() == 0);
  const auto x = inputs(1);
  {
    auto recording = peaks.record();
    CHECK(at::hasThreadLocalCallbacks());
    CHECK_THROWS_WITH_AS(peaks.record(), doctest::Contains("a recording is already running on this thread"),
                         c10::Error);
    tk::ForwardPeaks::Recording moved = std::move(recording);  // (moved: still one, ended once)
    net(x);
  }
  CHECK(!at::hasThreadLocalCallbacks());
  CHECK(peaks.outputs_recorded() == 8);
  net(inputs(2));
  CHECK(peaks.outputs_recorded() == 8);
}

TEST_CASE("under autocast, an operator's casts are its own: counted once, in the half dtype") {
  Net net;
  tk::ForwardPeaks peaks(*net);
  const auto x = inputs(0);
  {
    at::autocast::set_autocast_enabled(at::kCPU, true);
    at::autocast::set_autocast_dtype(at::kCPU, at::kBFloat16);
    auto recording = peaks.record();
    net(x);
    at::autocast::set_autocast_enabled(at::kCPU, false);
    at::autocast::clear_cache();
  }
  CHECK(peaks.outputs_recorded() == 8);
  const auto t = peaks.take();
  CHECK(t.peak(index_of(t, "a"), tk::ForwardPeakTable::bfloat16) > 0);
  CHECK(t.peak(index_of(t, "a"), tk::ForwardPeakTable::wider) == -1);
}

TEST_CASE("an overflow in one layer's half forward is named where it begins") {
  // a's weight scaled so that its float16 output passes 65504; what follows receives inf/NaN.
  Net net(1e5);
  net->to(torch::kHalf);
  tk::ForwardPeaks peaks(*net);
  {
    auto recording = peaks.record();
    net(inputs(0).to(torch::kHalf));
  }
  const auto t = peaks.take();
  CHECK(std::isinf(t.peak(index_of(t, "a"), tk::ForwardPeakTable::half)));
  CHECK(t.first_nonfinite() == "a");
  CHECK(std::isinf(t.peak(index_of(t, "(model)"), tk::ForwardPeakTable::half)));  // (gelu's, after a)
  const auto rows = t.rows();
  REQUIRE(!rows.empty());
  CHECK(std::isinf(rows.front().peak));
  INFO(t.text());
  CHECK(t.text().find("the forward's output is first not finite in a (") == 0);
  // A clean half forward: the fraction of 65504 named.
  Net clean;
  clean->to(torch::kHalf);
  tk::ForwardPeaks clean_peaks(*clean);
  {
    auto recording = clean_peaks.record();
    clean(inputs(0).to(torch::kHalf));
  }
  const auto c = clean_peaks.take();
  CHECK(c.first_nonfinite().empty());
  CHECK(c.text().find("% of 65504)") != std::string::npos);
}

namespace {

size_t count_of(const std::string& text, const std::string& what) {
  size_t n = 0;
  for (size_t at = text.find(what); at != std::string::npos; at = text.find(what, at + 1)) ++n;
  return n;
}

// tk::fit over 8 micro-batches per epoch, 2 epochs; what it threw (empty: nothing).
template <class Trainer>
std::string fit_run(Trainer& trainer, Net& model, const std::string& dir, bool forward_peaks) {
  tk::Task<std::int64_t> task;
  task.batches_per_epoch = [](std::int64_t) { return std::int64_t{8}; };
  task.batch = [](std::int64_t epoch, std::int64_t index) { return epoch * 8 + index; };
  task.loss = [&model](const std::int64_t& i, tk::Metrics&) { return model(inputs(i % 8)).to(torch::kFloat).pow(2).mean(); };
  try {
    tk::fit(trainer, task, tk::FitOptions().output_path(dir).end_epoch(2).log_frequent(4).progress(false)
                               .handle_signals(false).nonfinite_patience(2).forward_peaks(forward_peaks));
  } catch (const tk::NonFiniteGradient& e) {
    return e.what();
  }
  return {};
}

}  // namespace

TEST_CASE("fit: the peaks of each log window's forward are logged, none between, none when off") {
  for (const bool on : {true, false}) {
    testing::TempDir dir;
    Net model;
    tk::Trainer<> trainer{model, tk::SGD{0.01}};
    CHECK(fit_run(trainer, model, dir.path, on).empty());
    const std::string scalars = testing::read_text(dir.path + "/model-scalars.jsonl");
    // 16 windows, LOG_FREQUENT 4: 4 log windows.
    CHECK(count_of(scalars, "\"forward-peak/block.query\"") == (on ? 4u : 0u));
    CHECK(count_of(testing::read_text(dir.path + "/model-log.txt"), ": forward peaks: largest |output| per module") ==
          (on ? 4u : 0u));
  }
}

TEST_CASE("fit, 2 micro-batches per window: every micro-batch of a log window is recorded, no other") {
  testing::TempDir dir;
  Net model;
  tk::Trainer<tk::PrecisionPolicy<tk::FP32>, tk::AccumulationPolicy<2>> trainer{model, tk::SGD{0.01}};
  std::int64_t calls = 0, recorded = 0;
  tk::Task<std::int64_t> task;
  task.batches_per_epoch = [](std::int64_t) { return std::int64_t{8}; };
  task.batch = [](std::int64_t epoch, std::int64_t index) { return epoch * 8 + index; };
  task.loss = [&](const std::int64_t& i, tk::Metrics&) {
    ++calls;
    recorded += at::hasThreadLocalCallbacks() ? 1 : 0;
    return model(inputs(i % 8)).pow(2).mean();
  };
  tk::fit(trainer, task, tk::FitOptions().output_path(dir.path).end_epoch(2).log_frequent(2).progress(false)
                             .handle_signals(false).forward_peaks(true));
  // 8 windows of 2 micro-batches; windows 2, 4, 6 and 8 are log windows.
  CHECK(calls == 16);
  CHECK(recorded == 8);
  CHECK(!at::hasThreadLocalCallbacks());
}

namespace {
struct Rows {
  torch::Tensor x;
};
}  // namespace

TEST_CASE("fit: a micro-batch replayed after out-of-memory leaves no record of its failed attempt") {
  testing::TempDir dir;
  Net model;
  tk::Trainer<> trainer{model, tk::SGD{0.01}};
  bool thrown = false;
  tk::Task<Rows> task;
  task.batches_per_epoch = [](std::int64_t) { return std::int64_t{4}; };
  task.batch = [](std::int64_t, std::int64_t index) { return Rows{inputs(index)}; };
  task.items = [](const Rows& b) { return b.x.size(0); };
  task.split = [](const Rows& b, std::int64_t parts) {
    std::vector<Rows> out;
    for (const auto& c : b.x.chunk(parts)) out.push_back({c});
    return out;
  };
  task.loss = [&](const Rows& b, tk::Metrics&) {
    if (!thrown && b.x.size(0) == 6) {  // micro-batch 0, whole: an output of 'a' far past the others, then out of memory
      thrown = true;
      model->a(b.x * 1e4);
      TORCH_CHECK_WITH(OutOfMemoryError, false, "out of memory (test hook)");
    }
    return model(b.x).pow(2).mean();
  };
  const auto r = tk::fit(trainer, task, tk::FitOptions().output_path(dir.path).end_epoch(1).log_frequent(1)
                                            .progress(false).handle_signals(false).forward_peaks(true));
  CHECK(thrown);
  CHECK(r.replays == 1);
  const std::string scalars = testing::read_text(dir.path + "/model-scalars.jsonl");
  const std::string tag = "\"tag\":\"forward-peak/a\",\"value\":";
  size_t found = 0;
  for (size_t at = scalars.find(tag); at != std::string::npos; at = scalars.find(tag, at + 1), ++found) {
    const double peak = std::stod(scalars.substr(at + tag.size()));
    CHECK(peak > 0);
    CHECK(peak < 100);  // (the failed attempt's was over 1e3)
  }
  CHECK(found == 4);
}

TEST_CASE("fit, FP16: a forward that overflows in one layer is warned about and named in the patience stop") {
  testing::TempDir dir;
  Net model(1e5);
  tk::Trainer<tk::PrecisionPolicy<tk::FP16Static>> trainer{
      model, tk::SGD{0.01}, tk::TrainerOptions().loss_scale(tk::LossScaleOptions().static_scale(1024))};
  testing::CaptureStderr err;
  const std::string stopped = fit_run(trainer, model, dir.path, true);
  INFO(stopped);
  INFO(err.text.str());
  CHECK(stopped.find("(TRAIN.NONFINITE_PATIENCE 2): stopping") != std::string::npos);
  CHECK(stopped.find("; the forward's output is first not finite in a;") != std::string::npos);
  CHECK(err.text.str().find("optimizer step 4: the forward's output is first not finite in a (every module after it") !=
        std::string::npos);
  CHECK(testing::read_text(dir.path + "/model-scalars.jsonl").find("\"tag\":\"forward-peak/a\",\"value\":\"Infinity\"") !=
        std::string::npos);
}

}  // namespace test_forward_peaks

namespace {

// A user's classifier: 4 residual blocks of fc1 -> relu -> fc2, then a head; one block's fc1
// weight scaled by 1e5, so that its float16 output passes 65504 and everything after it, the
// loss included, is not finite.
struct MlpBlockImpl : torch::nn::Module {
  MlpBlockImpl() {
    fc1 = register_module("fc1", torch::nn::Linear(16, 32));
    fc2 = register_module("fc2", torch::nn::Linear(32, 16));
  }
  torch::Tensor forward(const torch::Tensor& x) { return x + fc2(torch::relu(fc1(x))); }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
};
TORCH_MODULE(MlpBlock);

struct ClassifierImpl : torch::nn::Module {
  explicit ClassifierImpl(std::int64_t broken) {
    torch::manual_seed(12);
    blocks = register_module("blocks", torch::nn::ModuleList());
    for (int i = 0; i < 4; ++i) blocks->push_back(MlpBlock());
    head = register_module("head", torch::nn::Linear(16, 3));
    torch::NoGradGuard no_grad;
    blocks[broken]->as<MlpBlockImpl>()->fc1->weight.mul_(1e5);
  }
  torch::Tensor forward(torch::Tensor x) {
    for (const auto& b : *blocks) x = b->as<MlpBlockImpl>()->forward(x);
    return head(x);
  }
  torch::nn::ModuleList blocks{nullptr};
  torch::nn::Linear head{nullptr};
};
TORCH_MODULE(Classifier);

}  // namespace

TEST_CASE("fit, FP16, no option set: a forward that overflows is blamed on its module, not on the scale or the head") {
  testing::TempDir dir;
  Classifier model(2);
  tk::Trainer<tk::PrecisionPolicy<tk::FP16Static>> trainer{model, tk::SGD{0.01}};  // (the static scale: 128)
  tk::Task<std::int64_t> task;
  task.batches_per_epoch = [](std::int64_t) { return std::int64_t{8}; };
  task.batch = [](std::int64_t epoch, std::int64_t index) { return epoch * 8 + index; };
  task.loss = [&model](const std::int64_t& i, tk::Metrics&) {
    torch::manual_seed(300 + i);
    const auto x = torch::randn({6, 16}) * 2;
    return torch::cross_entropy_loss(model(x).to(torch::kFloat), torch::arange(6) % 3);
  };
  testing::CaptureStderr err;
  std::string stopped;
  try {
    tk::fit(trainer, task, tk::FitOptions().output_path(dir.path).end_epoch(2).log_frequent(4).progress(false)
                               .handle_signals(false).nonfinite_patience(6));
  } catch (const tk::NonFiniteGradient& e) {
    stopped = e.what();
  }
  const std::string said = err.text.str();
  INFO(stopped);
  INFO(said);
  // Window 4: every step skipped and the loss not finite: the forward, not the scale; the
  // forward's peaks go on by themselves, and window 5 (a log window for it) names the module.
  CHECK(said.find("optimizer step 4: 4 of the last 4 optimizer steps were skipped (non-finite gradients; training "
                  "loss nan)") != std::string::npos);
  CHECK(said.find("the training loss itself is not finite, so the forward (or the loss) overflowed before any "
                  "gradient existed: the loss scale is not the cause") != std::string::npos);
  CHECK(said.find("trainkit now records the forward's peaks") != std::string::npos);
  CHECK(said.find("optimizer step 5: the forward's output is first not finite in blocks.2.fc1") != std::string::npos);
  // Window 8: 8 skipped, past the patience of 6: the stop names the module.
  CHECK(stopped.find("epoch 0, micro-batch 7 of 8, optimizer step 8: ") == 0);
  CHECK(stopped.find("(TRAIN.NONFINITE_PATIENCE 6): stopping; the training loss itself is not finite") != std::string::npos);
  CHECK(stopped.find("; the forward's output is first not finite in blocks.2.fc1") != std::string::npos);
  // Neither the scale nor the gradients' ranking (which would start at the head) is blamed.
  for (const std::string& text : {said, stopped}) {
    CHECK(text.find("static loss scale") == std::string::npos);
    CHECK(text.find("first seen at") == std::string::npos);
    CHECK(text.find("head") == std::string::npos);
  }
  CHECK(!trainer.watches_nonfinite());
}
