// Master weights (PrecisionPolicy<MasterWeights<T>>, Apex O2): the model is stored in half
// precision, the trainer updates fp32 masters. Over a set of precision x accumulation x clip
// combinations that covers every value of each: the model trains to FP32's and autocast's
// accuracy; its parameters take half the bytes; pure half weights stall where the masters
// learn; a skipped step changes nothing; resume is exact.
#include "../support/helpers.hpp"

#include <limits>

namespace test_master_weights {  // this file's names, apart from those of the files it shares a unity batch with

using testing::make_mlp;
using testing::TempDir;

namespace {

template <class Mode, int N, class ClipTag>
struct Combo {
  template <class P>
  using trainer_with = tk::Trainer<tk::PrecisionPolicy<P>, tk::AccumulationPolicy<N>, tk::ClipPolicy<ClipTag>>;
  using master = trainer_with<tk::MasterWeights<Mode>>;
  using autocast = trainer_with<Mode>;
  using fp32 = trainer_with<tk::FP32>;
  static constexpr at::ScalarType half = std::is_same_v<Mode, tk::BF16> ? at::kBFloat16 : at::kHalf;
};

// Every precision, every kind of accumulation (1, a fixed N, Dynamic) and every clip at least
// once, without compiling the full 27-type product into one test file.
using FP16Dyn1None = Combo<tk::FP16Dynamic, 1, tk::NoClip>;
using FP16Dyn4Norm = Combo<tk::FP16Dynamic, 4, tk::ClipNorm>;
using FP16DynDValue = Combo<tk::FP16Dynamic, tk::Dynamic, tk::ClipValue>;
using FP16Stat2Value = Combo<tk::FP16Static, 2, tk::ClipValue>;
using BF16DNorm = Combo<tk::BF16, tk::Dynamic, tk::ClipNorm>;
using BF161None = Combo<tk::BF16, 1, tk::NoClip>;
#define MASTER_COMBOS FP16Dyn1None, FP16Dyn4Norm, FP16DynDValue, FP16Stat2Value, BF16DNorm, BF161None

// Dynamic windows run with 3 micro-batches.
tk::TrainerOptions options() {
  return tk::TrainerOptions()
      .accumulation_steps(3)
      .max_grad_norm(1.0)
      .clip_value(1.0)
      .loss_scale(tk::LossScaleOptions().init_scale(1024).growth_interval(50).static_scale(256));
}

template <class Trainer>
double train_classifier() {
  auto model = make_mlp(50, 8, 32, 4);
  const auto train = testing::clusters(2048, 8, 4, 7);
  const auto held_out = testing::clusters(1024, 8, 4, 8);
  Trainer trainer(model, tk::AdamW{5e-3, 1e-4}, options());
  for (int epoch = 0; epoch < 4; ++epoch) {
    for (int i = 0; i < 2048; i += 64) {
      auto x = train.x.narrow(0, i, 64), y = train.y.narrow(0, i, 64);
      // The model receives the fp32 inputs as they are.
      trainer.micro_step([&] { return torch::cross_entropy_loss(model(x), y); });
    }
    trainer.flush();
  }
  // Evaluation outside micro_step runs in the trainer's region too: autocast casts the fp32
  // inputs for the half weights (without it, Linear refuses Float inputs with Half weights).
  [[maybe_unused]] const auto region = trainer.precision_policy().region();
  return testing::accuracy(model, held_out);
}

std::int64_t parameter_bytes(torch::nn::Module& m) {
  std::int64_t bytes = 0;
  for (const auto& p : m.parameters()) bytes += p.numel() * static_cast<std::int64_t>(p.element_size());
  return bytes;
}

std::string dtype_of(const torch::Tensor& t) { return c10::toString(t.scalar_type()); }

// A linear model whose weights sit in [1, 2), where fp16's spacing is 2^-10 (bf16's 2^-7),
// and a teacher 0.05 away: every SGD update (lr 2e-3, about 2e-4 per weight) is below half a
// spacing, so rounding the updated weight to half gives the old weight back.
struct Stall {
  torch::nn::Linear model{nullptr};
  torch::Tensor x, y;
  Stall() {
    torch::manual_seed(3);
    model = torch::nn::Linear(torch::nn::LinearOptions(8, 1).bias(false));
    torch::NoGradGuard no_grad;
    model->weight.uniform_(1.25, 1.75);
    auto gen = at::make_generator<at::CPUGeneratorImpl>(11);
    x = torch::randn({256, 8}, gen);
    const auto teacher = model->weight.detach().clone() + 0.05;
    y = x.matmul(teacher.t());
  }
  double loss() {
    torch::NoGradGuard no_grad;
    return torch::mse_loss(model(x.to(model->weight.scalar_type())).to(torch::kFloat), y).item<double>();
  }
};
constexpr double kStallLr = 2e-3;
constexpr int kStallWindows = 500;

}  // namespace

TEST_CASE_TEMPLATE("master weights train to FP32's and autocast's accuracy (within 2 points)", T,
                   MASTER_COMBOS) {
  const double master = train_classifier<typename T::master>();
  const double autocast = train_classifier<typename T::autocast>();
  const double fp32 = train_classifier<typename T::fp32>();
  MESSAGE(T::master::name() << ": held-out accuracy " << master << " (autocast " << autocast
                            << ", fp32 " << fp32 << ")");
  CHECK(fp32 > 0.9);
  CHECK(std::abs(master - fp32) <= 0.02);
  CHECK(std::abs(master - autocast) <= 0.02);
}

TEST_CASE_TEMPLATE("the model's parameters are stored in half precision: half of FP32's bytes", T,
                   FP16Dyn1None, BF16DNorm) {
  auto model = make_mlp(1, 8, 32, 4);
  const auto fp32_bytes = parameter_bytes(*model);
  typename T::master trainer(model, tk::AdamW{1e-3}, options());
  CHECK(parameter_bytes(*model) * 2 == fp32_bytes);
  for (const auto& p : model->parameters()) {
    CHECK(dtype_of(p) == c10::toString(T::half));
    CHECK(dtype_of(p.grad()) == c10::toString(T::half));
  }
  // The masters: fp32, the same values as the model's initial weights (which were fp32).
  CHECK(dtype_of(trainer.parameters()) == "Float");
  CHECK(trainer.storage().half_parameters().nbytes() * 2 == trainer.parameters().nbytes());
  CHECK(torch::equal(trainer.storage().half_parameters(), trainer.parameters().to(T::half)));
  // After a step the model holds the updated masters, rounded.
  const auto data = testing::clusters(64);
  for (int i = 0; i < (T::master::accumulation_steps == tk::Dynamic ? 3 : T::master::accumulation_steps); ++i)
    trainer.micro_step([&] { return torch::cross_entropy_loss(model(data.x), data.y); });
  CHECK(trainer.applied_steps().template item<std::int64_t>() == 1);
  CHECK(torch::equal(testing::flat(*model), trainer.layout().pack(trainer.parameters()).to(T::half)));
}

TEST_CASE("keep_norm_fp32: normalisation layers stay fp32 views into the masters (default), or go half") {
  struct NetImpl : torch::nn::Module {
    torch::nn::Linear fc1{register_module("fc1", torch::nn::Linear(8, 16))};
    torch::nn::LayerNorm ln{register_module("ln", torch::nn::LayerNorm(torch::nn::LayerNormOptions({16})))};
    torch::nn::BatchNorm1d bn{register_module("bn", torch::nn::BatchNorm1d(16))};
    torch::nn::Linear fc2{register_module("fc2", torch::nn::Linear(16, 4))};
    torch::Tensor forward(const torch::Tensor& x) { return fc2(torch::relu(bn(ln(fc1(x))))); }
  };
  using M = tk::Trainer<tk::PrecisionPolicy<tk::MasterWeights<tk::FP16Dynamic>>>;
  const auto data = testing::clusters(512);
  for (bool keep : {true, false}) {
    CAPTURE(keep);
    torch::manual_seed(5);
    auto net = std::make_shared<NetImpl>();
    M trainer(net, tk::AdamW{1e-2}, tk::TrainerOptions().keep_norm_fp32(keep));
    const std::string norm_dtype = keep ? "Float" : "Half";
    CHECK(dtype_of(net->fc1->weight) == "Half");
    CHECK(dtype_of(net->ln->weight) == norm_dtype);
    CHECK(dtype_of(net->bn->bias) == norm_dtype);
    CHECK(dtype_of(net->bn->running_mean) == norm_dtype);
    CHECK(dtype_of(net->ln->weight.grad()) == norm_dtype);
    double first = 0, last = 0;
    for (int i = 0; i < 60; ++i) {
      auto r = trainer.micro_step([&] {
        return torch::cross_entropy_loss(net->forward(data.x.narrow(0, (i % 8) * 64, 64)),
                                         data.y.narrow(0, (i % 8) * 64, 64));
      });
      (i == 0 ? first : last) = r.report.loss();
    }
    CHECK(last < 0.5 * first);
    CHECK(trainer.storage().kept_gradients().defined() == keep);
    // The kept parameters are the masters themselves; the others their rounded copies.
    CHECK(torch::equal(testing::flat(*net).to(torch::kFloat).to(at::kHalf),
                       trainer.layout().pack(trainer.parameters()).to(at::kHalf)));
  }
}

TEST_CASE_TEMPLATE("pure half weights stall on updates below their precision; fp32 masters learn", T,
                   MASTER_COMBOS) {
  // The reference: a plain loop that updates half weights directly (what "model.half()" plus
  // an optimizer does without masters), SGD on the full batch, no loss scaling needed.
  Stall pure;
  {
    torch::NoGradGuard no_grad;
    pure.model->to(T::half);
  }
  const auto start = pure.model->weight.detach().clone();
  const double pure_initial = pure.loss();
  for (int w = 0; w < kStallWindows; ++w) {
    auto loss = torch::mse_loss(pure.model(pure.x.to(T::half)).to(torch::kFloat), pure.y);
    loss.backward();
    torch::NoGradGuard no_grad;
    pure.model->weight.sub_(pure.model->weight.grad() * kStallLr);  // rounded to half
    pure.model->weight.mutable_grad().zero_();
  }
  CHECK(torch::equal(pure.model->weight, start));  // every update vanished
  CHECK(pure.loss() == doctest::Approx(pure_initial));

  Stall masters;
  const double initial = masters.loss();
  typename T::master trainer(masters.model, tk::SGD{kStallLr}, options());
  const std::int64_t n = T::master::accumulation_steps == tk::Dynamic ? 3 : T::master::accumulation_steps;
  // The full batch split into n micro-batches of uneven size; item counts make the window's
  // gradient the full batch's.
  for (int w = 0; w < kStallWindows; ++w)
    for (std::int64_t i = 0; i < n; ++i) {
      const auto begin = 256 * i / n, end = 256 * (i + 1) / n;
      auto x = masters.x.narrow(0, begin, end - begin), y = masters.y.narrow(0, begin, end - begin);
      trainer.micro_step([&] { return torch::mse_loss(masters.model(x).to(torch::kFloat), y); }, end - begin);
    }
  const double final_loss = masters.loss();
  MESSAGE(T::master::name() << ": loss " << initial << " -> " << final_loss
                            << "; pure half weights: " << pure_initial << " -> " << pure.loss());
  CHECK(trainer.skipped_steps().template item<std::int64_t>() == 0);
  CHECK(final_loss < 0.2 * initial);
}

TEST_CASE_TEMPLATE("a skipped step changes nothing: masters, half parameters, optimizer state", T,
                   MASTER_COMBOS) {
  auto model = make_mlp(20);
  const auto data = testing::regression(32);
  typename T::master trainer(model, tk::AdamW{1e-2, 0.1}, options());
  const int n = T::master::accumulation_steps == tk::Dynamic ? 3 : T::master::accumulation_steps;
  auto window = [&](double factor) {
    tk::StepReport report;
    for (int i = 0; i < n; ++i)
      report = trainer
                   .micro_step([&] { return torch::mse_loss(model(data.x).to(torch::kFloat), data.y) * factor; })
                   .report;
    return report;
  };
  for (int i = 0; i < 3; ++i) CHECK(window(1.0).applied());

  auto& adam = dynamic_cast<tk::detail::FusedAdam<tk::AdamW, true>&>(trainer.update_rule());
  const auto masters = trainer.parameters().clone();
  const auto half = testing::flat(*model);
  const auto m = adam.exp_avg()[0].clone(), v = adam.exp_avg_sq()[0].clone();
  const auto step = adam.step_count().clone();
  for (double bad : {std::numeric_limits<double>::infinity(), std::numeric_limits<double>::quiet_NaN()}) {
    CAPTURE(bad);
    CHECK(window(bad).skipped());
    CHECK(torch::equal(trainer.parameters(), masters));
    CHECK(torch::equal(testing::flat(*model), half));
    CHECK(torch::equal(adam.exp_avg()[0], m));
    CHECK(torch::equal(adam.exp_avg_sq()[0], v));
    CHECK(torch::equal(adam.step_count(), step));
    CHECK_FALSE(trainer.gradients().defined());  // the phase's fp32 gradient is released
    CHECK(trainer.storage().half_gradients().abs().sum().template item<double>() == 0.0);
  }
  CHECK(window(1.0).applied());
  CHECK_FALSE(torch::equal(trainer.parameters(), masters));
}

TEST_CASE_TEMPLATE("checkpoints hold the fp32 masters; resume equals never stopping", T, MASTER_COMBOS) {
  TempDir dir;
  const auto path = dir / "ckpt.pt";
  const auto data = testing::regression(128);
  auto run = [&](typename T::master& trainer, testing::TinyMlp& model, int from, int to) {
    for (int i = from; i < to; ++i) {
      auto x = data.x.narrow(0, (i % 16) * 8, 8), y = data.y.narrow(0, (i % 16) * 8, 8);
      const double factor = i % 14 == 13 ? INFINITY : 1.0;  // an overflow now and then
      trainer.micro_step([&] { return torch::mse_loss(model(x).to(torch::kFloat), y) * factor; });
    }
  };
  auto straight = make_mlp(70);
  typename T::master a(straight, tk::AdamW{1e-2}, options());
  run(a, straight, 0, 48);
  // 24 micro-batches: a window boundary for N = 1, 2, 3, 4; 25: inside a window for N > 1.
  for (int stop : {24, 25}) {
  CAPTURE(stop);
  auto first = make_mlp(70);
  typename T::master b(first, tk::AdamW{1e-2}, options());
  run(b, first, 0, stop);
  b.save(path);
  {
    torch::serialize::InputArchive archive;
    archive.load_from(path);
    torch::Tensor saved;
    archive.read("model.param.fc1.weight", saved, true);
    CHECK(dtype_of(saved) == "Float");
    CHECK(torch::equal(saved.reshape({-1}), b.parameters().narrow(0, 0, saved.numel())));
  }

  auto resumed = make_mlp(99);  // other weights: all must come back from the checkpoint
  typename T::master c(resumed, tk::AdamW{1e-2}, options());
  c.load(path);
  CHECK(torch::equal(c.parameters(), b.parameters()));
  CHECK(torch::equal(testing::flat(*resumed), testing::flat(*first)));
  CHECK(dtype_of(resumed->fc1->weight) == c10::toString(T::half));
  run(c, resumed, stop, 48);
  CHECK(torch::equal(c.parameters(), a.parameters()));
  CHECK(torch::equal(testing::flat(*resumed), testing::flat(*straight)));
  CHECK(torch::equal(c.loss_scale(), a.loss_scale()));
  CHECK(torch::equal(c.skipped_steps(), a.skipped_steps()));
  CHECK(c.skipped_steps().template item<std::int64_t>() > 0);
  }
}

TEST_CASE("the trainer's name says MasterWeights, and the policy is a precision policy") {
  using M = tk::Trainer<tk::PrecisionPolicy<tk::MasterWeights<tk::FP16Dynamic>>, tk::AccumulationPolicy<4>,
                        tk::ClipPolicy<tk::ClipNorm>>;
  CHECK(M::name() == "Trainer<MasterWeights<FP16Dynamic>, Accumulate<4>, ClipNorm>");
  static_assert(M::precision::master_weights && M::scales_loss);
  static_assert(tk::is_precision_policy<tk::PrecisionPolicy<tk::MasterWeights<tk::BF16>>>::value);
  static_assert(!tk::PrecisionPolicy<tk::MasterWeights<tk::BF16>>::scales_loss);
  static_assert(!tk::PrecisionPolicy<tk::FP16Dynamic>::master_weights);
}

TEST_CASE_TEMPLATE("master weights sum a window's micro-batch gradients in fp32, not in half precision (N = 16)", Mode,
                   tk::BF16, tk::FP16Static) {
  constexpr int N = 16;
  constexpr double scale = std::is_same_v<Mode, tk::BF16> ? 1.0 : 256.0;
  using M = tk::Trainer<tk::PrecisionPolicy<tk::MasterWeights<Mode>>, tk::AccumulationPolicy<N>>;
  auto model = make_mlp(60, 8, 32, 4);  // Linear layers only: every parameter is half
  const auto data = testing::clusters(N * 16, 8, 4, 9);
  // SGD with LR 1: the masters move by the window's (unscaled) gradient.
  M trainer(model, tk::SGD{1.0}, tk::TrainerOptions().loss_scale(tk::LossScaleOptions().static_scale(scale)));
  const auto before = trainer.parameters().clone();
  std::vector<torch::Tensor> params = model->parameters();
  torch::Tensor fp32_sum, half_sum;  // the references: each micro-batch's half gradient, summed both ways
  for (int i = 0; i < N; ++i) {
    auto x = data.x.narrow(0, 16 * i, 16), y = data.y.narrow(0, 16 * i, 16);
    auto loss_of = [&] { return torch::cross_entropy_loss(model(x), y); };
    torch::Tensor loss;
    {
      [[maybe_unused]] const auto region = trainer.precision_policy().region();
      loss = loss_of();
    }
    const auto objective = loss.reshape({}).to(torch::kFloat) * (1.0 / N) * scale;
    std::vector<torch::Tensor> flat;
    for (const auto& g : torch::autograd::grad({objective}, params)) flat.push_back(g.reshape({-1}));
    const auto g = torch::cat(flat);  // half, in the masters' order (one group)
    fp32_sum = i == 0 ? g.to(torch::kFloat) : fp32_sum + g.to(torch::kFloat);
    half_sum = i == 0 ? g.clone() : half_sum + g;
    const auto r = trainer.micro_step(loss_of);
    CHECK(r.window_closed == (i == N - 1));
  }
  const auto moved = trainer.layout().pack(before - trainer.parameters()) * scale;
  const double fp32_error = testing::relative_error(moved, fp32_sum);
  const double half_error = testing::relative_error(half_sum.to(torch::kFloat), fp32_sum);
  INFO("update vs fp32 sum: " << fp32_error << "; half sum vs fp32 sum: " << half_error);
  CHECK(fp32_error < 1e-5);
  CHECK(half_error > 20 * fp32_error);  // what summing in half would have cost: the check can tell
}

// The chunked optimizer phase (one process, one micro-batch per window, a model over
// TrainerOptions::master_chunk): the fp32 gradient is cast chunk by chunk, so chunk bounds
// fall inside parameters, groups (LR multipliers, no-decay) and the kept fp32 LayerNorm. It
// must update exactly as the whole-gradient phase: bit for bit where the norm only decides
// skips, to rounding (the norm is a norm of chunk norms) where ClipNorm scales by it.
template <class Mode, class ClipTag>
struct ChunkCase {
  using trainer = tk::Trainer<tk::PrecisionPolicy<tk::MasterWeights<Mode>>, tk::AccumulationPolicy<1>,
                              tk::ClipPolicy<ClipTag>>;
  static constexpr bool exact = !std::is_same_v<ClipTag, tk::ClipNorm>;
};
#define CHUNK_CASES ChunkCase<tk::FP16Dynamic, tk::NoClip>, ChunkCase<tk::BF16, tk::ClipNorm>, \
                    ChunkCase<tk::FP16Static, tk::ClipValue>

TEST_CASE_TEMPLATE("the chunked master-weight phase updates as the whole one (AdamW, SGD; groups, kept fp32)", T,
                   CHUNK_CASES) {
  struct NetImpl : torch::nn::Module {
    torch::nn::Linear fc1{register_module("fc1", torch::nn::Linear(8, 24))};
    torch::nn::LayerNorm ln{register_module("ln", torch::nn::LayerNorm(torch::nn::LayerNormOptions({24})))};
    torch::nn::Linear fc2{register_module("fc2", torch::nn::Linear(24, 3))};
    torch::Tensor forward(const torch::Tensor& x) { return fc2(torch::relu(ln(fc1(x)))); }
  };
  const auto data = testing::clusters(256, 8, 3, 3);
  struct Run {
    torch::Tensor masters, half, state;
    std::vector<double> norms;
    std::vector<bool> applied;
    std::int64_t chunks = 0;
  };
  auto run = [&](bool adam, std::int64_t chunk) {
    torch::manual_seed(11);
    auto net = std::make_shared<NetImpl>();
    auto options = tk::TrainerOptions()
                       .master_chunk(chunk)
                       .lr_mult({{"fc2", 2.0}})
                       .no_decay({"bias"})
                       .clip_value(0.05)
                       .max_grad_norm(0.5)
                       .loss_scale(tk::LossScaleOptions().init_scale(1024).static_scale(256));
    auto make = [&] {
      return adam ? std::make_unique<typename T::trainer>(net, tk::AdamW{1e-2, 0.1}, options)
                  : std::make_unique<typename T::trainer>(net, tk::SGD{0.1, 0.9, 0.01}, options);
    };
    auto trainer = make();
    Run out;
    for (int i = 0; i < 8; ++i) {
      const double factor = i == 3 ? std::numeric_limits<double>::infinity() : 1.0;  // one skipped window
      const auto r = trainer->micro_step([&] {
        return torch::cross_entropy_loss(net->forward(data.x.narrow(0, i * 32, 32)), data.y.narrow(0, i * 32, 32)) *
               factor;
      });
      REQUIRE(r.window_closed);
      out.norms.push_back(r.report.grad_norm());
      out.applied.push_back(r.report.applied());
      out.chunks = std::max(out.chunks, trainer->storage().phase_chunks());
    }
    out.masters = trainer->parameters().clone();
    out.half = testing::flat(*net).to(torch::kFloat);
    auto& rule = trainer->update_rule();
    out.state = torch::cat(adam ? dynamic_cast<tk::detail::FusedAdam<tk::AdamW, true>&>(rule).exp_avg_sq()
                                : dynamic_cast<tk::detail::FusedSGD&>(rule).momentum_buffers());
    return out;
  };
  for (bool adam : {true, false}) {
    CAPTURE(adam);
    const auto whole = run(adam, std::int64_t{1} << 24);
    const auto chunked = run(adam, 40);  // rounded up to 64 elements: 7 chunks of the 416
    CHECK(whole.chunks == 0);
    CHECK(chunked.chunks >= 6);
    CHECK(chunked.applied == whole.applied);
    CHECK(whole.applied == std::vector<bool>{true, true, true, false, true, true, true, true});
    for (size_t i = 0; i < whole.norms.size(); ++i)
      if (std::isfinite(whole.norms[i])) CHECK(chunked.norms[i] == doctest::Approx(whole.norms[i]).epsilon(1e-6));
    if (T::exact) {
      CHECK(torch::equal(chunked.masters, whole.masters));
      CHECK(torch::equal(chunked.half, whole.half));
      CHECK(torch::equal(chunked.state, whole.state));
    } else {
      CHECK(torch::allclose(chunked.masters, whole.masters, 1e-5, 1e-7));
      CHECK(torch::allclose(chunked.state, whole.state, 1e-4, 1e-9));
    }
  }
}

TEST_CASE("master_chunk: below 1 is refused, naming the option") {
  CHECK_THROWS_WITH(tk::TrainerOptions().master_chunk(0).validate(),
                    doctest::Contains("master_chunk must be >= 1"));
}

TEST_CASE("reduce_precision half without master weights is refused, naming the option") {
  auto model = make_mlp(1);
  CHECK_THROWS_WITH_AS(
      tk::Trainer<>(model, tk::AdamW{1e-3}, tk::TrainerOptions().reduce_precision(tk::ReducePrecision::half)),
      doctest::Contains("reduce_precision half needs master weights"), std::invalid_argument);
}

}  // namespace test_master_weights
