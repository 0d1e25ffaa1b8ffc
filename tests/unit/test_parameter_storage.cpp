// Parameters replaced after the trainer is built: torch::load(model, file)
// swaps each parameter's storage, and the trainer would go on updating its own copy while the
// model reads the loaded one (before: 50 windows, no change, no error). The next optimizer
// phase refuses, naming the parameter and what to do; copying loads (tk::load_weights,
// Trainer::load) keep working.
#include "../support/helpers.hpp"

#include <trainkit/trainer/trainer.hpp>
#include <trainkit/io/weights.hpp>

#include <torch/serialize.h>

#include <cstdint>
#include <fstream>
#include <string>

namespace test_parameter_storage {  // this file's names, apart from those of the files it shares a unity batch with

TEST_CASE("torch::load after the trainer is built is refused at the next optimizer phase, naming the parameter") {
  testing::TempDir dir;
  auto source = testing::make_mlp(11);
  torch::save(source, dir / "weights.pt");

  auto model = testing::make_mlp(12);
  tk::Trainer<> trainer(model, tk::SGD{0.1});
  const auto data = testing::regression(16);
  auto loss = [&] { return torch::mse_loss(model(data.x), data.y); };
  trainer.micro_step(loss);  // the storage contract holds
  torch::load(model, dir / "weights.pt");
  CHECK_THROWS_WITH_AS(trainer.micro_step(loss), doctest::Contains("no longer lives in the trainer's storage"),
                       std::logic_error);
  CHECK(trainer.windows() == 1);  // nothing applied after the replacement
}

TEST_CASE("loading by copy after the trainer is built keeps training the model") {
  testing::TempDir dir;
  auto source = testing::make_mlp(11);
  tk::Trainer<> writer(source, tk::SGD{0.1});
  writer.save(dir / "source.ckpt");

  auto model = testing::make_mlp(12);
  tk::Trainer<> trainer(model, tk::SGD{0.1});
  const auto report = tk::load_weights(*model, dir / "source.ckpt");
  CHECK(report.not_loaded.empty());
  const auto data = testing::regression(16);
  const auto before = testing::flat(*model);
  trainer.micro_step([&] { return torch::mse_loss(model(data.x), data.y); });
  CHECK_FALSE(torch::equal(testing::flat(*model), before));  // the update reached the model
}

// --- The flat layout ------------------------------------------------------------------------------
// Every parameter starts 64-byte aligned in the flat storage (an odd-sized tensor would
// otherwise misalign every later view; CUDA's vectorised kernels and cuBLAS want aligned
// operands); the gaps are zeros; checkpoints hold the parameters packed, as before.

TEST_CASE("FlatLayout: aligned offsets, packed records, group slices") {
  tk::detail::FlatLayout layout(16);
  CHECK(layout.add(5) == 0);
  CHECK(layout.add(16) == 16);
  CHECK(layout.add(3) == 32);
  CHECK(layout.packed() == 24);
  CHECK(layout.padded() == 48);
  const auto flat = torch::zeros({48});
  const auto values = torch::arange(1, 25, torch::kFloat);
  layout.unpack_into(values, flat, "test");
  CHECK(flat[4].item<float>() == 5);
  CHECK(flat[5].item<float>() == 0);  // a gap
  CHECK(flat[16].item<float>() == 6);
  CHECK(flat[32].item<float>() == 22);
  CHECK(torch::equal(layout.pack(flat), values));
  const auto group = layout.slice(16, 35);  // the second and third parameters
  CHECK(group.packed() == 19);
  CHECK(torch::equal(group.pack(flat.narrow(0, 16, 19)), values.narrow(0, 5, 19)));
  CHECK_THROWS_WITH(layout.unpack_into(torch::zeros({23}), flat, "record 'x'"),
                    doctest::Contains("record 'x' has shape [23], this run needs [24]"));
}

namespace {
// Odd sizes everywhere: fc1 7x5 = 35, bias 7, fc2 3x7 = 21, bias 3.
testing::TinyMlp odd_mlp(std::uint64_t seed) { return testing::make_mlp(seed, 5, 7, 3); }

void check_aligned(torch::nn::Module& model) {
  for (const auto& p : model.named_parameters()) {
    CAPTURE(p.key());
    CHECK(reinterpret_cast<std::uintptr_t>(p.value().data_ptr()) % 64 == 0);
    CHECK(reinterpret_cast<std::uintptr_t>(p.value().grad().data_ptr()) % 64 == 0);
  }
}
// The gaps of a flat tensor: its elements minus the packed ones.
torch::Tensor gaps(const tk::detail::FlatLayout& layout, const torch::Tensor& flat) {
  auto copy = flat.clone();
  layout.unpack_into(torch::zeros({layout.packed()}, flat.options()), copy, "test");
  return copy;  // zero where the parameters are, the gaps' values elsewhere
}
}  // namespace

TEST_CASE("every parameter and gradient starts 64-byte aligned; the gaps stay zero through training") {
  auto model = odd_mlp(3);
  tk::Trainer<tk::PrecisionPolicy<tk::FP32>, tk::AccumulationPolicy<2>> trainer(model, tk::AdamW{1e-2});
  check_aligned(*model);
  CHECK(trainer.parameter_count() == 35 + 7 + 21 + 3);
  CHECK(trainer.parameters().numel() > trainer.parameter_count());
  const auto data = testing::regression(16, 5, 3);
  for (int i = 0; i < 6; ++i) trainer.micro_step([&] { return torch::mse_loss(model(data.x), data.y); });
  CHECK(trainer.applied_steps().item<std::int64_t>() == 3);
  CHECK(gaps(trainer.layout(), trainer.parameters()).abs().sum().item<double>() == 0.0);
  auto& rule = dynamic_cast<tk::detail::FusedAdam<tk::AdamW, true>&>(trainer.update_rule());
  for (size_t g = 0; g < trainer.groups().size(); ++g)
    CHECK(gaps(trainer.groups()[g].layout, rule.exp_avg_sq()[g]).abs().sum().item<double>() == 0.0);
  // The model still reads what the trainer updates.
  CHECK(torch::equal(testing::flat(*model), trainer.layout().pack(trainer.parameters())));
}

TEST_CASE("master weights: the half parameters and gradients are 64-byte aligned too") {
  auto model = odd_mlp(3);
  tk::Trainer<tk::PrecisionPolicy<tk::MasterWeights<tk::BF16>>> trainer(model, tk::AdamW{1e-2});
  check_aligned(*model);
  CHECK(trainer.storage().half_parameters().numel() == trainer.parameters().numel());
}

TEST_CASE("checkpoints hold the flat records packed: a window's gradient and the optimizer state") {
  testing::TempDir dir;
  const auto data = testing::regression(16, 5, 3);
  auto model = odd_mlp(4);
  tk::Trainer<tk::PrecisionPolicy<tk::FP32>, tk::AccumulationPolicy<2>> trainer(
      model, tk::AdamW{1e-2}, tk::TrainerOptions().lr_mult({{"fc2", 0.5}}));
  for (int i = 0; i < 3; ++i) trainer.micro_step([&] { return torch::mse_loss(model(data.x), data.y); });
  REQUIRE(trainer.window_position() == 1);
  trainer.save(dir / "mid.ckpt");
  torch::serialize::InputArchive archive;
  archive.load_from(dir / "mid.ckpt");
  CHECK(tk::detail::read_tensor(archive, "window.gradient").numel() == trainer.parameter_count());
  REQUIRE(trainer.groups().size() == 2);
  // The optimizer's state by parameter name, with the parameters' shapes (no layout, no gaps).
  std::int64_t state = 0;
  for (const auto& p : model->named_parameters()) {
    CHECK(tk::detail::read_tensor(archive, "optim.exp_avg." + p.key()).sizes() == p.value().sizes());
    state += tk::detail::read_tensor(archive, "optim.exp_avg_sq." + p.key()).numel();
  }
  CHECK(state == 35 + 7 + 21 + 3);
  // And they come back: a resumed trainer goes on exactly as this one.
  auto other = odd_mlp(5);
  tk::Trainer<tk::PrecisionPolicy<tk::FP32>, tk::AccumulationPolicy<2>> resumed(
      other, tk::AdamW{1e-2}, tk::TrainerOptions().lr_mult({{"fc2", 0.5}}));
  resumed.load(dir / "mid.ckpt");
  for (int i = 0; i < 5; ++i) {
    trainer.micro_step([&] { return torch::mse_loss(model(data.x), data.y); });
    resumed.micro_step([&] { return torch::mse_loss(other(data.x), data.y); });
  }
  CHECK(torch::equal(trainer.parameters(), resumed.parameters()));
}

#if defined(__linux__)
namespace {
// The process's peak resident set since the last reset (Linux: VmHWM; clear_refs 5 resets it).
std::int64_t peak_resident_bytes() {
  std::ifstream status("/proc/self/status");
  for (std::string line; std::getline(status, line);)
    if (line.rfind("VmHWM:", 0) == 0) return std::stoll(line.substr(6)) * 1024;
  return -1;
}
bool reset_peak_resident() { return static_cast<bool>(std::ofstream("/proc/self/clear_refs") << "5"); }
}  // namespace

TEST_CASE("construction holds the parameters at most twice: the gradients come after the old storage is released") {
  // Two 64 MiB parameters (each above glibc's mmap threshold, so freed memory leaves the process
  // at once). Before: the gradients were allocated before the parameters moved, a peak of
  // 1.5x the model on top of it; now the steady state (parameters + gradients) is the peak.
  struct Big : torch::nn::Module {
    Big() {
      a = register_parameter("a", torch::ones({4096, 4096}));
      b = register_parameter("b", torch::ones({4096, 4096}));
    }
    torch::Tensor a, b;
  };
  auto model = std::make_shared<Big>();
  const double bytes = 2.0 * 4096 * 4096 * 4;
  if (!reset_peak_resident()) {
    MESSAGE("skipped: /proc/self/clear_refs cannot be written here");
    return;
  }
  const auto before = peak_resident_bytes();
  tk::Trainer<> trainer(model, tk::SGD{0.1});  // no optimizer state
  const double rise = static_cast<double>(peak_resident_bytes() - before) / bytes;
  MESSAGE("construction's peak rise: " << rise << " x the parameters' bytes");
  CHECK(rise < 1.2);
  CHECK(trainer.gradients().numel() >= 2 * 4096 * 4096);
}
#endif

TEST_CASE("overlap: buckets launch in the order the backward completes them, a bucket of every layer's biases last") {
  // Four layers' weights (32 elements each) then their biases (16 each), as TRAIN.NO_DECAY
  // groups them: buckets of 32 elements hold w0, w1, w2, w3, (b0, b1), (b2, b3). The model's
  // order is w0 b0 w1 b1 w2 b2 w3 b3, and a backward delivers it in reverse.
  const std::vector<tk::detail::Range> ranges{{0, 32}, {32, 32}, {64, 32}, {96, 32}, {128, 16}, {144, 16}, {160, 16}, {176, 16}};
  const std::vector<std::int64_t> order{0, 2, 4, 6, 1, 3, 5, 7};  // each range's place in the model
  const tk::detail::Partition partition(192, 32, 16, 2, 0, /*sharded=*/true);
  REQUIRE(partition.buckets() == 6);
  tk::detail::Readiness readiness(ranges, order, {"w0", "w1", "w2", "w3", "b0", "b1", "b2", "b3"}, partition);
  CHECK(readiness.launch_order() == std::vector<std::int64_t>{3, 5, 2, 1, 4, 0});
  struct Recorder final : tk::Reduction {
    std::vector<std::int64_t> launched;
    void launch(std::int64_t b) override { launched.push_back(b); }
    tk::GradientFactor finish() override { return {}; }
  } reduction;
  readiness.arm(reduction);
  // b3, w3, b2, w2, b1, w1, b0, w0 (ranges 7, 3, 6, 2, 5, 1, 4, 0).
  const std::vector<std::vector<std::int64_t>> after{{}, {3}, {3, 5}, {3, 5, 2}, {3, 5, 2}, {3, 5, 2, 1}, {3, 5, 2, 1, 4},
                                                     {3, 5, 2, 1, 4, 0}};
  const std::vector<size_t> arrivals{7, 3, 6, 2, 5, 1, 4, 0};
  for (size_t k = 0; k < arrivals.size(); ++k) {
    readiness.ready(arrivals[k]);
    CAPTURE(k);
    CHECK(reduction.launched == after[k]);
  }
  // Every launch but the one the last gradient made overlapped the backward. (Launched from
  // the top down, the biases' bucket 5 would have held back every bucket below it until b2,
  // and bucket 4 until b0: nothing but 5 before the backward's second half.)
  CHECK(readiness.overlapped() == 5);

  // A backward in which w0 and b0 get no gradient: the rest is launched when it ends, in the
  // same order, so every rank's launches are one sequence.
  Recorder partial;
  readiness.arm(partial);
  for (const size_t i : {7, 3, 6, 2, 5, 1}) readiness.ready(i);
  CHECK(partial.launched == std::vector<std::int64_t>{3, 5, 2, 1});
  readiness.launch_rest();
  CHECK(partial.launched == std::vector<std::int64_t>{3, 5, 2, 1, 4, 0});
}

}  // namespace test_parameter_storage
