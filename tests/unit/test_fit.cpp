// The fit loop in one process: resume equals never stopping (parameters, optimizer state, loss
// scale, logged losses), also from a stop inside an epoch; metrics weighted by items; validation,
// callbacks, best checkpoint; non-finite diagnostics; fit_options from a Config.
#include "../support/helpers.hpp"
#include "../support/host_reads.hpp"

#include <trainkit/fit/callbacks.hpp>
#include <trainkit/fit/fit.hpp>

#include <algorithm>
#include <atomic>
#include <csignal>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>

namespace test_fit {  // this file's names, apart from those of the files it shares a unity batch with

using testing::TempDir;

namespace {

using T = tk::Trainer<tk::PrecisionPolicy<tk::FP16Dynamic>, tk::AccumulationPolicy<2>,
                      tk::ClipPolicy<tk::ClipNorm>>;

struct Batch {
  torch::Tensor x, y;
  std::int64_t items;
};

/// A regression task whose micro-batch (epoch, index) is a pure function of them: the epoch's
/// permutation comes from a generator seeded by the epoch. 7 micro-batches of uneven sizes
/// (7 is odd: every epoch ends in a partial window of AccumulationPolicy<2>).
struct RegressionTask {
  testing::Regression data = testing::regression(96);
  testing::TinyMlp model;
  tk::Task<Batch> task;
  int validations = 0;

  explicit RegressionTask(testing::TinyMlp m) : model(std::move(m)) {
    task.batches_per_epoch = [](std::int64_t) { return std::int64_t{7}; };
    task.batch = [this](std::int64_t epoch, std::int64_t index) {
      auto gen = at::make_generator<at::CPUGeneratorImpl>(1000 + epoch);
      const auto order = torch::randperm(96, gen);
      const std::int64_t size = 8 + 4 * (index % 3);  // 8, 12, 16 samples
      const auto rows = order.narrow(0, index * 12, size);
      return Batch{data.x.index_select(0, rows), data.y.index_select(0, rows), size};
    };
    task.loss = [this](const Batch& b, tk::Metrics& metrics) {
      const auto out = model(b.x);
      metrics.add("MAE", (out - b.y).abs().mean(), static_cast<double>(b.items));
      return torch::mse_loss(out, b.y);
    };
    task.items = [](const Batch& b) { return b.items; };
    task.validate = [this](std::int64_t) {
      ++validations;
      torch::NoGradGuard no_grad;
      model->eval();
      const double mse = torch::mse_loss(model(data.x), data.y).item<double>();
      return std::map<std::string, double>{{"MSE", mse}};
    };
    task.best_metric = "MSE";
    task.higher_is_better = false;
  }
};

tk::TrainerOptions trainer_options() {
  return tk::TrainerOptions().loss_scale(tk::LossScaleOptions().init_scale(1024).growth_interval(3));
}

tk::FitOptions fit_options(const std::string& dir, std::int64_t end) {
  return tk::FitOptions().output_path(dir).end_epoch(end).log_frequent(2).checkpoint_keep(2).seed(5).progress(false);
}

/// (tag, step) -> value of a JSON-lines scalar log; a later line for the same key wins, as in
/// TensorBoard (a resumed run may log a step again).
std::map<std::pair<std::string, long>, std::string> read_scalars(const std::string& path) {
  std::map<std::pair<std::string, long>, std::string> out;
  std::ifstream in(path);
  std::string line;
  while (std::getline(in, line)) {
    const auto j = nlohmann::json::parse(line);
    out[{j["tag"].get<std::string>(), j["step"].get<long>()}] = j["value"].dump();
  }
  return out;
}

std::map<std::pair<std::string, long>, std::string> only(const std::map<std::pair<std::string, long>, std::string>& all,
                                                         const std::string& tag) {
  std::map<std::pair<std::string, long>, std::string> out;
  for (const auto& [k, v] : all)
    if (k.first == tag) out[k] = v;
  return out;
}

void check_same_state(T& a, testing::TinyMlp& ma, T& b, testing::TinyMlp& mb) {
  CHECK(torch::equal(testing::flat(*ma), testing::flat(*mb)));
  CHECK(torch::equal(a.loss_scale(), b.loss_scale()));
  CHECK(torch::equal(a.applied_steps(), b.applied_steps()));
  CHECK(torch::equal(a.skipped_steps(), b.skipped_steps()));
  CHECK(a.windows() == b.windows());
  auto& ra = dynamic_cast<tk::detail::FusedAdam<tk::AdamW, true>&>(a.update_rule());
  auto& rb = dynamic_cast<tk::detail::FusedAdam<tk::AdamW, true>&>(b.update_rule());
  CHECK(torch::equal(ra.exp_avg()[0], rb.exp_avg()[0]));
  CHECK(torch::equal(ra.exp_avg_sq()[0], rb.exp_avg_sq()[0]));
  CHECK(torch::equal(ra.step_count(), rb.step_count()));
}

}  // namespace

TEST_CASE("fit: 2E epochs straight equal E epochs, a new process state, and E more (bit for bit)") {
  const std::int64_t E = 2;
  TempDir straight_dir, split_dir;

  torch::manual_seed(11);
  RegressionTask straight(testing::make_mlp(3, 8, 16, 3, 0.2));
  T a(straight.model, tk::AdamW{1e-2}, trainer_options());
  const auto ra = tk::fit(a, straight.task, fit_options(straight_dir.path, 2 * E));
  CHECK_FALSE(ra.stopped);
  CHECK(ra.position == tk::FitPosition{2 * E, 0});
  CHECK(ra.windows == 2 * E * 4);  // 7 micro-batches: 3 full windows and a flushed one

  torch::manual_seed(11);
  RegressionTask first(testing::make_mlp(3, 8, 16, 3, 0.2));
  T b(first.model, tk::AdamW{1e-2}, trainer_options());
  const auto rb = tk::fit(b, first.task, fit_options(split_dir.path, E));
  CHECK(rb.position == tk::FitPosition{E, 0});

  torch::manual_seed(999);  // another RNG state and other weights: everything must come back
  RegressionTask second(testing::make_mlp(4, 8, 16, 3, 0.2));
  T c(second.model, tk::AdamW{1e-2}, trainer_options());
  const auto rc = tk::fit(c, second.task, fit_options(split_dir.path, 2 * E));
  CHECK(rc.resumed_from == split_dir / "model-0001.ckpt");
  CHECK(rc.position == tk::FitPosition{2 * E, 0});

  check_same_state(a, straight.model, c, second.model);
  CHECK(ra.train == rc.train);
  CHECK(ra.validation == rc.validation);
  const auto la = read_scalars(straight_dir / "model-scalars.jsonl");
  const auto lc = read_scalars(split_dir / "model-scalars.jsonl");
  CHECK(only(la, "Train-Loss").size() == static_cast<size_t>(2 * E * 4 / 2));
  CHECK(only(la, "Train-Loss") == only(lc, "Train-Loss"));
  CHECK(only(la, "Train-MAE") == only(lc, "Train-MAE"));
  CHECK(only(la, "loss-scale") == only(lc, "loss-scale"));
  CHECK(only(la, "grad-para/Total-Norm") == only(lc, "grad-para/Total-Norm"));
  CHECK(only(la, "Val-MSE") == only(lc, "Val-MSE"));
  // Retention: the newest 2 and the best.
  CHECK(testing::file_exists(straight_dir / "model-0003.ckpt"));
  CHECK(testing::file_exists(straight_dir / "model-0002.ckpt"));
  CHECK_FALSE((testing::file_exists(straight_dir / "model-0000.ckpt") &&
               ra.best_checkpoint != straight_dir / "model-0000.ckpt"));
  CHECK(testing::file_exists(ra.best_checkpoint));
}

TEST_CASE("fit: a stop inside an epoch finishes the window, checkpoints, and resumes at that micro-batch") {
  TempDir straight_dir, split_dir;
  torch::manual_seed(12);
  RegressionTask straight(testing::make_mlp(5, 8, 16, 3, 0.2));
  T a(straight.model, tk::AdamW{1e-2}, trainer_options());
  const auto ra = tk::fit(a, straight.task, fit_options(straight_dir.path, 3));

  torch::manual_seed(12);
  RegressionTask first(testing::make_mlp(5, 8, 16, 3, 0.2));
  T b(first.model, tk::AdamW{1e-2}, trainer_options());
  tk::Callbacks callbacks;
  int after_signal = 0;
  callbacks.batch_end = [&](tk::BatchEnd& e) {
    if (e.epoch == 1 && e.index == 2) std::raise(SIGTERM);  // inside the window [2, 3]
    if (e.epoch == 1 && e.index > 2) ++after_signal;
  };
  std::signal(SIGTERM, SIG_DFL);
  const auto rb = tk::fit(b, first.task, fit_options(split_dir.path, 3), callbacks);
  CHECK(rb.stopped);
  CHECK(rb.signal == SIGTERM);
  CHECK(after_signal == 1);  // micro-batch 3 closes the window
  CHECK(rb.position == tk::FitPosition{1, 4});
  REQUIRE(!rb.checkpoints.empty());
  CHECK(rb.checkpoints.back() == split_dir / "model-0001-000004.ckpt");
  CHECK(rb.message.find("run the same command again") != std::string::npos);
  // fit restored the previous handler: SIG_DFL.
  struct sigaction now {};
  ::sigaction(SIGTERM, nullptr, &now);
  CHECK((now.sa_handler == SIG_DFL));

  torch::manual_seed(77);
  RegressionTask second(testing::make_mlp(6, 8, 16, 3, 0.2));
  T c(second.model, tk::AdamW{1e-2}, trainer_options());
  const auto rc = tk::fit(c, second.task, fit_options(split_dir.path, 3));
  CHECK(rc.resumed_from == split_dir / "model-0001-000004.ckpt");
  check_same_state(a, straight.model, c, second.model);
  CHECK(ra.train == rc.train);
  const auto la = read_scalars(straight_dir / "model-scalars.jsonl");
  const auto lc = read_scalars(split_dir / "model-scalars.jsonl");
  CHECK(only(la, "Train-Loss") == only(lc, "Train-Loss"));
  CHECK(only(la, "Train-MAE") == only(lc, "Train-MAE"));
}

/// The lines of a JSON-lines scalar log as (step, tag, value), in order, without the timings
/// (wall time, samples-per-second, seconds-per-step), which differ between runs.
std::vector<std::string> log_lines(const std::string& path) {
  std::vector<std::string> out;
  std::ifstream in(path);
  std::string line;
  while (std::getline(in, line)) {
    const auto j = nlohmann::json::parse(line);
    if (j["tag"] == tk::scalar_tags::samples_per_second || j["tag"] == tk::scalar_tags::seconds_per_step) continue;
    out.push_back(j["step"].dump() + " " + j["tag"].get<std::string>() + " " + j["value"].dump());
  }
  return out;
}

TEST_CASE("fit: a run resumed from an earlier checkpoint than its last log point logs each (step, tag) once") {
  TempDir straight_dir, crashed_dir;
  torch::manual_seed(14);
  RegressionTask straight(testing::make_mlp(8, 8, 16, 3, 0.2));
  T a(straight.model, tk::AdamW{1e-2}, trainer_options());
  tk::fit(a, straight.task, fit_options(straight_dir.path, 3));

  // The same run, then its last checkpoint lost: as if it had died after logging epoch 2.
  torch::manual_seed(14);
  RegressionTask first(testing::make_mlp(8, 8, 16, 3, 0.2));
  T b(first.model, tk::AdamW{1e-2}, trainer_options());
  tk::fit(b, first.task, fit_options(crashed_dir.path, 3));
  REQUIRE(::unlink((crashed_dir / "model-0002.ckpt").c_str()) == 0);
  const std::string jsonl = crashed_dir / "model-scalars.jsonl";
  { std::ofstream(jsonl, std::ios::app) << "{\"step\":11,\"tag\":\"Train-Lo"; }  // torn by the crash
  const auto before = log_lines(straight_dir / "model-scalars.jsonl");

  torch::manual_seed(15);
  RegressionTask second(testing::make_mlp(9, 8, 16, 3, 0.2));
  T c(second.model, tk::AdamW{1e-2}, trainer_options());
  const auto rc = tk::fit(c, second.task, fit_options(crashed_dir.path, 3));
  CHECK(rc.resumed_from == crashed_dir / "model-0001.ckpt");
  check_same_state(a, straight.model, c, second.model);
  // Each (step, tag) once, in the straight run's order and with its values.
  CHECK(log_lines(jsonl) == before);
  // TensorBoard: the resumed run's file is the second one of the directory.
  std::size_t event_files = 0;
  for (const auto& entry : std::filesystem::directory_iterator(crashed_dir / "tensorboard"))
    event_files += entry.path().filename().string().rfind("events.out.tfevents.", 0) == 0;
  CHECK(event_files == 2);
}

TEST_CASE("fit: a finished job run again trains nothing and says so") {
  TempDir dir;
  torch::manual_seed(16);
  RegressionTask t(testing::make_mlp(10, 8, 16, 3, 0.2));
  T a(t.model, tk::AdamW{1e-2}, trainer_options());
  const auto first = tk::fit(a, t.task, fit_options(dir.path, 2));
  CHECK(first.message.empty());
  RegressionTask u(testing::make_mlp(10, 8, 16, 3, 0.2));  // a new process's model
  T b(u.model, tk::AdamW{1e-2}, trainer_options());
  const auto again = tk::fit(b, u.task, fit_options(dir.path, 2));
  CHECK(again.windows == first.windows);
  CHECK(again.checkpoints.empty());
  CHECK(again.message.find("nothing to train: '" + dir / "model-0001.ckpt" + "' is at epoch 2 and TRAIN.END_EPOCH is 2") !=
        std::string::npos);
  // It reports the last epoch's figures, from the checkpoint.
  REQUIRE(first.train.count("Loss"));
  CHECK(again.train == first.train);
  CHECK(again.validation == first.validation);
}

TEST_CASE("fit: validation runs in eval mode without a graph, as written in the guide (no eval() of its own)") {
  TempDir dir;
  torch::manual_seed(17);
  RegressionTask t(testing::make_mlp(11, 8, 16, 3, /*dropout=*/0.5));
  // A validate as fit.md shows one: no eval(), no NoGradGuard. With dropout on, two passes over
  // the same data would differ; in eval mode they are equal.
  bool in_eval = false, without_grad = false, training_after = false;
  t.task.validate = [&](std::int64_t) {
    in_eval = !t.model->is_training();
    without_grad = !torch::GradMode::is_enabled();
    const auto a = torch::mse_loss(t.model(t.data.x), t.data.y).item<double>();
    const auto b = torch::mse_loss(t.model(t.data.x), t.data.y).item<double>();
    return std::map<std::string, double>{{"MSE", a}, {"MSE-again", b}};
  };
  tk::Callbacks callbacks;
  callbacks.epoch_end = [&](tk::EpochEnd&) { training_after = t.model->is_training(); };
  T trainer(t.model, tk::AdamW{1e-2}, trainer_options());
  const auto r = tk::fit(trainer, t.task, fit_options(dir.path, 1), callbacks);
  CHECK(in_eval);
  CHECK(without_grad);
  CHECK(training_after);  // the mode it found, back
  CHECK(r.validation.at("MSE") == r.validation.at("MSE-again"));
}

TEST_CASE("fit: the epoch's means are weighted by items, not averages of averages") {
  TempDir dir;
  torch::manual_seed(13);
  RegressionTask t(testing::make_mlp(7));
  tk::Trainer<> trainer(t.model, tk::SGD{0.05});
  tk::Task<Batch> task = t.task;
  task.validate = nullptr;
  task.best_metric.clear();
  // Record each micro-batch's values on the host (the test may sync; the loop does not).
  double loss_sum = 0, mae_sum = 0, items = 0, loss_of_means = 0;
  task.loss = [&](const Batch& b, tk::Metrics& m) {
    const auto out = t.model(b.x);
    const auto mae = (out - b.y).abs().mean();
    m.add("MAE", mae, static_cast<double>(b.items));
    auto l = torch::mse_loss(out, b.y);
    const double n = static_cast<double>(b.items);
    loss_sum += l.item<double>() * n;
    mae_sum += mae.item<double>() * n;
    items += n;
    loss_of_means += l.item<double>() / 7;
    return l;
  };
  const auto r = tk::fit(trainer, task, fit_options(dir.path, 1));
  CHECK(r.train.at("Loss") == doctest::Approx(loss_sum / items).epsilon(1e-6));
  CHECK(r.train.at("MAE") == doctest::Approx(mae_sum / items).epsilon(1e-6));
  CHECK(std::abs(loss_sum / items - loss_of_means) > 1e-4);  // the two differ here
}

TEST_CASE("fit: validation every VAL_FREQUENT epochs and after the last; callbacks; checkpoints every CHECKPOINT_FREQUENT") {
  TempDir dir;
  torch::manual_seed(14);
  RegressionTask t(testing::make_mlp(8));
  T trainer(t.model, tk::AdamW{1e-2}, trainer_options());
  tk::Callbacks callbacks;
  int batch_ends = 0;
  std::vector<std::int64_t> validated;
  callbacks.batch_end = [&](tk::BatchEnd&) { ++batch_ends; };
  callbacks.epoch_end = [&](tk::EpochEnd& e) {
    if (!e.validation.empty()) validated.push_back(e.epoch);
    CHECK(e.train.count("Loss") == 1);
  };
  t.task.best_metric.clear();
  const auto r = tk::fit(trainer, t.task,
                         fit_options(dir.path, 5).val_frequent(2).checkpoint_frequent(2).checkpoint_keep(10), callbacks);
  CHECK(batch_ends == 5 * 7);
  CHECK(validated == std::vector<std::int64_t>{1, 3, 4});
  CHECK(r.checkpoints == std::vector<std::string>{dir / "model-0001.ckpt", dir / "model-0003.ckpt", dir / "model-0004.ckpt"});
  // Finished: another call resumes at the end and trains nothing.
  const auto again = tk::fit(trainer, t.task, fit_options(dir.path, 5));
  CHECK(again.checkpoints.empty());
  CHECK(again.windows == r.windows);
}

TEST_CASE("fit: a non-finite gradient with NONFINITE abort names the epoch, micro-batch, step and value") {
  TempDir dir;
  torch::manual_seed(15);
  RegressionTask t(testing::make_mlp(9));
  tk::Trainer<> trainer(t.model, tk::AdamW{1e-2}, tk::TrainerOptions().nonfinite(tk::NonFinite::abort));
  auto loss = t.task.loss;
  t.task.loss = [&](const Batch& b, tk::Metrics& m) {
    auto l = loss(b, m);
    return b.items == 12 && t.task.batch(1, 4).x.equal(b.x) ? l * INFINITY : l;
  };
  try {
    tk::fit(trainer, t.task, fit_options(dir.path, 3));
    FAIL("no exception");
  } catch (const tk::NonFiniteGradient& e) {
    const std::string what = e.what();
    CHECK(what.find("epoch 1, micro-batch 4 of 7") != std::string::npos);
    CHECK(what.find("optimizer step 12") != std::string::npos);  // 7 + 5: Accumulate<1>
    CHECK(what.find("inf") != std::string::npos);
  }
  // The checkpoint of epoch 0 is still there and complete.
  CHECK(tk::CheckpointManager::is_complete(dir / "model-0000.ckpt"));
}

TEST_CASE("fit_options reads the run keys of a Config (--model-dir and --resume included)") {
  const char* argv[] = {"prog", "--model-dir", "/tmp/somewhere", "--resume", "--set", "TRAIN.END_EPOCH=7",
                        "--set", "LOG_FREQUENT=3", "--set", "RNG_SEED=4", "--set", "TRAIN.CHECKPOINT_KEEP=5",
                        "--set", "MODEL_PREFIX=vl"};
  const auto cl = tk::CommandLine::parse(static_cast<int>(std::size(argv)), argv);
  tk::Config config;
  config.load_string("{}", tk::Config::Format::json, cl.overrides());
  const auto o = tk::RunPlan::from(config, 1).fit;
  CHECK(o.output_path() == "/tmp/somewhere");
  CHECK(o.prefix() == "vl");
  CHECK(o.resume());
  CHECK(o.auto_resume());
  CHECK(o.end_epoch() == 7);
  CHECK(o.begin_epoch() == 0);
  CHECK(o.log_frequent() == 3);
  CHECK(o.val_frequent() == 1);
  CHECK(o.checkpoint_frequent() == 1);
  CHECK(o.checkpoint_keep() == 5);
  CHECK(o.seed() == 4);
  CHECK(o.workers() == 4);  // NUM_WORKERS_PER_GPU's default
  CHECK(nlohmann::json::parse(o.config_json())["TRAIN"]["END_EPOCH"] == 7);
  CHECK_THROWS_WITH(tk::FitOptions().validate(), doctest::Contains("END_EPOCH"));
}

TEST_CASE("fit: batches made ahead on worker threads change nothing, also across a stop and resume") {
  TempDir plain_dir, ahead_dir;
  torch::manual_seed(21);
  RegressionTask plain(testing::make_mlp(21, 8, 16, 3, 0.2));
  T a(plain.model, tk::AdamW{1e-2}, trainer_options());
  const auto ra = tk::fit(a, plain.task, fit_options(plain_dir.path, 3));

  torch::manual_seed(21);
  RegressionTask ahead(testing::make_mlp(21, 8, 16, 3, 0.2));
  std::atomic<int> made{0};
  const auto batch = ahead.task.batch;
  ahead.task.batch = [&, batch](std::int64_t e, std::int64_t i) {
    ++made;
    return batch(e, i);
  };
  T b(ahead.model, tk::AdamW{1e-2}, trainer_options());
  tk::Callbacks stop_once;
  stop_once.batch_end = [](tk::BatchEnd& e) { e.request_stop = e.epoch == 1 && e.index == 2; };
  const auto rb = tk::fit(b, ahead.task, fit_options(ahead_dir.path, 3).workers(3), stop_once);
  CHECK(rb.stopped);
  CHECK(rb.position == tk::FitPosition{1, 4});
  CHECK(made.load() >= 7 + 4);  // and batches in flight when it stopped, dropped
  T c(ahead.model, tk::AdamW{1e-2}, trainer_options());
  const auto rc = tk::fit(c, ahead.task, fit_options(ahead_dir.path, 3).workers(3));
  CHECK(rc.resumed_from == ahead_dir / "model-0001-000004.ckpt");
  check_same_state(a, plain.model, c, ahead.model);
  CHECK(ra.train == rc.train);

  // An error of task.batch on a worker surfaces for its own position.
  TempDir err_dir;
  ahead.task.batch = [&, batch](std::int64_t e, std::int64_t i) {
    if (e == 0 && i == 5) throw std::runtime_error("no batch 5");
    return batch(e, i);
  };
  T d(ahead.model, tk::AdamW{1e-2}, trainer_options());
  std::int64_t last = -1;
  tk::Callbacks seen;
  seen.batch_end = [&](tk::BatchEnd& e) { last = e.index; };
  CHECK_THROWS_WITH(tk::fit(d, ahead.task, fit_options(err_dir.path, 1).workers(2), seen), "no batch 5");
  CHECK(last == 4);
}

TEST_CASE("fit: early stopping finishes the run, counts on across a resume, and a re-run trains no further") {
  // Val-M improves at epochs 0 and 1, then not: patience 2 finishes after epoch 3.
  const std::vector<double> values{1.0, 2.0, 1.5, 1.9, 5.0, 6.0};
  auto run = [&](const std::string& dir, std::int64_t end, std::int64_t stop_after) {
    torch::manual_seed(22);
    auto t = std::make_unique<RegressionTask>(testing::make_mlp(22, 8, 16, 3, 0.2));
    t->task.validate = [&](std::int64_t epoch) { return std::map<std::string, double>{{"M", values.at(epoch)}}; };
    t->task.best_metric = "M";
    t->task.higher_is_better = true;
    T trainer(t->model, tk::AdamW{1e-2}, trainer_options());
    tk::EarlyStopping early("M", 2);
    tk::Callbacks callbacks;
    callbacks.epoch_end = [&](tk::EpochEnd& e) { e.request_stop = e.epoch == stop_after; };
    early.attach(callbacks);
    const auto r = tk::fit(trainer, t->task, fit_options(dir, end), callbacks);
    return std::make_pair(r, early.bad_validations());
  };
  TempDir straight, split;
  const auto [r, bad] = run(straight.path, 6, -1);
  CHECK(r.finished);
  CHECK_FALSE(r.stopped);
  CHECK(r.position == tk::FitPosition{4, 0});
  CHECK(bad == 2);
  CHECK(r.message.find("finished after epoch 3: early stopping: Val-M has not improved on 2 for 2 validations") != std::string::npos);
  CHECK(r.checkpoints.back() == straight / "model-0003.ckpt");

  const auto [stopped, bad_at_stop] = run(split.path, 6, 2);  // stopped after epoch 2: one bad validation
  CHECK(stopped.stopped);
  CHECK(bad_at_stop == 1);
  const auto [resumed, bad_resumed] = run(split.path, 6, -1);  // the counter comes back from the checkpoint
  CHECK(resumed.finished);
  CHECK(resumed.position == tk::FitPosition{4, 0});
  CHECK(bad_resumed == 2);
  CHECK(resumed.windows == r.windows);

  const auto [again, bad_again] = run(straight.path, 8, -1);  // even with a later END_EPOCH
  CHECK(again.finished);
  CHECK(again.windows == r.windows);
  CHECK(again.checkpoints.empty());
  CHECK(again.message.find("nothing to train: the run in '" + straight.path + "' finished at epoch 4 (early stopping") !=
        std::string::npos);
  CHECK_THROWS_AS(tk::EarlyStopping("M", 0), std::invalid_argument);
}

TEST_CASE("fit: callbacks' own state is in the checkpoints; a checkpoint without it is said and loads nothing") {
  TempDir dir;
  torch::manual_seed(23);
  RegressionTask t(testing::make_mlp(23, 8, 16, 3, 0.2));
  double seen = 0;  // e.g. an EMA; here a sum of epoch losses
  auto with_state = [&](tk::Callbacks& callbacks) {
    callbacks.epoch_end = [&](tk::EpochEnd& e) { seen += e.train.at("Loss"); };
    callbacks.state.push_back({"sum",
                               [&](torch::serialize::OutputArchive& a) { a.write("value", c10::IValue(seen)); },
                               [&](torch::serialize::InputArchive& a) {
                                 c10::IValue v;
                                 a.read("value", v);
                                 seen = v.toDouble();
                               }});
  };
  {
    T a(t.model, tk::AdamW{1e-2}, trainer_options());
    tk::fit(a, t.task, fit_options(dir.path, 1));  // no callback state in this checkpoint
  }
  tk::Callbacks callbacks;
  with_state(callbacks);
  seen = 123;
  {
    T b(t.model, tk::AdamW{1e-2}, trainer_options());
    tk::fit(b, t.task, fit_options(dir.path, 2), callbacks);
  }
  CHECK(seen > 123);  // it started from where it was: the checkpoint had nothing for it
  const double after_two = seen;
  seen = -1;  // a new process
  T c(t.model, tk::AdamW{1e-2}, trainer_options());
  const auto r = tk::fit(c, t.task, fit_options(dir.path, 3), callbacks);
  CHECK(r.resumed_from == dir / "model-0001.ckpt");
  CHECK(seen == doctest::Approx(after_two + r.train.at("Loss")));
  std::ifstream text(dir / "model-log.txt");
  const std::string log((std::istreambuf_iterator<char>(text)), std::istreambuf_iterator<char>());
  CHECK(log.find("has no state for the callback 'sum'") != std::string::npos);
}

TEST_CASE("fit: the run's text log has its start, resume, log windows, validations, checkpoints and end; Initial-LR is logged") {
  TempDir dir;
  torch::manual_seed(24);
  RegressionTask t(testing::make_mlp(24, 8, 16, 3, 0.2));
  {
    T a(t.model, tk::AdamW{1e-2}, trainer_options());
    tk::fit(a, t.task, fit_options(dir.path, 1));
  }
  {
    T b(t.model, tk::AdamW{1e-2}, trainer_options());
    tk::fit(b, t.task, fit_options(dir.path, 2));
  }
  TempDir groups_dir;
  T g(t.model, tk::AdamW{1e-2}, trainer_options().lr_mult({{"fc1", 0.5}}));
  std::map<std::string, double> initial;
  tk::Callbacks callbacks;
  callbacks.scalar = [&](const std::string& tag, double value, std::int64_t) {
    if (tag.rfind("Initial-LR/", 0) == 0) initial[tag] = value;
  };
  tk::fit(g, t.task, fit_options(groups_dir.path, 1), callbacks);
  CHECK(initial.size() == 2);
  CHECK(initial["Initial-LR/Group_0"] == doctest::Approx(0.5e-2));  // fc1's group comes first
  CHECK(initial["Initial-LR/Group_1"] == doctest::Approx(1e-2));
  std::ifstream text(dir / "model-log.txt");
  std::vector<std::string> lines;
  for (std::string line; std::getline(text, line);) lines.push_back(line.substr(21));  // past the time stamp
  REQUIRE(lines.size() > 8);
  CHECK(lines.front().rfind("start: Trainer<", 0) == 0);
  auto has = [&](const std::string& part) {
    return std::any_of(lines.begin(), lines.end(), [&](const std::string& l) { return l.find(part) != std::string::npos; });
  };
  CHECK(has("epoch 0, micro-batch 3 of 7, optimizer step 2: loss "));
  CHECK(has("epoch 0 validation: MSE "));
  CHECK(has("checkpoint '" + dir / "model-0000.ckpt" + "' written"));
  CHECK(has("end: at epoch 1, micro-batch 0, optimizer step 4"));
  CHECK(has("trainkit: resumed from '" + dir / "model-0000.ckpt" + "'"));
  CHECK(lines.back().rfind("end: at epoch 2", 0) == 0);
}

TEST_CASE("fit: the loop reads values to the host at log windows and epoch ends, never between them") {
  // On a GPU a host read waits for the stream; between log windows the loop must let it run
  // ahead (STYLE: no host sync in the step unless a value is asked for). Counted on the CPU by
  // trainkit_testing::host_reads_in (.item() and data-dependent shapes) over one epoch of 7 or
  // 15 micro-batches (4 or 8 windows of AccumulationPolicy<2>), with no log window inside the
  // epoch, or one every window.
  auto reads = [](std::int64_t micro_batches, std::int64_t log_frequent) {
    TempDir dir;
    torch::manual_seed(11);
    RegressionTask t(testing::make_mlp(3, 8, 16, 3, 0.2));
    t.task.batches_per_epoch = [micro_batches](std::int64_t) { return micro_batches; };
    t.task.batch = [batch = t.task.batch](std::int64_t epoch, std::int64_t index) { return batch(epoch, index % 7); };
    t.task.validate = nullptr;  // the test's own validation reads its MSE with .item()
    t.task.best_metric.clear();
    T trainer(t.model, tk::AdamW{1e-2}, trainer_options());
    std::int64_t windows = 0;
    const auto n = trainkit_testing::host_reads_in([&] {
      windows = tk::fit(trainer, t.task, fit_options(dir.path, 1).log_frequent(log_frequent)).windows;
    });
    REQUIRE(windows == (micro_batches + 1) / 2);
    return n;
  };
  const std::int64_t quiet4 = reads(7, 1000), quiet8 = reads(15, 1000), logged8 = reads(15, 1);
  MESSAGE("host reads in one epoch: 4 windows " << quiet4 << ", 8 windows " << quiet8
                                               << " (no log window inside the epoch); 8 windows, each logged: " << logged8);
  CHECK(quiet8 == quiet4);  // 4 more windows, not one more read
  // A log window reads what it reports by one copy (StepReport's), not value by value.
  CHECK(logged8 == quiet8);
}

}  // namespace test_fit
