// Memory: micro-batches run as pieces (Trainer::micro_step_pieces) equal whole ones; a dropped
// window leaves nothing behind; an out-of-memory error inside a window is replayed at half the
// piece size and ends where an uninterrupted run ends; TRAIN.MEMORY_BUDGET measures and plans
// (plan_pieces's arithmetic, the config keys, a plan on this machine's real peak memory).
#include "../support/helpers.hpp"

#include <trainkit/fit/fit.hpp>
#include <trainkit/fit/memory.hpp>
#include <trainkit/run/plan.hpp>

#include <algorithm>
#include <fstream>
#include <new>
#include <set>

#include <sys/resource.h>

namespace test_memory {  // this file's names, apart from those of the files it shares a unity batch with

using testing::TempDir;

namespace {

constexpr double kMiB = 1024.0 * 1024.0;

// --- plan_pieces: the arithmetic ---------------------------------------------------------------

TEST_CASE("plan_pieces: the largest piece under the budget less its margin, from a fitted line") {
  // peak = 100 MiB + 10 MiB per item; budget 400 MiB, 360 usable: (360 - 100) / 10 = 26 items.
  std::vector<std::pair<std::int64_t, double>> measured;
  for (const std::int64_t m : {64, 1, 8, 16, 32}) measured.emplace_back(m, (100 + 10 * m) * kMiB);
  const tk::MemoryPlan plan = tk::plan_pieces(64, measured, 400 * kMiB);
  CHECK(plan.piece_items == 26);
  CHECK(plan.base_bytes == doctest::Approx(100 * kMiB));
  CHECK(plan.bytes_per_item == doctest::Approx(10 * kMiB));
  CHECK(plan.measured.front().first == 1);  // sorted
  CHECK(plan.pieces_for(64) == 3);
  CHECK(plan.pieces_for(26) == 1);
  CHECK(plan.text().find("budget 400 MiB") != std::string::npos);
  CHECK(plan.text().find("3 piece(s) of at most 26 items") != std::string::npos);

  // A budget above the whole micro-batch's need: no split.
  CHECK(tk::plan_pieces(64, measured, 4000 * kMiB).piece_items == 64);
  // A measured point over the budget caps the plan below it, whatever the line says.
  auto noisy = measured;
  noisy[3].second = 390 * kMiB;  // 16 items measured over the 360 usable
  CHECK(tk::plan_pieces(64, noisy, 400 * kMiB).piece_items <= 15);
  // One point: the line through the origin, conservative.
  CHECK(tk::plan_pieces(64, {{8, 80 * kMiB}}, 100 * kMiB).piece_items == 9);  // 90 / 10
}

TEST_CASE("plan_pieces: a budget that cannot hold one item names the budget and the need") {
  const std::vector<std::pair<std::int64_t, double>> measured{{1, 300 * kMiB}, {4, 330 * kMiB}};
  CHECK_THROWS_WITH_AS(tk::plan_pieces(8, measured, 200 * kMiB),
                       doctest::Contains("TRAIN.MEMORY_BUDGET: the budget of 200 MiB (180 MiB after the 10% margin) "
                                         "cannot hold the forward+backward of one item: it measured 300 MiB"),
                       tk::ConfigError);
}

TEST_CASE("is_out_of_memory: CUDA's OutOfMemoryError, the CPU allocator's error, bad_alloc; nothing else") {
  bool cuda = false, cpu = false, other = false;
  try {
    TORCH_CHECK_WITH(OutOfMemoryError, false, "CUDA out of memory. Tried to allocate 2.00 GiB");
  } catch (const std::exception& e) {
    cuda = tk::detail::is_out_of_memory(e);
  }
  try {
    TORCH_CHECK(false, "DefaultCPUAllocator: can't allocate memory: you tried to allocate 1 bytes");
  } catch (const std::exception& e) {
    cpu = tk::detail::is_out_of_memory(e);
  }
  try {
    TORCH_CHECK(false, "shape mismatch");
  } catch (const std::exception& e) {
    other = tk::detail::is_out_of_memory(e);
  }
  CHECK(cuda);
  CHECK(cpu);
  CHECK(!other);
  CHECK(tk::detail::is_out_of_memory(std::bad_alloc()));
}

// --- configuration ---------------------------------------------------------------------------

tk::Config config_of(const std::string& json) {
  tk::Config c;
  c.load_string(json, tk::Config::Format::json, {}, "test.json");
  return c;
}

TEST_CASE("TRAIN.MEMORY_BUDGET: a fraction, bytes or a size with a unit; TARGET_BATCH sets the per-device batch") {
  CHECK(tk::RunPlan::from(config_of(R"({"RNG_SEED": 1})"), 1).fit.memory_budget() == 0);
  CHECK(tk::RunPlan::from(config_of(R"({"RNG_SEED": 1, "TRAIN": {"MEMORY_BUDGET": 0.8}})"), 1).fit.memory_budget() == 0.8);
  CHECK(tk::RunPlan::from(config_of(R"({"RNG_SEED": 1, "TRAIN": {"MEMORY_BUDGET": "80%"}})"), 1).fit.memory_budget() ==
        doctest::Approx(0.8));
  CHECK(tk::RunPlan::from(config_of(R"({"RNG_SEED": 1, "TRAIN": {"MEMORY_BUDGET": "800MiB"}})"), 1).fit.memory_budget() == 800 * kMiB);
  CHECK(tk::RunPlan::from(config_of(R"({"RNG_SEED": 1, "TRAIN": {"MEMORY_BUDGET": "12 GB"}})"), 1).fit.memory_budget() == 12e9);
  CHECK_THROWS_WITH_AS(config_of(R"({"TRAIN": {"MEMORY_BUDGET": "lots"}})"), doctest::Contains("TRAIN.MEMORY_BUDGET"),
                       tk::ConfigError);
  CHECK_THROWS_WITH_AS(config_of(R"({"TRAIN": {"MEMORY_BUDGET": -1}})"), doctest::Contains("TRAIN.MEMORY_BUDGET"),
                       tk::ConfigError);
  CHECK(tk::memory_budget_bytes(0.5, torch::kCPU) == doctest::Approx(tk::device_memory_bytes(torch::kCPU) / 2));
  CHECK(tk::memory_budget_bytes(3e9, torch::kCPU) == 3e9);

  const tk::Config target = config_of(R"({"TRAIN": {"TARGET_BATCH": 64, "GRAD_ACCUMULATE_STEPS": 4, "BATCH_IMAGES": 3}})");
  CHECK(tk::RunPlan::from(target, 2).batch_images == 8);  // 64 / (2 ranks x 4)
  CHECK(tk::RunPlan::from(target, 2).total_batch == 64);
  const auto& notes = target.notes();
  CHECK(std::find(notes.begin(), notes.end(), "TRAIN.BATCH_IMAGES is not used: TRAIN.TARGET_BATCH sets the per-device batch") !=
        notes.end());
  CHECK_THROWS_WITH_AS(tk::RunPlan::from(config_of(R"({"TRAIN": {"TARGET_BATCH": 30, "GRAD_ACCUMULATE_STEPS": 4}})"), 1),
                       doctest::Contains("TRAIN.TARGET_BATCH: the effective batch 30 is not a multiple of world size 1 x "
                                         "GRAD_ACCUMULATE_STEPS 4"),
                       tk::ConfigError);
  // The budget may change on resume; the target batch changes the trajectory.
  CHECK(tk::changes_freely("TRAIN.MEMORY_BUDGET"));
  CHECK(!tk::changes_freely("TRAIN.TARGET_BATCH"));
}

// --- the trainer: pieces and dropped windows -------------------------------------------------

struct Rows {
  torch::Tensor x, y;
  std::int64_t size() const { return x.size(0); }
};
Rows rows_of(const testing::Regression& d, std::int64_t begin, std::int64_t n) {
  return {d.x.narrow(0, begin, n), d.y.narrow(0, begin, n)};
}
// Task::split for Rows: `parts` runs of consecutive rows.
std::vector<Rows> split_rows(const Rows& b, std::int64_t parts) {
  std::vector<Rows> out;
  const auto xs = b.x.tensor_split(parts), ys = b.y.tensor_split(parts);
  for (size_t k = 0; k < xs.size(); ++k) out.push_back({xs[k], ys[k]});
  return out;
}

template <class T>
struct PieceCase {
  static constexpr double tolerance = std::is_same_v<typename T::precision_mode, tk::FP32> ? 1e-6 : 2e-2;
};

using PieceTrainers = std::tuple<
    tk::Trainer<tk::PrecisionPolicy<tk::FP32>, tk::AccumulationPolicy<1>, tk::ClipPolicy<tk::NoClip>>,
    tk::Trainer<tk::PrecisionPolicy<tk::FP32>, tk::AccumulationPolicy<3>, tk::ClipPolicy<tk::ClipNorm>>,
    tk::Trainer<tk::PrecisionPolicy<tk::FP16Dynamic>, tk::AccumulationPolicy<2>, tk::ClipPolicy<tk::ClipNorm>>,
    tk::Trainer<tk::PrecisionPolicy<tk::MasterWeights<tk::BF16>>, tk::AccumulationPolicy<2>, tk::ClipPolicy<tk::NoClip>>>;

TEST_CASE_TEMPLATE_DEFINE("micro_step_pieces equals micro_step on the whole micro-batch", T, pieces_equal_whole) {
  const auto data = testing::regression(120);
  auto whole_model = testing::make_mlp(3), piece_model = testing::make_mlp(3);
  const auto options = tk::TrainerOptions().max_grad_norm(0.5).loss_scale(tk::LossScaleOptions().init_scale(256));
  T whole(whole_model, tk::AdamW{1e-2, 1e-2}, options), pieced(piece_model, tk::AdamW{1e-2, 1e-2}, options);
  std::int64_t closed_whole = 0, closed_pieces = 0;
  for (std::int64_t i = 0; i < 6; ++i) {
    const std::int64_t n = 10 + 3 * (i % 3);  // uneven micro-batches: 10, 13, 16 rows
    const Rows b = rows_of(data, 16 * i, n);
    const auto rw = whole.micro_step([&] { return torch::mse_loss(whole_model(b.x), b.y); }, n);
    // Three uneven pieces, the loss of each the mean over its rows.
    const std::vector<std::int64_t> counts{n / 2, n / 3, n - n / 2 - n / 3};
    std::vector<Rows> pieces;
    for (std::int64_t k = 0, at = 0; k < 3; at += counts[static_cast<size_t>(k)], ++k)
      pieces.push_back({b.x.narrow(0, at, counts[static_cast<size_t>(k)]), b.y.narrow(0, at, counts[static_cast<size_t>(k)])});
    const auto rp = pieced.micro_step_pieces(
        [&](std::int64_t j) { return torch::mse_loss(piece_model(pieces[static_cast<size_t>(j)].x), pieces[static_cast<size_t>(j)].y); },
        counts);
    CHECK(rw.window_closed == rp.window_closed);
    CHECK(whole.window_position() == pieced.window_position());
    if (rw.window_closed) {
      ++closed_whole, ++closed_pieces;
      CHECK(rp.report.items() == rw.report.items());
      CHECK(rp.report.loss() == doctest::Approx(rw.report.loss()).epsilon(PieceCase<T>::tolerance));
    }
  }
  CHECK(closed_whole > 0);
  CHECK(whole.windows() == pieced.windows());
  CHECK(testing::relative_error(testing::flat(*piece_model), testing::flat(*whole_model)) < PieceCase<T>::tolerance);
}
TEST_CASE_TEMPLATE_APPLY(pieces_equal_whole, PieceTrainers);

TEST_CASE("micro_step_pieces: bad counts are refused before anything runs") {
  auto model = testing::make_mlp(1);
  tk::Trainer<> trainer(model, tk::SGD{0.1});
  const auto x = torch::randn({4, 8});
  const auto loss = [&](std::int64_t) { return model(x).pow(2).mean(); };
  CHECK_THROWS_WITH(trainer.micro_step_pieces(loss, {}), doctest::Contains("micro_step_pieces: no pieces"));
  CHECK_THROWS_WITH(trainer.micro_step_pieces(loss, {2, -1}), doctest::Contains("piece 1 has -1 items"));
  CHECK(trainer.window_position() == 0);
}

TEST_CASE("discard_window: a dropped window leaves parameters, counters and the next window as if it never ran") {
  const auto data = testing::regression(64);
  using T = tk::Trainer<tk::PrecisionPolicy<tk::MasterWeights<tk::BF16>>, tk::AccumulationPolicy<3>, tk::ClipPolicy<tk::ClipNorm>>;
  auto a_model = testing::make_mlp(4), b_model = testing::make_mlp(4);
  const auto options = tk::TrainerOptions().max_grad_norm(1.0);
  T a(a_model, tk::Adam{1e-2}, options), b(b_model, tk::Adam{1e-2}, options);
  const auto before = testing::flat(*a_model).clone();
  // a: two micro-batches of a window, then dropped.
  for (int i = 0; i < 2; ++i) {
    const Rows r = rows_of(data, 8 * i, 8);
    a.micro_step([&] { return torch::mse_loss(a_model(r.x), r.y) * 100; }, 8);
  }
  CHECK(a.window_position() == 2);
  a.discard_window();
  CHECK(a.window_position() == 0);
  CHECK(a.windows() == 0);
  CHECK(torch::equal(testing::flat(*a_model), before));
  // Both run the same window now: bit-equal.
  for (int i = 0; i < 3; ++i) {
    const Rows r = rows_of(data, 24 + 8 * i, 8);
    a.micro_step([&] { return torch::mse_loss(a_model(r.x), r.y); }, 8);
    b.micro_step([&] { return torch::mse_loss(b_model(r.x), r.y); }, 8);
  }
  CHECK(a.windows() == 1);
  CHECK(torch::equal(testing::flat(*a_model), testing::flat(*b_model)));
}

// --- the fit loop: out-of-memory replay ------------------------------------------------------

/// Regression in micro-batches of 16 rows (6 per epoch, windows of 3): `limit` > 0 makes the
/// task's loss throw c10::OutOfMemoryError for a piece of more than `limit` rows, as a device
/// would (the test hook); `once_at` makes it throw only the first time micro-batch once_at
/// (epoch 0) is run whole.
struct OomTask {
  testing::Regression data = testing::regression(96);
  testing::TinyMlp model;
  tk::Task<Rows> task;
  std::int64_t limit = 0, once_at = -1, current = -1;
  bool thrown_once = false;
  std::int64_t ooms = 0;

  explicit OomTask(testing::TinyMlp m, bool splits = true) : model(std::move(m)) {
    task.batches_per_epoch = [](std::int64_t) { return std::int64_t{6}; };
    task.batch = [this](std::int64_t epoch, std::int64_t index) {
      current = index;
      auto gen = at::make_generator<at::CPUGeneratorImpl>(77 + epoch);
      const auto order = torch::randperm(96, gen).narrow(0, 16 * index, 16);
      return Rows{data.x.index_select(0, order), data.y.index_select(0, order)};
    };
    task.loss = [this](const Rows& b, tk::Metrics& metrics) {
      const bool over = limit > 0 && b.size() > limit;
      const bool once = once_at >= 0 && current == once_at && b.size() == 16 && !thrown_once;
      if (over || once) {
        thrown_once = thrown_once || once;
        ++ooms;
        TORCH_CHECK_WITH(OutOfMemoryError, false, "CUDA out of memory. Tried to allocate 20.00 MiB (test hook)");
      }
      const auto out = model(b.x);
      metrics.add("MAE", (out - b.y).abs().mean(), static_cast<double>(b.size()));
      return torch::mse_loss(out, b.y);
    };
    task.items = [](const Rows& b) { return b.size(); };
    if (splits) task.split = split_rows;
  }
};

using ReplayTrainer = tk::Trainer<tk::PrecisionPolicy<tk::FP32>, tk::AccumulationPolicy<3>, tk::ClipPolicy<tk::ClipNorm>>;

tk::FitOptions replay_options(const std::string& dir, std::int64_t end) {
  return tk::FitOptions().output_path(dir).end_epoch(end).log_frequent(1).seed(3).progress(false);
}

struct Finished {
  tk::FitResult result;
  torch::Tensor params;
  std::string log;
};
Finished train(OomTask& t, const std::string& dir, std::int64_t end) {
  ReplayTrainer trainer(t.model, tk::AdamW{5e-3, 1e-2}, tk::TrainerOptions().max_grad_norm(1.0));
  Finished f;
  f.result = tk::fit(trainer, t.task, replay_options(dir, end));
  f.params = testing::flat(*t.model).clone();
  std::ifstream in(dir + "/model-log.txt");
  f.log.assign(std::istreambuf_iterator<char>(in), {});
  return f;
}

TEST_CASE("fit: out of memory inside a window replays it in halved pieces and ends where an uninterrupted run ends") {
  TempDir plain_dir, oom_dir, once_dir;
  OomTask plain(testing::make_mlp(9));
  const Finished reference = train(plain, plain_dir.path, 2);
  CHECK(reference.result.replays == 0);
  CHECK(reference.result.piece_items == 0);

  SUBCASE("every micro-batch over 6 rows runs out: 16 -> 8 -> 4, from the first micro-batch on") {
    OomTask oom(testing::make_mlp(9));
    oom.limit = 6;
    const Finished f = train(oom, oom_dir.path, 2);
    CHECK(f.result.replays == 2);
    CHECK(f.result.piece_items == 4);
    CHECK(oom.ooms == 2);  // then every micro-batch runs as 4 pieces of 4
    CHECK(f.result.applied_steps == reference.result.applied_steps);
    CHECK(f.result.windows == reference.result.windows);
    CHECK(testing::relative_error(f.params, reference.params) < 1e-5);
    CHECK(f.result.train.at("Loss") == doctest::Approx(reference.result.train.at("Loss")).epsilon(1e-5));
    CHECK(f.result.train.at("MAE") == doctest::Approx(reference.result.train.at("MAE")).epsilon(1e-5));
    CHECK(f.log.find("out of memory at epoch 0, micro-batch 0 of 6 (optimizer step 1, 16 items at once): CUDA out of "
                     "memory. Tried to allocate 20.00 MiB (test hook). The window's partial gradient is dropped and the "
                     "window replayed from micro-batch 0 in pieces of at most 8 items") != std::string::npos);
  }
  SUBCASE("once, in the window's last micro-batch: the window starts again at its first") {
    OomTask once(testing::make_mlp(9));
    once.once_at = 5;  // the second window (micro-batches 3, 4, 5) of epoch 0
    const Finished f = train(once, once_dir.path, 2);
    CHECK(f.result.replays == 1);
    CHECK(f.result.piece_items == 8);
    CHECK(f.result.applied_steps == reference.result.applied_steps);
    CHECK(testing::relative_error(f.params, reference.params) < 1e-5);
    // The epoch's means count the replayed window once.
    CHECK(f.result.train.at("Loss") == doctest::Approx(reference.result.train.at("Loss")).epsilon(1e-5));
    CHECK(f.log.find("replayed from micro-batch 3 in pieces of at most 8 items") != std::string::npos);
    // A resume keeps the smaller size (and says so).
    OomTask resumed(testing::make_mlp(9));
    const Finished r = train(resumed, once_dir.path, 3);
    CHECK(r.result.piece_items == 8);
    CHECK(r.log.find("micro-batches run as pieces of at most 8 items, as the checkpoint's run did") != std::string::npos);
  }
}

TEST_CASE("fit: out of memory that no replay can fix stops with the position, and the checkpoints stay") {
  TempDir dir;
  {
    OomTask first(testing::make_mlp(2));
    train(first, dir.path, 1);  // one clean epoch: a checkpoint
  }
  OomTask always(testing::make_mlp(2));
  always.limit = -1;  // (unused)
  always.task.loss = [](const Rows&, tk::Metrics&) -> torch::Tensor {
    TORCH_CHECK_WITH(OutOfMemoryError, false, "CUDA out of memory (test hook)");
    return {};
  };
  ReplayTrainer trainer(always.model, tk::AdamW{5e-3, 1e-2}, tk::TrainerOptions().max_grad_norm(1.0));
  CHECK_THROWS_WITH(tk::fit(trainer, always.task, replay_options(dir.path, 2)),
                    doctest::Contains("out of memory at epoch 1, micro-batch 0 of 6 (optimizer step 3, 1 item at once): "
                                      "CUDA out of memory (test hook). Pieces of one item do not fit"));
  // The epoch-0 checkpoint is intact: a run without the failure resumes from it.
  OomTask again(testing::make_mlp(2));
  const Finished f = train(again, dir.path, 2);
  CHECK(f.result.resumed_from.find("model-0000.ckpt") != std::string::npos);
  CHECK(f.result.applied_steps == 4);

  SUBCASE("without task.split: the error names the micro-batch and what would replay it") {
    TempDir other;
    OomTask no_split(testing::make_mlp(2), /*splits=*/false);
    no_split.limit = 6;
    ReplayTrainer t(no_split.model, tk::AdamW{5e-3, 1e-2}, tk::TrainerOptions().max_grad_norm(1.0));
    CHECK_THROWS_WITH(tk::fit(t, no_split.task, replay_options(other.path, 1)),
                      doctest::Contains("out of memory at epoch 0, micro-batch 0 of 6 (optimizer step 1, 16 items at "
                                        "once): CUDA out of memory. Tried to allocate 20.00 MiB (test hook). Give the "
                                        "task a split function (tk::Task::split"));
  }
}

// --- the fit loop: a planned micro-batch on this machine's memory ------------------------------

// A model whose activations are large per item: each row becomes a [1, 2^20] float
// intermediate (4 MiB) kept for the backward.
struct WideImpl : torch::nn::Module {
  WideImpl() : fc(register_module("fc", torch::nn::Linear(8, 3))), up(register_parameter("up", torch::full({1, 1 << 20}, 0.01))) {}
  torch::Tensor forward(const torch::Tensor& x) {
    const auto wide = torch::tanh(x.sum(1, true) * up);  // [n, 2^20]
    return fc(x) + wide.mean(1, true);
  }
  torch::nn::Linear fc;
  torch::Tensor up;
};
TORCH_MODULE(Wide);

double resident_bytes() { return tk::detail::proc_status_bytes("VmRSS"); }

TEST_CASE("fit: TRAIN.MEMORY_BUDGET measures this process's peak and plans pieces that fit, the step unchanged") {
  if (!tk::PeakMemory(torch::kCPU).available()) {
    MESSAGE("skipped: /proc/self/clear_refs cannot be written here, so the peak resident set cannot be reset");
    return;
  }
  const auto data = testing::regression(256);
  const auto make_task = [&](Wide& model) {
    tk::Task<Rows> task;
    task.batches_per_epoch = [](std::int64_t) { return std::int64_t{4}; };
    task.batch = [&](std::int64_t, std::int64_t index) { return rows_of(data, 64 * index, 64); };
    task.loss = [&model](const Rows& b, tk::Metrics&) { return torch::mse_loss(model(b.x), b.y); };
    task.items = [](const Rows& b) { return b.size(); };
    task.split = split_rows;
    return task;
  };
  const auto run = [&](double budget, const std::string& dir) {
    torch::manual_seed(11);
    Wide model;
    tk::Trainer<> trainer(model, tk::SGD{0.05});
    auto task = make_task(model);
    const auto result = tk::fit(trainer, task, tk::FitOptions().output_path(dir).end_epoch(1).seed(1).progress(false).memory_budget(budget));
    return std::make_pair(result, testing::flat(*model).clone());
  };
  TempDir plain_dir, planned_dir, tight_dir;
  const auto plain = run(0, plain_dir.path);
  CHECK(!plain.first.plan);
  // 64 rows need about 64 x 4 MiB x a few of activations over what the process holds now; a
  // budget of about 100 MiB above it fits far fewer.
  const double budget = (resident_bytes() + 100 * kMiB) / 0.9;
  const auto planned = run(budget, planned_dir.path);
  REQUIRE(planned.first.plan);
  const tk::MemoryPlan& plan = *planned.first.plan;
  MESSAGE(plan.text());
  CHECK(plan.measured.front().first == 1);
  CHECK(plan.bytes_per_item > 4 * kMiB);  // at least the kept intermediate
  CHECK(plan.piece_items >= 1);
  CHECK(plan.piece_items < 64);
  CHECK(planned.first.piece_items == plan.piece_items);
  int over = 0;  // measuring stops at the first size over the budget, or before one predicted over it
  for (const auto& [items, bytes] : plan.measured) {
    if (items <= plan.piece_items) CHECK(bytes <= budget * 0.9);
    over += bytes > budget * 0.9;
  }
  CHECK(over <= 1);
  CHECK(plan.measured.back().first < 64);  // 64 rows (about 64 x 8 MiB more) were never measured
  // The plan changed how, not what: the same steps, the same parameters (up to rounding).
  CHECK(planned.first.applied_steps == plain.first.applied_steps);
  CHECK(testing::relative_error(planned.second, plain.second) < 1e-5);

  // A budget below what the process already holds cannot hold one item.
  CHECK_THROWS_WITH_AS(run(resident_bytes() * 0.5, tight_dir.path),
                       doctest::Contains("cannot hold the forward+backward of one item"), tk::ConfigError);
}

// 2^24 parameters (64 MiB) with almost no activations (the backward of narrow makes a 64 MiB
// gradient, in either run): AdamW's two moments are 128 MiB, each its own mapping (so the
// resident set shows them).
struct BigImpl : torch::nn::Module {
  BigImpl() : fc(register_module("fc", torch::nn::Linear(8, 3))), big(register_parameter("big", torch::zeros({1 << 24}))) {}
  torch::Tensor forward(const torch::Tensor& x) { return fc(x) + big.narrow(0, 0, 3); }
  torch::nn::Linear fc;
  torch::Tensor big;
};
TORCH_MODULE(Big);

// One epoch of one micro-batch: the 16 rows of `data`.
tk::Task<Rows> big_task(Big& model, const testing::Regression& data) {
  tk::Task<Rows> task;
  task.batches_per_epoch = [](std::int64_t) { return std::int64_t{1}; };
  task.batch = [&data](std::int64_t, std::int64_t) { return rows_of(data, 0, 16); };
  task.loss = [&model](const Rows& b, tk::Metrics&) { return torch::mse_loss(model(b.x), b.y); };
  task.items = [](const Rows& b) { return b.size(); };
  task.split = split_rows;
  return task;
}

TEST_CASE("fit: TRAIN.MEMORY_BUDGET measures a fresh run with its optimizer's state, which appears at the first step") {
  if (!tk::PeakMemory(torch::kCPU).available()) {
    MESSAGE("skipped: /proc/self/clear_refs cannot be written here, so the peak resident set cannot be reset");
    return;
  }
  const auto data = testing::regression(16);
  // One epoch under a budget far above the need; `optimizer(model)` is the trainer's optimizer.
  const auto plan_of = [&](const auto& optimizer) {
    torch::manual_seed(3);
    Big model;
    tk::Trainer<> trainer(model, optimizer(model));
    auto task = big_task(model, data);
    const auto result = tk::fit(trainer, task, tk::FitOptions().write_files(false).end_epoch(1).seed(1).progress(false)
                                                   .memory_budget(resident_bytes() + 4096 * kMiB));
    REQUIRE(result.plan);
    CHECK(result.applied_steps == 1);
    return *result.plan;
  };
  const tk::MemoryPlan sgd_plan = plan_of([](Big&) { return tk::SGD{0.05}; });  // no state
  const tk::MemoryPlan adamw_plan = plan_of([](Big&) { return tk::AdamW{1e-3, 1e-2}; });
  for (const auto* plan : {&sgd_plan, &adamw_plan}) {
    CHECK(plan->optimizer_state_counted);
    CHECK(plan->text().find("Not counted") == std::string::npos);
  }
  const double sgd = sgd_plan.measured.front().second, adamw = adamw_plan.measured.front().second;
  MESSAGE("peak at one item: SGD " << sgd / kMiB << " MiB, AdamW " << adamw / kMiB << " MiB");
  // The moments (2 x 64 MiB) are in AdamW's measurement: seen 60-128 MiB over SGD's (less where
  // the allocator hands out pages the previous run left resident, which the reset peak does not
  // count again), and about 2 MiB when the plan measured before they existed. A quarter of them
  // at least, and not much else.
  CHECK(adamw - sgd > 32 * kMiB);
  CHECK(adamw - sgd < 192 * kMiB);

  // A torch::optim optimizer makes its state at its first step: the plan cannot hold it, and
  // its line says so.
  const tk::MemoryPlan torch_plan = plan_of([](Big& model) {
    return std::make_shared<torch::optim::Adam>(model->parameters(), torch::optim::AdamOptions(1e-3));
  });
  CHECK(!torch_plan.optimizer_state_counted);
  CHECK(torch_plan.text().find("Not counted: the torch::optim optimizer's state, which it makes at its first step") !=
        std::string::npos);
}

TEST_CASE("TRAIN.MEMORY_BUDGET: an optimizer state that does not fit stops the plan, naming the key and the device") {
  if (!tk::PeakMemory(torch::kCPU).available()) {
    MESSAGE("skipped: /proc/self/clear_refs cannot be written here, so the plan cannot measure");
    return;
  }
  const auto data = testing::regression(16);
  torch::manual_seed(3);
  Big model;
  tk::Trainer<> trainer(model, tk::AdamW{1e-3, 1e-2});
  auto task = big_task(model, data);
  tk::detail::PieceRunner<Rows> runner(trainer, task, 0, [](const std::string&) {}, [](const std::string&) {});
  // A real allocation failure: the address space capped 32 MiB over what the process has, so
  // the first 64 MiB moment cannot be mapped.
  ::rlimit saved{};
  REQUIRE(::getrlimit(RLIMIT_AS, &saved) == 0);
  ::rlimit capped = saved;
  capped.rlim_cur = static_cast<rlim_t>(tk::detail::proc_status_bytes("VmSize") + 32 * kMiB);
  if (saved.rlim_max != RLIM_INFINITY && capped.rlim_cur > saved.rlim_max) {
    MESSAGE("skipped: the hard address-space limit is below what the test needs");
    return;
  }
  std::string error;
  REQUIRE(::setrlimit(RLIMIT_AS, &capped) == 0);
  try {
    runner.plan(4096 * kMiB, 0);
  } catch (const tk::ConfigError& e) {
    error = e.what();
  } catch (const std::exception& e) {
    error = std::string("not a ConfigError: ") + e.what();
  }
  REQUIRE(::setrlimit(RLIMIT_AS, &saved) == 0);
  MESSAGE(error);
  CHECK(error.find("TRAIN.MEMORY_BUDGET") != std::string::npos);
  CHECK(error.find("the optimizer's state does not fit on cpu beside the model and its gradient") != std::string::npos);
}

TEST_CASE("fit: a budget or piece size needs a task that splits its batches") {
  TempDir dir;
  OomTask t(testing::make_mlp(1), /*splits=*/false);
  ReplayTrainer trainer(t.model, tk::SGD{0.1});
  CHECK_THROWS_WITH_AS(tk::fit(trainer, t.task, replay_options(dir.path, 1).memory_budget(0.5)),
                       doctest::Contains("TRAIN.MEMORY_BUDGET: planning the micro-batch needs a task that splits its batches"),
                       tk::ConfigError);
  CHECK_THROWS_WITH(tk::fit(trainer, t.task, replay_options(dir.path, 1).piece_items(4)),
                    doctest::Contains("FitOptions::piece_items (TRAIN.PIECE_ITEMS) needs task.split"));
  t.task.split = [](const Rows& b, std::int64_t) { return std::vector<Rows>{b}; };
  t.task.items = nullptr;
  CHECK_THROWS_WITH(tk::fit(trainer, t.task, replay_options(dir.path, 1)), doctest::Contains("task.split needs task.items"));
}

}  // namespace

}  // namespace test_memory
