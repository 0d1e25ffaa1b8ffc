// The main job (examples/vlbert, the `vlbert` program) data-parallel on the CPU over Gloo, its
// ranks launched as torchrun would (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT):
//   - 2 ranks x micro-batch B train as 1 process x 2B on the same data (parameters, logged losses);
//   - one rank SIGKILLed: the other fails within DIST_TIMEOUT naming it, and a relaunch resumes
//     from the last complete checkpoint to the uninterrupted run's final state, bit for bit;
//   - SIGTERM to one rank: both stop at the same log window, exit 0, and the relaunch resumes
//     exactly;
//   - GPUS that the machine or the launch contradicts is refused, naming GPUS.
#if __has_include(<gloo/algorithm.h>)

#include "../support/helpers.hpp"
#include "../support/processes.hpp"
#include "../support/source_dir.hpp"

#include <nlohmann/json.hpp>
#include <torch/serialize/input-archive.h>

#include <chrono>
#include <cmath>
#include <fstream>
#include <map>
#include <string>
#include <thread>
#include <vector>

#include <signal.h>

namespace test_vlbert_distributed {  // this file's names, apart from those of the files it shares a unity batch with

using namespace trainkit_testing::processes;

namespace {

std::string vlbert_program() { return here() + "/../examples/vlbert/vlbert"; }

// False (said) when the examples are not built (TRAINKIT_BUILD_EXAMPLES=OFF).
bool have_program() {
  if (testing::file_exists(vlbert_program())) return true;
  MESSAGE("skipped: no " << vlbert_program() << " (the examples are not built)");
  return false;
}

// A run small enough for seconds: the shipped config with small data and the given overrides.
std::vector<std::string> vlbert_args(const std::string& task, const std::string& dir, const std::vector<std::string>& sets) {
  std::vector<std::string> a{vlbert_program(), task, "--cfg",
                             (trainkit_testing::source_dir() / "cfgs/vlbert" / task / "base_1x24G_fp32.yaml").string(),
                             "--model-dir", dir};
  for (const std::string s : {"DATASET.TRAIN_SCENES=32", "DATASET.VAL_SCENES=16", "DATASET.QUESTIONS_PER_SCENE=2",
                              "LOG_FREQUENT=1", "DIST_TIMEOUT=15", "TRAIN.WARMUP_STEPS=2", "CHECKPOINT_FREQUENT=1"})
    a.insert(a.end(), {"--set", s});
  for (const auto& s : sets) a.insert(a.end(), {"--set", s});
  return a;
}

// The ranks of one launch, as torchrun starts them; their output in DIR.rank<r>.{out,err}.
std::vector<Child> launch(const std::vector<std::string>& argv, int world, const std::string& logs) {
  const std::string port = std::to_string(free_port());
  std::vector<Child> ranks;
  for (int r = 0; r < world; ++r) {
    std::map<std::string, std::string> vars{{"MASTER_ADDR", "127.0.0.1"}, {"MASTER_PORT", port}};
    if (world > 1)
      vars.insert({{"RANK", std::to_string(r)},
                   {"WORLD_SIZE", std::to_string(world)},
                   {"LOCAL_RANK", std::to_string(r)},
                   {"LOCAL_WORLD_SIZE", std::to_string(world)}});
    ranks.push_back(spawn(argv, vars, logs + ".rank" + std::to_string(r)));
  }
  return ranks;
}

void run_to_end(const std::vector<std::string>& argv, int world, const std::string& logs, double seconds = 300) {
  const auto ranks = launch(argv, world, logs);
  for (const auto& c : ranks) expect_success(c, wait_exit(c, seconds));
}

// The model's tensors of a checkpoint, a file or a set (Trainer::save's "model.param." /
// "model.buffer." records).
std::map<std::string, torch::Tensor> model_tensors(const std::string& path) {
  std::map<std::string, torch::Tensor> out;
  for (auto& [key, t] : testing::checkpoint_tensors(path))
    if (key.rfind("model.", 0) == 0) out[key] = t;
  return out;
}

// The largest difference between two checkpoints' model tensors (which must have the same names).
double max_difference(const std::string& a, const std::string& b) {
  const auto x = model_tensors(a), y = model_tensors(b);
  REQUIRE(x.size() == y.size());
  REQUIRE(x.size() > 10);
  double worst = 0;
  for (const auto& [name, t] : x) {
    REQUIRE_MESSAGE(y.count(name), name << " missing from " << b);
    worst = std::max(worst, (t.to(torch::kDouble) - y.at(name).to(torch::kDouble)).abs().max().item<double>());
  }
  return worst;
}

// The relative L2 distance between two checkpoints' model tensors, over all of them.
double relative_distance(const std::string& a, const std::string& b) {
  const auto x = model_tensors(a), y = model_tensors(b);
  REQUIRE(x.size() == y.size());
  double diff = 0, norm = 0;
  for (const auto& [name, t] : x) {
    REQUIRE_MESSAGE(y.count(name), name << " missing from " << b);
    diff += (t.to(torch::kDouble) - y.at(name).to(torch::kDouble)).square().sum().item<double>();
    norm += y.at(name).to(torch::kDouble).square().sum().item<double>();
  }
  return std::sqrt(diff / norm);
}

// Train-Loss by step from a run's JSON-lines log; a step logged twice fails.
std::map<std::int64_t, double> logged_losses(const std::string& path) {
  std::ifstream in(path);
  REQUIRE_MESSAGE(in.good(), "cannot read " << path);
  std::map<std::int64_t, double> losses;
  for (std::string line; std::getline(in, line);) {
    const auto j = nlohmann::json::parse(line);
    if (j["tag"] != "Train-Loss") continue;
    const auto step = j["step"].get<std::int64_t>();
    REQUIRE_MESSAGE(!losses.count(step), "step " << step << " logged twice in " << path);
    losses[step] = j["value"].get<double>();
  }
  return losses;
}

nlohmann::json result_line(const std::string& out) {
  std::ifstream in(out);
  std::string line, result;
  while (std::getline(in, line))
    if (line.rfind("RESULT ", 0) == 0) result = line.substr(7);
  REQUIRE_MESSAGE(!result.empty(), "no RESULT line in " << out);
  return nlohmann::json::parse(result);
}

// Waits (up to 240 s) until the launch's first checkpoint is written; rank 0's words if never.
void wait_for_first_checkpoint(const std::string& path, const Child& rank0) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(240);
  while (!testing::file_exists(path) && std::chrono::steady_clock::now() < deadline)
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  REQUIRE_MESSAGE(testing::file_exists(path), "no first checkpoint; rank 0 said:\n" << slurp(rank0.err));
}

}  // namespace

TEST_CASE("the main job: 2 ranks x micro-batch B train as 1 process x 2B (FP32, accumulation 2)") {
  if (!have_program()) return;
  testing::TempDir dir;
  // No dropout: 1 x 2B and 2 x B draw different masks. Everything else as shipped.
  const std::vector<std::string> common{"NETWORK.PARTIAL_PRETRAIN=''", "NETWORK.CLASSIFIER_DROPOUT=0",
                                        "NETWORK.VLBERT.hidden_dropout_prob=0", "NETWORK.VLBERT.attention_probs_dropout_prob=0",
                                        "TRAIN.GRAD_ACCUMULATE_STEPS=2", "TRAIN.END_EPOCH=2"};
  auto with = [&](const std::string& batch) {
    auto s = common;
    s.push_back("TRAIN.BATCH_IMAGES=" + batch);
    return s;
  };
  run_to_end(vlbert_args("vqa", dir / "one", with("8")), 1, dir / "one");
  run_to_end(vlbert_args("vqa", dir / "two", with("4")), 2, dir / "two");

  const auto one = result_line(dir / "one.rank0.out"), two = result_line(dir / "two.rank0.out");
  CHECK(two["world_size"] == 2);
  CHECK(one["steps"] == 8);  // 64 questions / (8 x 2) per window x 2 epochs
  CHECK(two["steps"] == one["steps"]);
  CHECK(two["train_samples"] == one["train_samples"]);
  CHECK(slurp(dir / "two.rank1.out").find("RESULT") == std::string::npos);  // the main rank reports

  // The logged losses: every window's, once, equal to float rounding (the sums are reassociated).
  const auto l1 = logged_losses(dir / "one/vl-bert_base_vqa-scalars.jsonl");
  const auto l2 = logged_losses(dir / "two/vl-bert_base_vqa-scalars.jsonl");
  REQUIRE(l1.size() == 8);
  REQUIRE(l2.size() == l1.size());
  for (const auto& [step, loss] : l1) {
    INFO("step " << step << ": 1 x 2B " << loss << ", 2 x B " << l2.at(step));
    CHECK(std::abs(l2.at(step) - loss) <= 1e-5 * std::abs(loss));
  }
  // The parameters after 8 windows.
  const double diff = max_difference(dir / "one/vl-bert_base_vqa-0001.ckpt", dir / "two/vl-bert_base_vqa-0001.ckpt");
  MESSAGE("largest parameter difference, 1 x 2B against 2 x B after 8 windows: " << diff);
  CHECK(diff < 1e-5);
}

// Pre-training on 64 scenes with one TARGET_BATCH of 32, split `sets` ways, on `world` ranks,
// in the directory dir/name (a run there already is resumed: AUTO_RESUME), its output in
// dir/<logs>.rank<r>.*. The epochs' losses it trained (RESULT).
std::vector<double> split_run(const testing::TempDir& dir, const std::string& name, int world, std::vector<std::string> sets,
                              std::string logs = "") {
  if (logs.empty()) logs = name;
  for (const std::string s : {"DATASET.TRAIN_SCENES=64", "TRAIN.TARGET_BATCH=32", "TRAIN.LR_SCHEDULE=constant",
                              "TRAIN.WARMUP_STEPS=1"})
    sets.insert(sets.begin(), s);
  run_to_end(vlbert_args("pretrain", dir / name, sets), world, dir / logs);
  const auto result = result_line(dir / (logs + ".rank0.out"));  // (held: a temporary's element would dangle)
  std::vector<double> losses;
  for (const auto& l : result.at("epoch_loss")) losses.push_back(l.get<double>());
  return losses;
}

TEST_CASE("the main job's objective does not depend on the split: at identical weights the epoch loss of 1 x 32, "
          "4 x 8, pieces, 2 ranks x 2 x 8 (stages 0 and 2), 4 ranks x 2 x 4 agree to 1e-6") {
  if (!have_program()) return;
  testing::TempDir dir;
  // LR 1e-30: the weights stay the initial ones, so every run's epoch loss is the objective over
  // the same 64 scenes with the same masks (they depend on the seed, the epoch and the sample).
  const std::vector<std::string> frozen{"TRAIN.LR=1e-30", "TRAIN.END_EPOCH=1"};
  auto with = [&](std::vector<std::string> more) {
    more.insert(more.end(), frozen.begin(), frozen.end());
    return more;
  };
  const auto whole = split_run(dir, "1x32", 1, with({"TRAIN.GRAD_ACCUMULATE_STEPS=1"}));
  REQUIRE(whole.size() == 1);
  const std::map<std::string, std::vector<double>> splits{
      {"1 x 4 x 8", split_run(dir, "4x8", 1, with({"TRAIN.GRAD_ACCUMULATE_STEPS=4"}))},
      {"1 x 32 as pieces of 5", split_run(dir, "pieces", 1, with({"TRAIN.GRAD_ACCUMULATE_STEPS=1", "TRAIN.PIECE_ITEMS=5"}))},
      {"2 ranks x 2 x 8", split_run(dir, "w2", 2, with({"TRAIN.GRAD_ACCUMULATE_STEPS=2"}))},
      {"2 ranks x 2 x 8, stage 2, pieces of 3",
       split_run(dir, "w2s2", 2, with({"TRAIN.GRAD_ACCUMULATE_STEPS=2", "TRAIN.ZERO_STAGE=2", "TRAIN.PIECE_ITEMS=3"}))},
      {"4 ranks x 2 x 4", split_run(dir, "w4", 4, with({"TRAIN.GRAD_ACCUMULATE_STEPS=2"}))}};
  for (const auto& [name, losses] : splits) {
    INFO(name << ": " << losses.at(0) << ", 1 x 32: " << whole[0]);
    CHECK(std::abs(losses.at(0) - whole[0]) <= 1e-6 * whole[0]);
  }
}

TEST_CASE("the main job trains the same model at 1, 2 and 4 ranks with one TARGET_BATCH (stages 0, 1, 2), and a "
          "2-rank run resumed at 4 ranks goes on as the 2-rank run") {
  if (!have_program()) return;
  testing::TempDir dir;
  const std::vector<std::string> trained{"TRAIN.LR=1e-3", "TRAIN.END_EPOCH=2"};
  auto with = [&](std::vector<std::string> more) {
    more.insert(more.end(), trained.begin(), trained.end());
    return more;
  };
  const auto w2 = split_run(dir, "w2", 2, with({"TRAIN.GRAD_ACCUMULATE_STEPS=2"}));
  REQUIRE(w2.size() == 2);
  const std::string last = "/vl-bert_base_pretrain-0001.ckpt";
  // Not comparing nothing: the second epoch moved the weights and lowered the loss.
  CHECK(relative_distance(dir / ("w2/vl-bert_base_pretrain-0000.ckpt"), dir / ("w2" + last)) > 1e-3);
  CHECK(w2[1] < w2[0] - 0.1);
  struct Run {
    std::string name;
    int world;
    std::vector<std::string> sets;
  };
  for (const Run& run : std::vector<Run>{{"w1", 1, {"TRAIN.GRAD_ACCUMULATE_STEPS=1"}},
                                         {"w4", 4, {"TRAIN.GRAD_ACCUMULATE_STEPS=2"}},
                                         {"w2s2", 2, {"TRAIN.GRAD_ACCUMULATE_STEPS=2", "TRAIN.ZERO_STAGE=2"}},
                                         {"w4s1", 4, {"TRAIN.GRAD_ACCUMULATE_STEPS=2", "TRAIN.ZERO_STAGE=1"}}}) {
    const auto losses = split_run(dir, run.name, run.world, with(run.sets));
    REQUIRE(losses.size() == 2);
    for (size_t e = 0; e < 2; ++e) {
      INFO(run.name << " epoch " << e << ": " << losses[e] << ", 2 ranks: " << w2[e]);
      CHECK(std::abs(losses[e] - w2[e]) <= 1e-5 * w2[e]);
    }
    // AdamW turns the rounding noise of gradients that are 0 in exact arithmetic (the attention
    // keys' biases: softmax ignores a shift) into steps of the LR's size: a few 1e-5 of those.
    const double d = relative_distance(dir / (run.name + last), dir / ("w2" + last));
    MESSAGE(run.name << ": relative L2 distance of the weights from the 2-rank run's after 2 epochs: " << d);
    CHECK(d < 5e-5);
  }
  // Stopped after epoch 0 at 2 ranks, resumed at 4 (the same TARGET_BATCH: the data go on at the
  // checkpoint's position), with stages 0 and 2.
  for (const std::string stage : {"0", "2"}) {
    const std::string name = "w2to4s" + stage;
    const std::vector<std::string> sets{"TRAIN.GRAD_ACCUMULATE_STEPS=2", "TRAIN.ZERO_STAGE=" + stage};
    auto first = with(sets);
    first.push_back("TRAIN.END_EPOCH=1");
    split_run(dir, name, 2, first);
    const auto resumed = split_run(dir, name, 4, with(sets), name + "-resumed");
    const std::string said = slurp(dir / (name + "-resumed.rank0.err"));
    CHECK(said.find("was written by 2 processes, this run has 4") != std::string::npos);
    CHECK(said.find("samples per optimizer step is kept") != std::string::npos);  // (the configuration's total batch)
    REQUIRE(resumed.size() == 1);  // the resumed run trained epoch 1 alone
    INFO("stage " << stage << ": epoch 1 resumed at 4 ranks " << resumed[0] << ", 2 ranks " << w2[1]);
    CHECK(std::abs(resumed[0] - w2[1]) <= 1e-5 * w2[1]);
    const double d = relative_distance(dir / (name + last), dir / ("w2" + last));
    MESSAGE("stage " << stage << ": a 2-rank run resumed at 4 ranks, relative L2 distance from the 2-rank run: " << d);
    CHECK(d < 1e-5);
  }
}

TEST_CASE("FP16 on the CPU is said once per process, with what to use instead; FP32 and BF16 say nothing") {
  if (!have_program()) return;
  testing::TempDir dir;
  split_run(dir, "fp16", 2, {"TRAIN.END_EPOCH=1", "TRAIN.FP16=true"});
  split_run(dir, "bf16", 1, {"TRAIN.END_EPOCH=1", "TRAIN.BF16=true"});
  const std::string warning = "on the CPU: the forward autocasts to float16";
  for (const std::string rank : {"0", "1"}) {
    const std::string said = slurp(dir / ("fp16.rank" + rank + ".err"));
    INFO(said);
    const auto at = said.find(warning);
    CHECK(at != std::string::npos);
    CHECK(said.find(warning, at + 1) == std::string::npos);  // once
    CHECK(said.find("train in FP32, or BF16") != std::string::npos);
  }
  CHECK(slurp(dir / "bf16.rank0.err").find(warning) == std::string::npos);
}

TEST_CASE("the main job run again after it finished trains nothing and reports the last epoch's figures") {
  if (!have_program()) return;
  testing::TempDir dir;
  const auto first = split_run(dir, "run", 2, {"TRAIN.END_EPOCH=1"});
  const auto again = split_run(dir, "run", 2, {"TRAIN.END_EPOCH=1"}, "again");
  CHECK(slurp(dir / "again.rank0.err").find("nothing to train") != std::string::npos);
  REQUIRE(first.size() == 1);
  CHECK(again == first);  // from the checkpoint, as the first run reported it
  const auto a = result_line(dir / "run.rank0.out"), b = result_line(dir / "again.rank0.out");
  REQUIRE(a["val"].contains("MLM-Acc"));
  CHECK(b["val"] == a["val"]);
  CHECK(b["steps"] == a["steps"]);
}

TEST_CASE("the main job with TRAIN.ZERO_STAGE 2 and TRAIN.MEMORY_BUDGET plans and trains on 2 and 3 ranks") {
  if (!have_program()) return;
  testing::TempDir dir;
  // The plan's measuring backward used to write into the gradient that stage 2 releases between
  // windows: SIGSEGV on every rank. (The budget is the machine's memory: the plan runs whole
  // micro-batches; what matters is that it measures.)
  for (const int world : {2, 3}) {
    CAPTURE(world);
    const std::string name = "w" + std::to_string(world);
    const auto losses = split_run(dir, name, world, {"TRAIN.ZERO_STAGE=2", "TRAIN.MEMORY_BUDGET=0.9", "TRAIN.END_EPOCH=1",
                                                     "TRAIN.TARGET_BATCH=" + std::to_string(8 * world)});
    REQUIRE(losses.size() == 1);
    CHECK(std::isfinite(losses[0]));
    CHECK(slurp(dir / (name + ".rank0.err")).find("trainkit: memory plan: budget") != std::string::npos);
  }
}

TEST_CASE("the main job: a SIGKILLed rank stops the other within DIST_TIMEOUT, and the relaunch resumes exactly") {
  if (!have_program()) return;
  testing::TempDir dir;
  // Pre-training with dropout (each rank's masks seeded per micro-batch; the shipped config has
  // none): 3 epochs, a checkpoint after each.
  const std::vector<std::string> sets{"TRAIN.BATCH_IMAGES=4", "TRAIN.END_EPOCH=3", "DATASET.TRAIN_SCENES=48",
                                      "NETWORK.VLBERT.hidden_dropout_prob=0.1",
                                      "NETWORK.VLBERT.attention_probs_dropout_prob=0.1"};
  run_to_end(vlbert_args("pretrain", dir / "whole", sets), 2, dir / "whole");

  const auto ranks = launch(vlbert_args("pretrain", dir / "cut", sets), 2, dir / "cut");
  wait_for_first_checkpoint(dir / "cut/vl-bert_base_pretrain-0000.ckpt", ranks[0]);
  ::kill(ranks[1].pid, SIGKILL);
  const auto killed = std::chrono::steady_clock::now();
  CHECK(wait_exit(ranks[1], 30) == 128 + SIGKILL);
  const int status = wait_exit(ranks[0], 15 + 30);  // DIST_TIMEOUT, and slack for a busy machine
  const double took = std::chrono::duration<double>(std::chrono::steady_clock::now() - killed).count();
  const std::string said = slurp(ranks[0].err);
  INFO("rank 0 exited with " << status << " after " << took << " s and said:\n" << said);
  CHECK(status == 1);
  CHECK(took < 15 + 30);
  CHECK(said.find("error (rank 0 of 2): trainkit: rank 0 of 2") != std::string::npos);
  CHECK(said.find("rank 1") != std::string::npos);

  // The relaunch resumes from the last complete checkpoint (auto-resume) and ends where the
  // uninterrupted run ended.
  run_to_end(vlbert_args("pretrain", dir / "cut", sets), 2, dir / "resumed");
  CHECK(slurp(dir / "resumed.rank0.err").find("resum") != std::string::npos);
  CHECK(max_difference(dir / "whole/vl-bert_base_pretrain-0002.ckpt", dir / "cut/vl-bert_base_pretrain-0002.ckpt") == 0.0);
}

TEST_CASE("the main job: SIGTERM to one rank stops both at the same log window; the relaunch resumes exactly") {
  if (!have_program()) return;
  testing::TempDir dir;
  // The ranks agree on a stop at log windows (every 2 optimizer steps here), in the collective
  // that logging does anyway.
  const std::vector<std::string> sets{"TRAIN.BATCH_IMAGES=4", "TRAIN.END_EPOCH=3", "DATASET.TRAIN_SCENES=48",
                                      "LOG_FREQUENT=2", "NETWORK.VLBERT.hidden_dropout_prob=0.1",
                                      "NETWORK.VLBERT.attention_probs_dropout_prob=0.1"};
  run_to_end(vlbert_args("pretrain", dir / "whole", sets), 2, dir / "whole");

  const auto ranks = launch(vlbert_args("pretrain", dir / "cut", sets), 2, dir / "cut");
  wait_for_first_checkpoint(dir / "cut/vl-bert_base_pretrain-0000.ckpt", ranks[0]);
  ::kill(ranks[1].pid, SIGTERM);  // rank 1 only: rank 0 learns it at the next log window
  const int status0 = wait_exit(ranks[0], 120), status1 = wait_exit(ranks[1], 120);
  const std::string said0 = slurp(ranks[0].err), said1 = slurp(ranks[1].err);
  INFO("rank 0 (" << status0 << ") said:\n" << said0 << "\nrank 1 (" << status1 << ") said:\n" << said1);
  CHECK(status0 == 0);
  CHECK(status1 == 0);
  CHECK(said1.find("stop requested") != std::string::npos);
  CHECK(said0.find("trainkit: stopped at epoch") != std::string::npos);
  CHECK_FALSE(testing::file_exists(dir / "cut/vl-bert_base_pretrain-0002.ckpt"));  // it did stop early

  run_to_end(vlbert_args("pretrain", dir / "cut", sets), 2, dir / "resumed");
  CHECK(slurp(dir / "resumed.rank0.err").find("resum") != std::string::npos);
  CHECK(max_difference(dir / "whole/vl-bert_base_pretrain-0002.ckpt", dir / "cut/vl-bert_base_pretrain-0002.ckpt") == 0.0);
  // Each (step, tag) once in the log of the stopped and resumed run.
  CHECK(logged_losses(dir / "cut/vl-bert_base_pretrain-scalars.jsonl") ==
        logged_losses(dir / "whole/vl-bert_base_pretrain-scalars.jsonl"));
}

// One process of the main job with `set`: it must exit 2 without writing a checkpoint; returns
// what it printed on stderr.
static std::string refused(const std::string& set) {
  testing::TempDir dir;
  const auto one = launch(vlbert_args("pretrain", dir / "run", {set}), 1, dir / "one");
  CHECK(wait_exit(one[0], 120) == 2);
  CHECK_FALSE(testing::file_exists(dir / "run/vl-bert_base_pretrain-0000.ckpt"));
  return slurp(dir / "one.rank0.err");
}

TEST_CASE("the main job refuses a section it does not know (a misspelt TRAIN)") {
  if (!have_program()) return;
  const std::string said = refused("TRAINING.END_EPOCH=1");
  INFO(said);
  CHECK(said.find("error: TRAINING: unknown section") != std::string::npos);
}

TEST_CASE("the main job refuses a configuration that trains no epoch (an empty file's END_EPOCH 0), exit 2") {
  if (!have_program()) return;
  const std::string said = refused("TRAIN.END_EPOCH=0");
  INFO(said);
  CHECK(said.find("error: TRAIN.END_EPOCH: must be > TRAIN.BEGIN_EPOCH (0) to train, got 0") != std::string::npos);
}

TEST_CASE("the main job refuses GPUS that the machine or the launch contradicts, naming GPUS") {
  if (!have_program()) return;
  const std::string said = refused("GPUS=0,1");
  INFO(said);
  // No CUDA here: the ids are refused; with CUDA, two devices for one process are.
  CHECK(said.find("error: GPUS: lists") != std::string::npos);
}

}  // namespace test_vlbert_distributed

#endif
