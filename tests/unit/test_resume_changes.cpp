// A resume is refused, changing nothing, when the configuration changed in a key that changes
// the training trajectory: the message lists every difference; END_EPOCH and
// logging keys change freely; TRAIN.RESUME_CHANGES: allow continues and says what changed. A
// checkpoint of another optimizer is refused by Trainer::load, naming both, and changes nothing.
#include "../support/helpers.hpp"

#include <trainkit/config/resume_changes.hpp>
#include <trainkit/fit/fit.hpp>
#include <trainkit/trainer/trainer.hpp>

#include <sstream>
#include <string>

namespace test_resume_changes {  // this file's names, apart from those of the files it shares a unity batch with

namespace {

std::string config(double lr, std::int64_t end_epoch, std::int64_t log_frequent = 1, const std::string& optimizer = "AdamW") {
  nlohmann::json j;
  j["TRAIN"] = {{"LR", lr}, {"END_EPOCH", end_epoch}, {"OPTIMIZER", optimizer}, {"BATCH_IMAGES", 8}};
  j["LOG_FREQUENT"] = log_frequent;
  j["VAL"] = {{"BATCH_IMAGES", 100}};
  return j.dump();
}

struct CaptureStderr {
  std::ostringstream text;
  std::streambuf* old = std::cerr.rdbuf(text.rdbuf());
  ~CaptureStderr() { std::cerr.rdbuf(old); }
};

// An FP32 run of 4 micro-batches per epoch over a tiny regression set.
struct Run {
  testing::TinyMlp model = testing::make_mlp(5);
  tk::Trainer<> trainer{model, tk::AdamW{1e-2}};
  testing::Regression data = testing::regression(32);
  tk::Task<std::int64_t> task;
  Run() {
    task.batches_per_epoch = [](std::int64_t) { return std::int64_t{4}; };
    task.batch = [](std::int64_t, std::int64_t index) { return index; };
    task.loss = [this](const std::int64_t& i, tk::Metrics&) {
      return torch::mse_loss(model(data.x.narrow(0, 8 * i, 8)), data.y.narrow(0, 8 * i, 8));
    };
  }
};

tk::FitOptions options(const std::string& dir, const std::string& config_json, std::int64_t end_epoch) {
  return tk::FitOptions().output_path(dir).end_epoch(end_epoch).progress(false).handle_signals(false).config_json(config_json);
}

}  // namespace

TEST_CASE("resume_changes: trajectory keys only, each with both values") {
  const auto changes = tk::resume_changes(config(0.1, 1), config(0.2, 5, 10, "Adam"));
  REQUIRE(changes.size() == 2);
  CHECK(changes[0].key == "TRAIN.LR");
  CHECK(changes[0].before == "0.1");
  CHECK(changes[0].after == "0.2");
  CHECK(changes[1].key == "TRAIN.OPTIMIZER");
  CHECK(changes[1].before == "\"AdamW\"");
  CHECK(changes[1].after == "\"Adam\"");
  CHECK(tk::resume_changes(config(0.1, 1), config(0.1, 9, 7)).empty());  // END_EPOCH, LOG_FREQUENT
}

TEST_CASE("a resume with a changed LR is refused with the differences, changing nothing; allow continues") {
  testing::TempDir dir;
  {
    Run first;
    tk::fit(first.trainer, first.task, options(dir.path, config(0.01, 1), 1));
  }
  Run second;
  const auto before = testing::flat(*second.model);
  std::string refused;
  try {
    tk::fit(second.trainer, second.task, options(dir.path, config(0.02, 2), 2));
  } catch (const tk::ConfigError& e) {
    refused = e.what();
  }
  INFO(refused);
  // The file, not only its directory.
  CHECK(refused.find("TRAIN.RESUME_CHANGES: the checkpoint '" + dir.path + "/model-0000.ckpt' was written with another "
                     "configuration") == 0);
  CHECK(refused.find("\n  TRAIN.LR: 0.01 -> 0.02\n") != std::string::npos);
  CHECK(refused.find("END_EPOCH") == std::string::npos);
  CHECK(refused.find("--set TRAIN.RESUME_CHANGES=allow") != std::string::npos);
  CHECK(torch::equal(testing::flat(*second.model), before));  // nothing loaded
  CHECK(second.trainer.windows() == 0);

  // END_EPOCH and LOG_FREQUENT change freely.
  {
    Run third;
    const tk::FitResult r = tk::fit(third.trainer, third.task, options(dir.path, config(0.01, 2, 5), 2));
    CHECK(r.resumed_from == dir / "model-0000.ckpt");
  }
  // Allowed: it resumes and says what changed.
  Run fourth;
  CaptureStderr err;
  const tk::FitResult r = tk::fit(fourth.trainer, fourth.task,
                                  options(dir.path, config(0.02, 3), 3).allow_resume_changes(true));
  CHECK(r.resumed_from == dir / "model-0001.ckpt");
  CHECK(err.text.str().find("resuming with a changed configuration (TRAIN.RESUME_CHANGES: allow), checkpoint -> this "
                            "run:\n  TRAIN.LR: 0.01 -> 0.02") != std::string::npos);
}

TEST_CASE("Trainer::load of another optimizer's checkpoint names both optimizers and changes nothing") {
  testing::TempDir dir;
  Run adamw;
  tk::Metrics metrics;
  for (std::int64_t i = 0; i < 3; ++i) adamw.trainer.micro_step([&] { return adamw.task.loss(i, metrics); });
  const std::string path = dir / "adamw.ckpt";
  adamw.trainer.save(path);

  auto model = testing::make_mlp(5);
  tk::Trainer<> sgd(model, tk::SGD{0.1});  // no momentum: its state reads no record of AdamW's
  const auto before = testing::flat(*model);
  CHECK_THROWS_WITH_AS(sgd.load(path),
                       doctest::Contains(("checkpoint '" + path + "': written with the optimizer AdamW(fused), this trainer's is SGD(fused)").c_str()),
                       std::runtime_error);
  CHECK(torch::equal(testing::flat(*model), before));  // the weights were put back
  CHECK(sgd.windows() == 0);
  CHECK(sgd.applied_steps().item<std::int64_t>() == 0);
}

}  // namespace test_resume_changes
