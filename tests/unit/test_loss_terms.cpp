// A loss of several terms, each a sum over its own items with its own count
// (Trainer::begin_window): the window's gradient equals the big batch's, however the batch is
// split into micro-batches or pieces, and however uneven the counts (a term with no item in a
// micro-batch included); the old weighting, per-micro-batch means weighted by samples, does not.
#include "../support/helpers.hpp"

namespace test_loss_terms {  // this file's names, apart from those of the files it shares a unity batch with

using testing::flat;
using testing::make_mlp;
using testing::relative_error;

namespace {

// Rows of a regression set with two terms: term A over every row, each row weighing
// 1 + row % 3 "tokens"; term B over the rows with row % 4 == 0 only (often none in a micro-batch).
struct Rows {
  torch::Tensor x, y, tokens, labelled;  // tokens: A's items per row; labelled: B's (0 or 1)
  std::int64_t begin = 0, size = 0;
  std::vector<std::int64_t> items() const {
    return {tokens.sum().item<std::int64_t>(), labelled.sum().item<std::int64_t>()};
  }
};
Rows rows(const testing::Regression& data, std::int64_t begin, std::int64_t size) {
  const auto index = torch::arange(begin, begin + size);
  return {data.x.narrow(0, begin, size), data.y.narrow(0, begin, size), (index % 3 + 1).to(torch::kFloat),
          (index % 4 == 0).to(torch::kFloat), begin, size};
}

// The terms' sums over a batch: A = sum of tokens x squared error of output 0, B = sum over the
// labelled rows of the squared error of outputs 1-2.
torch::Tensor sums(testing::TinyMlp& model, const Rows& r) {
  const auto err = (model(r.x) - r.y).square();
  return torch::stack({(err.select(1, 0) * r.tokens).sum(), (err.narrow(1, 1, 2).sum(1) * r.labelled).sum()});
}

// The objective of one batch holding the window: each term's mean over its items.
torch::Tensor big_loss(testing::TinyMlp& model, const Rows& r) {
  const auto s = sums(model, r);
  return s[0] / r.tokens.sum() + s[1] / r.labelled.sum().clamp_min(1);
}

const std::vector<std::vector<std::int64_t>> kWindows = {{3, 9, 1, 7}, {5, 2, 6, 4}, {1, 1, 12, 2}, {8, 3, 3, 3}};

torch::Tensor reference(const testing::Regression& data) {
  auto model = make_mlp(4);
  tk::Trainer<> big(model, tk::SGD{0.1, 0.9});
  std::int64_t at = 0;
  for (const auto& window : kWindows) {
    std::int64_t n = 0;
    for (auto s : window) n += s;
    const auto r = rows(data, at, n);
    big.micro_step([&] { return big_loss(model, r); });
    at += n;
  }
  return flat(*model);
}

using Acc4 = tk::Trainer<tk::PrecisionPolicy<tk::FP32>, tk::AccumulationPolicy<4>>;

}  // namespace

TEST_CASE("loss terms: 4 micro-batches of uneven sizes and counts equal the big batch; samples-weighted means do not") {
  const auto data = testing::regression(128);
  const auto big = reference(data);
  const double step = relative_error(flat(*make_mlp(4)), big);
  REQUIRE(step > 1e-2);  // training moved the parameters: the comparisons below compare something

  auto model = make_mlp(4);
  Acc4 trainer(model, tk::SGD{0.1, 0.9});
  std::int64_t at = 0;
  for (const auto& window : kWindows) {
    std::vector<Rows> micro;
    std::vector<std::int64_t> items{0, 0};
    for (auto s : window) {
      micro.push_back(rows(data, at, s));
      at += s;
      items[0] += micro.back().items()[0], items[1] += micro.back().items()[1];
    }
    trainer.begin_window(items);
    tk::MicroStepResult r;
    for (const auto& m : micro) r = trainer.micro_step([&] { return sums(model, m); });
    REQUIRE(r.window_closed);
  }
  CHECK(relative_error(flat(*model), big) <= 1e-6);

  // What the main job did before: each micro-batch's terms as means over its own items,
  // weighted by its samples. A different model.
  auto old = make_mlp(4);
  Acc4 old_trainer(old, tk::SGD{0.1, 0.9});
  at = 0;
  for (const auto& window : kWindows)
    for (auto s : window) {
      const auto m = rows(data, at, s);
      at += s;
      old_trainer.micro_step(
          [&] {
            const auto t = sums(old, m);
            return t[0] / m.tokens.sum() + t[1] / m.labelled.sum().clamp_min(1);
          },
          s);
    }
  CHECK(relative_error(flat(*old), big) > 1e-2 * step);
}

TEST_CASE("loss terms: the report's loss is the window's, each term the mean over its items") {
  const auto data = testing::regression(64);
  auto model = make_mlp(5);
  auto probe = make_mlp(5);
  Acc4 trainer(model, tk::SGD{0.1});  // (the forwards ran at the initial weights, probe's)
  std::vector<Rows> micro{rows(data, 0, 3), rows(data, 3, 9), rows(data, 12, 1), rows(data, 13, 7)};
  trainer.begin_window({micro[0].items()[0] + micro[1].items()[0] + micro[2].items()[0] + micro[3].items()[0],
                        micro[0].items()[1] + micro[1].items()[1] + micro[2].items()[1] + micro[3].items()[1]});
  tk::MicroStepResult r;
  for (const auto& m : micro) r = trainer.micro_step([&] { return sums(model, m); });
  REQUIRE(r.window_closed);
  torch::NoGradGuard no_grad;
  const double expected = big_loss(probe, rows(data, 0, 20)).item<double>();
  CHECK(r.report.loss() == doctest::Approx(expected).epsilon(1e-6));
}

TEST_CASE("loss terms: a micro-batch run as pieces, and a partial window flushed, equal the big batch") {
  const auto data = testing::regression(64);
  // One window: micro-batches of 6 (as pieces of 2, 1, 3) and 5 rows, then a partial window of 7 rows.
  auto ref = make_mlp(6);
  {
    tk::Trainer<> big(ref, tk::SGD{0.1});
    const auto first = rows(data, 0, 11), second = rows(data, 11, 7);
    big.micro_step([&] { return big_loss(ref, first); });
    big.micro_step([&] { return big_loss(ref, second); });
  }
  auto model = make_mlp(6);
  tk::Trainer<tk::PrecisionPolicy<tk::FP32>, tk::AccumulationPolicy<2>> trainer(model, tk::SGD{0.1});
  const auto a = rows(data, 0, 6), b = rows(data, 6, 5);
  trainer.begin_window({a.items()[0] + b.items()[0], a.items()[1] + b.items()[1]});
  const std::vector<Rows> pieces{rows(data, 0, 2), rows(data, 2, 1), rows(data, 3, 3)};
  CHECK_FALSE(trainer.micro_step_pieces([&](std::int64_t j) { return sums(model, pieces[static_cast<size_t>(j)]); },
                                        {2, 1, 3})
                  .window_closed);
  CHECK(trainer.micro_step([&] { return sums(model, b); }).window_closed);
  const auto c = rows(data, 11, 7);
  trainer.begin_window(c.items());
  CHECK_FALSE(trainer.micro_step([&] { return sums(model, c); }).window_closed);
  REQUIRE(trainer.flush().has_value());  // PartialWindow::flush: the window of one micro-batch
  CHECK(relative_error(flat(*model), flat(*ref)) <= 1e-6);
}

TEST_CASE("loss terms: a checkpoint inside a window (span) resumes to the uninterrupted run's parameters") {
  testing::TempDir dir;
  const auto data = testing::regression(64);
  const auto options = tk::TrainerOptions().partial_window(tk::PartialWindow::span);
  using Trainer = tk::Trainer<tk::PrecisionPolicy<tk::FP32>, tk::AccumulationPolicy<3>>;
  const std::vector<Rows> micro{rows(data, 0, 4), rows(data, 4, 5), rows(data, 9, 2)};
  std::vector<std::int64_t> items{0, 0};
  for (const auto& m : micro) items[0] += m.items()[0], items[1] += m.items()[1];

  auto straight = make_mlp(7);
  {
    Trainer t(straight, tk::AdamW{0.01}, options);
    t.begin_window(items);
    for (const auto& m : micro) t.micro_step([&] { return sums(straight, m); });
    CHECK(t.windows() == 1);
  }
  auto resumed = make_mlp(7);
  {
    Trainer t(resumed, tk::AdamW{0.01}, options);
    t.begin_window(items);
    t.micro_step([&] { return sums(resumed, micro[0]); });
    t.save(dir / "inside.ckpt");
  }
  auto fresh = make_mlp(99);
  Trainer t(fresh, tk::AdamW{0.01}, options);
  t.load(dir / "inside.ckpt");
  CHECK(t.window_position() == 1);
  t.micro_step([&] { return sums(fresh, micro[1]); });
  CHECK(t.micro_step([&] { return sums(fresh, micro[2]); }).window_closed);
  CHECK(relative_error(flat(*fresh), flat(*straight)) <= 1e-7);
}

TEST_CASE("loss terms: misuse is refused, saying what to do") {
  const auto data = testing::regression(16);
  auto model = make_mlp(8);
  Acc4 trainer(model, tk::SGD{0.1});
  const auto r = rows(data, 0, 4);
  CHECK_THROWS_WITH_AS(trainer.begin_window({}), doctest::Contains("no loss terms"), c10::Error);
  CHECK_THROWS_WITH_AS(trainer.begin_window({3, -1}), doctest::Contains("counts must be >= 0"), c10::Error);
  trainer.begin_window(r.items());
  // A scalar where two terms are expected.
  CHECK_THROWS_WITH_AS(trainer.micro_step([&] { return sums(model, r).sum(); }), doctest::Contains("2 terms"),
                       std::invalid_argument);
  CHECK_THROWS_WITH_AS(trainer.micro_step([&] { return sums(model, r); }, 4), doctest::Contains("begin_window"), c10::Error);
  trainer.micro_step([&] { return sums(model, r); });
  CHECK_THROWS_WITH_AS(trainer.begin_window(r.items()), doctest::Contains("a window is open"), c10::Error);
  // A window without begin_window takes a scalar again once this one has closed.
  for (int i = 0; i < 3; ++i) trainer.micro_step([&] { return sums(model, r); });
  CHECK(trainer.windows() == 1);
  CHECK(trainer.micro_step([&] { return big_loss(model, r); }, 4).window_closed == false);
}

TEST_CASE("loss terms: a window runs only the micro-batches it counted; one with no item anywhere is skipped") {
  const auto data = testing::regression(32);
  auto model = make_mlp(9);
  Acc4 trainer(model, tk::SGD{0.1});
  const auto r = rows(data, 0, 4);
  // Counts of 2 micro-batches (a partial window): a third would add items nobody counted.
  trainer.begin_window({2 * r.items()[0], 2 * r.items()[1]}, 2);
  trainer.micro_step([&] { return sums(model, r); });
  trainer.micro_step([&] { return sums(model, r); });
  CHECK_THROWS_WITH_AS(trainer.micro_step([&] { return sums(model, r); }), doctest::Contains("not in the counts"),
                       c10::Error);
  REQUIRE(trainer.flush().has_value());

  // No item of any term on any rank: the step is skipped (as a single count of 0 skips it), the
  // parameters unchanged.
  auto other = make_mlp(10);
  tk::Trainer<tk::PrecisionPolicy<tk::FP32>, tk::AccumulationPolicy<1>> skipping(
      other, tk::SGD{0.1}, tk::TrainerOptions().nonfinite(tk::NonFinite::skip));
  const auto before = flat(*other);
  skipping.begin_window({0, 0});
  const auto step = skipping.micro_step([&] { return sums(other, r) * 0; });
  REQUIRE(step.window_closed);
  CHECK(step.report.skipped());
  CHECK(torch::equal(flat(*other), before));
}

namespace {

// tk::fit over 8 micro-batches of uneven sizes in windows of 4, the loss as the two terms;
// `oom_at`: the micro-batch whose first forward runs out of memory (-1: none).
struct TermsFit {
  testing::TempDir dir;
  testing::Regression data = testing::regression(128);
  testing::TinyMlp model = make_mlp(11);
  tk::Task<Rows> task;
  std::int64_t oom_at;
  bool thrown = false;
  explicit TermsFit(std::int64_t oom = -1) : oom_at(oom) {
    task.batches_per_epoch = [](std::int64_t) { return std::int64_t{8}; };
    task.batch = [this](std::int64_t, std::int64_t i) { return rows(data, 12 * i, 4 + 2 * (i % 4)); };
    task.terms = {"A", "B"};
    task.term_items = [](const Rows& r) { return r.items(); };
    task.items = [](const Rows& r) { return r.size; };
    task.split = [this](const Rows& r, std::int64_t parts) {
      std::vector<Rows> pieces;
      for (std::int64_t k = 0, at = r.begin; k < parts; ++k) {
        const std::int64_t n = r.size / parts + (k < r.size % parts ? 1 : 0);
        pieces.push_back(rows(data, at, n));
        at += n;
      }
      return pieces;
    };
    task.loss = [this](const Rows& r, tk::Metrics&) {
      if (r.begin == 12 * oom_at && r.size == 4 + 2 * (oom_at % 4) && !thrown) {  // the whole micro-batch, once
        thrown = true;
        TORCH_CHECK_WITH(OutOfMemoryError, false, "out of memory (injected)");
      }
      return sums(model, r);
    };
  }
  template <class Trainer>
  tk::FitResult run(Trainer& trainer) {
    return tk::fit(trainer, task, tk::FitOptions().output_path(dir.path).end_epoch(1).log_frequent(1).progress(false)
                                      .handle_signals(false).write_files(false));
  }
};

}  // namespace

TEST_CASE("loss terms in tk::fit: an out-of-memory replay in pieces ends where the straight run does") {
  TermsFit straight, replayed(/*oom=*/1);
  Acc4 a(straight.model, tk::SGD{0.1, 0.9}), b(replayed.model, tk::SGD{0.1, 0.9});
  const auto before = flat(*straight.model);
  const auto r = straight.run(a);
  const auto s = replayed.run(b);
  CHECK(r.replays == 0);
  REQUIRE(s.replays == 1);  // the window replayed from its first micro-batch, its counts kept
  CHECK(s.piece_items > 0);
  CHECK(relative_error(before, flat(*straight.model)) > 1e-2);
  CHECK(relative_error(flat(*replayed.model), flat(*straight.model)) <= 1e-6);
  CHECK(s.train.at("A") == doctest::Approx(r.train.at("A")).epsilon(1e-6));  // the logged means too
  CHECK(s.train.at("Loss") == doctest::Approx(r.train.at("A") + r.train.at("B")).epsilon(1e-6));
}

TEST_CASE("loss terms with master weights: N micro-batches equal one holding the window, in the same precision") {
  // MasterWeights<FP16Dynamic>: the half model's rounding differs with the micro-batch's rows, so
  // the comparison is against the same precision's one micro-batch, to fp16's resolution.
  using Master = tk::PrecisionPolicy<tk::MasterWeights<tk::FP16Dynamic>>;
  const auto data = testing::regression(128);
  auto whole_model = make_mlp(12), split_model = make_mlp(12);
  tk::Trainer<Master> whole(whole_model, tk::SGD{0.1});
  tk::Trainer<Master, tk::AccumulationPolicy<4>> split(split_model, tk::SGD{0.1});
  const auto before = flat(*whole_model);
  std::int64_t at = 0;
  for (const auto& window : kWindows) {
    std::int64_t n = 0;
    for (auto size : window) n += size;
    const auto all = rows(data, at, n);
    whole.begin_window(all.items());
    CHECK(whole.micro_step([&] { return sums(whole_model, all); }).window_closed);
    split.begin_window(all.items());
    for (auto size : window) {
      const auto r = rows(data, at, size);
      split.micro_step([&] { return sums(split_model, r); });
      at += size;
    }
  }
  CHECK(split.windows() == 4);
  CHECK(relative_error(before, flat(*whole_model)) > 1e-2);
  // The old weighting (each micro-batch's own means, weighted by samples) in the same precision:
  // a distance the check tells apart from fp16's.
  auto old_model = make_mlp(12);
  tk::Trainer<Master, tk::AccumulationPolicy<4>> old(old_model, tk::SGD{0.1});
  at = 0;
  for (const auto& window : kWindows)
    for (auto size : window) {
      const auto r = rows(data, at, size);
      old.micro_step([&] { const auto t = sums(old_model, r); return t[0] / r.tokens.sum() + t[1] / r.labelled.sum().clamp_min(1); },
                     size);
      at += size;
    }
  const double right = relative_error(flat(*split_model), flat(*whole_model));
  const double wrong = relative_error(flat(*old_model), flat(*whole_model));
  MESSAGE("master weights, against one micro-batch: terms " << right << ", per-micro-batch means " << wrong);
  CHECK(right <= 1e-3);
  CHECK(wrong > 5 * right);
}

}  // namespace test_loss_terms
