// Accumulation equals the big batch; item weighting is exact with uneven counts; partial
// windows follow PartialWindow (flush / span / drop).
#include "../support/helpers.hpp"

namespace test_accumulation {  // this file's names, apart from those of the files it shares a unity batch with

using testing::flat;
using testing::make_mlp;
using testing::relative_error;

namespace {

constexpr int kSteps = 5;  // optimizer steps compared
constexpr int kMicro = 8;  // micro-batch rows

using Big = tk::Trainer<>;  // FP32, one micro-batch per step

// K steps of the big batch N·B: the reference every accumulation must reproduce.
torch::Tensor big_batch_reference(int n, const testing::Regression& data) {
  auto model = make_mlp(3);
  Big trainer(model, tk::SGD{0.05, 0.9});
  for (int k = 0; k < kSteps; ++k) {
    auto x = data.x.narrow(0, k * n * kMicro, n * kMicro);
    auto y = data.y.narrow(0, k * n * kMicro, n * kMicro);
    trainer.micro_step([&] { return torch::mse_loss(model(x), y); });
  }
  return flat(*model);
}

template <class Trainer>
torch::Tensor accumulated(int n, const testing::Regression& data) {
  auto model = make_mlp(3);
  Trainer trainer(model, tk::SGD{0.05, 0.9}, tk::TrainerOptions().accumulation_steps(n));
  int closed = 0;
  for (int k = 0; k < kSteps * n; ++k) {
    auto x = data.x.narrow(0, k * kMicro, kMicro), y = data.y.narrow(0, k * kMicro, kMicro);
    closed += trainer.micro_step([&] { return torch::mse_loss(model(x), y); }).window_closed;
  }
  CHECK(closed == kSteps);
  return flat(*model);
}

template <int N>
using Acc = tk::Trainer<tk::PrecisionPolicy<tk::FP32>, tk::AccumulationPolicy<N>>;

}  // namespace

TEST_CASE("N micro-batches of B equal one batch of N*B (fp32, relative <= 1e-5)") {
  const auto data = testing::regression(kSteps * 8 * kMicro);
  const auto before = flat(*make_mlp(3));
  auto check = [&](int n, const torch::Tensor& params) {
    CAPTURE(n);
    const auto reference = big_batch_reference(n, data);
    CHECK(relative_error(params, reference) <= 1e-5);
    // The comparison is not vacuous: training moved the parameters.
    CHECK(relative_error(before, reference) > 1e-2);
  };
  check(1, accumulated<Acc<1>>(1, data));
  check(2, accumulated<Acc<2>>(2, data));
  check(4, accumulated<Acc<4>>(4, data));
  check(8, accumulated<Acc<8>>(8, data));
  check(3, accumulated<Acc<tk::Dynamic>>(3, data));
  check(8, accumulated<Acc<tk::Dynamic>>(8, data));
}

TEST_CASE("uneven item counts: item weighting equals the big batch, 1/N weighting does not") {
  const auto data = testing::regression(64);
  const std::vector<int> sizes = {3, 9, 1, 7};  // 20 rows in one window of 4
  auto reference_model = make_mlp(4);
  {
    Big big(reference_model, tk::SGD{0.1});
    auto x = data.x.narrow(0, 0, 20), y = data.y.narrow(0, 0, 20);
    big.micro_step([&] { return torch::mse_loss(reference_model(x), y); });
  }
  auto run = [&](bool with_items) {
    auto model = make_mlp(4);
    Acc<4> trainer(model, tk::SGD{0.1});
    int offset = 0;
    tk::MicroStepResult r;
    for (int s : sizes) {
      auto x = data.x.narrow(0, offset, s), y = data.y.narrow(0, offset, s);
      auto closure = [&] { return torch::mse_loss(model(x), y); };
      r = with_items ? trainer.micro_step(closure, s) : trainer.micro_step(closure);
      offset += s;
    }
    REQUIRE(r.window_closed);
    if (with_items) CHECK(r.report.items() == 20);
    return flat(*model);
  };
  const auto reference = flat(*reference_model);
  const auto initial = flat(*make_mlp(4));
  const double step_size = relative_error(initial, reference);
  CHECK(relative_error(run(true), reference) <= 1e-6);
  // Plain 1/N weighting over-weights the small micro-batches: a clear difference.
  CHECK(relative_error(run(false), reference) > 1e-2 * step_size);
}

TEST_CASE("partial windows: flush is the mean over the k micro-batches it has") {
  const auto data = testing::regression(64);
  auto reference_model = make_mlp(5);
  {
    Big big(reference_model, tk::SGD{0.1});
    auto x = data.x.narrow(0, 0, 3 * kMicro), y = data.y.narrow(0, 0, 3 * kMicro);
    big.micro_step([&] { return torch::mse_loss(reference_model(x), y); });
  }
  auto model = make_mlp(5);
  Acc<4> trainer(model, tk::SGD{0.1});  // default PartialWindow::flush
  for (int k = 0; k < 3; ++k) {
    auto x = data.x.narrow(0, k * kMicro, kMicro), y = data.y.narrow(0, k * kMicro, kMicro);
    CHECK_FALSE(trainer.micro_step([&] { return torch::mse_loss(model(x), y); }).window_closed);
  }
  auto report = trainer.flush();
  REQUIRE(report.has_value());
  CHECK(report->micro_batches() == 3);
  CHECK(trainer.window_position() == 0);
  CHECK(relative_error(flat(*model), flat(*reference_model)) <= 1e-6);
  CHECK_FALSE(trainer.flush().has_value());  // nothing pending: no step
}

TEST_CASE("partial windows: span carries the window into the next epoch; drop discards it") {
  const auto data = testing::regression(64);
  auto step_on = [&](tk::PartialWindow mode) {
    auto model = make_mlp(6);
    Acc<4> trainer(model, tk::SGD{0.1}, tk::TrainerOptions().partial_window(mode));
    int row = 0;
    auto micro = [&] {
      auto x = data.x.narrow(0, row, kMicro), y = data.y.narrow(0, row, kMicro);
      row += kMicro;
      return trainer.micro_step([&] { return torch::mse_loss(model(x), y); });
    };
    micro();
    micro();                                 // epoch 1 ends after 2 micro-batches
    CHECK_FALSE(trainer.flush().has_value());  // span and drop: no step at the epoch's end
    if (mode == tk::PartialWindow::drop) {
      CHECK(trainer.window_position() == 0);
      CHECK(trainer.gradients().abs().sum().item<double>() == 0.0);
    } else {
      CHECK(trainer.window_position() == 2);
    }
    micro();
    auto r = micro();  // span: this closes the window of 4; drop: only 2 are in it
    CHECK(r.window_closed == (mode == tk::PartialWindow::span));
    return flat(*model);
  };
  // span: the window that crossed the epoch equals the big batch of its 4 micro-batches.
  auto reference_model = make_mlp(6);
  {
    Big big(reference_model, tk::SGD{0.1});
    auto x = data.x.narrow(0, 0, 4 * kMicro), y = data.y.narrow(0, 0, 4 * kMicro);
    big.micro_step([&] { return torch::mse_loss(reference_model(x), y); });
  }
  CHECK(relative_error(step_on(tk::PartialWindow::span), flat(*reference_model)) <= 1e-6);
  // drop: the dropped micro-batches left no trace and no step has happened yet.
  CHECK(torch::equal(step_on(tk::PartialWindow::drop), flat(*make_mlp(6))));
}

TEST_CASE("AccumulationPolicy<Dynamic> changes its window only between windows") {
  auto model = make_mlp(7);
  auto data = testing::regression(32);
  Acc<tk::Dynamic> trainer(model, tk::SGD{0.1}, tk::TrainerOptions().accumulation_steps(2));
  trainer.micro_step([&] { return torch::mse_loss(model(data.x), data.y); });
  CHECK_THROWS_AS(trainer.accumulation_policy().set_window(3), std::logic_error);
  CHECK(trainer.micro_step([&] { return torch::mse_loss(model(data.x), data.y); }).window_closed);
  trainer.accumulation_policy().set_window(3);
  CHECK(trainer.accumulation_policy().window() == 3);
}

TEST_CASE("mixing item counts and none inside one window is an error") {
  auto model = make_mlp(8);
  auto data = testing::regression(32);
  Acc<2> trainer(model, tk::SGD{0.1});
  trainer.micro_step([&] { return torch::mse_loss(model(data.x), data.y); }, 32);
  CHECK_THROWS_WITH_AS(trainer.micro_step([&] { return torch::mse_loss(model(data.x), data.y); }),
                       doctest::Contains("item count"), std::invalid_argument);
}

TEST_CASE("uneven item counts: after the first window, each micro-batch weighs items / (the window's items), as in a GradScaler loop") {
  // Sizes [1, 13, 13, 13]: weighting by the first micro-batch (1 x 4) made every scaled gradient
  // 10x a GradScaler loop's (items / 40), and FP16 skipped 4 windows of 6 where it skipped 1.
  tk::AccumulationPolicy<4> policy{tk::TrainerOptions()};
  const std::int64_t sizes[] = {1, 13, 13, 13};
  for (int window = 0; window < 3; ++window) {
    double weights = 0;
    for (const auto items : sizes) {
      const double w = policy.weight(items);
      if (window > 0) CHECK(w == doctest::Approx(static_cast<double>(items) / 40.0).epsilon(1e-15));
      weights += w;
    }
    CHECK(policy.closes());
    // Whatever the reference, the window's weights times rescale() sum to 1: the exact mean.
    CHECK(weights * policy.rescale() == doctest::Approx(1.0).epsilon(1e-15));
    if (window > 0) CHECK(policy.rescale() == doctest::Approx(1.0).epsilon(1e-15));
    policy.reset();
  }
  // The running mean is part of the state a checkpoint holds.
  const auto state = policy.state();
  CHECK(state.seen_items == 3 * 40);
  CHECK(state.seen_batches == 3 * 4);
  tk::AccumulationPolicy<4> resumed{tk::TrainerOptions()};
  resumed.load_state(state);
  CHECK(resumed.weight(13) == policy.weight(13));
}

}  // namespace test_accumulation
