// The memory plan and the out-of-memory replay of tk::fit on the device, for
// gpu_check. Three fits of 3 optimizer steps of bert-tiny (one micro-batch per step, items =
// tokens, pieces = rows):
//   whole     no budget: the reference parameters and the peak of the allocator (CPU: VmHWM)
//   planned   TRAIN.MEMORY_BUDGET of 60% of the whole run's peak (CPU dry run: 150%, where the
//             process's runtime dominates): on CUDA the plan must split the micro-batch and the
//             training's peak stay within the budget
//   replayed  the task's loss throws c10::OutOfMemoryError once, for step 2's whole micro-batch
//             (the test hook): one replay
// Both must end at the whole run's parameters (relative 1e-4 on CUDA, where other shapes may
// pick other kernels; 1e-5 on the CPU) with the same number of applied steps.
#pragma once

#include "harness.hpp"

#include <trainkit/trainkit.hpp>

#include <unistd.h>

#include <ftw.h>

#include <cstdio>
#include <functional>
#include <string>
#include <tuple>
#include <vector>

namespace bench {

struct MemoryFit {
  trainkit::FitResult result;
  torch::Tensor params;  // on the CPU
  double peak_bytes = 0;
  long syncs = 0;  // FitShape::syncs() after the fit less before it
};

/// The epoch and its logging, for gpu_check's count of host syncs per log window.
struct FitShape {
  std::int64_t micro_batches = 3, log_frequent = 50;
  bool write_files = false;
  std::function<long()> syncs;  // a running count of host syncs (optional)
};

inline MemoryFit fit_for_memory(torch::Device device, int64_t rows, int64_t seq, double budget, bool inject_oom,
                                const FitShape& shape = {}) {
  namespace tk = trainkit;
  struct Seqs {
    torch::Tensor ids, target;
  };
  Task model = make_task("bert-tiny", rows, seq, device);
  tk::Trainer<tk::PrecisionPolicy<tk::FP32>, tk::AccumulationPolicy<1>, tk::ClipPolicy<tk::ClipNorm>> trainer(
      model.module, tk::AdamW{1e-3, 1e-2}, tk::TrainerOptions().max_grad_norm(1.0));
  tk::Task<Seqs> task;
  std::int64_t position = -1;
  bool thrown = false;
  task.batches_per_epoch = [n = shape.micro_batches](std::int64_t) { return n; };
  task.batch = [&](std::int64_t, std::int64_t index) {
    position = index;
    const auto& [x, y] = model.pool[static_cast<size_t>(index) % model.pool.size()];
    return Seqs{x, y};
  };
  task.loss = [&](const Seqs& b, tk::Metrics&) {
    if (inject_oom && !thrown && position == 1 && b.ids.size(0) == rows) {
      thrown = true;
      TORCH_CHECK_WITH(OutOfMemoryError, false, "out of memory (gpu_check's test hook)");
    }
    const auto out = model.forward(b.ids);
    return torch::nn::functional::cross_entropy(out.reshape({-1, out.size(-1)}), b.target.reshape({-1}));
  };
  task.items = [](const Seqs& b) { return b.ids.numel(); };
  task.split = [](const Seqs& b, std::int64_t parts) {
    std::vector<Seqs> pieces;
    const auto ids = b.ids.tensor_split(parts), target = b.target.tensor_split(parts);
    for (size_t k = 0; k < ids.size(); ++k) pieces.push_back({ids[k], target[k]});
    return pieces;
  };
  char dir[] = "/tmp/gpu-check-memory-XXXXXX";
  if (!::mkdtemp(dir)) throw std::runtime_error("mkdtemp failed");
  const auto options = tk::FitOptions()
                           .output_path(dir)
                           .end_epoch(1)
                           .seed(1)
                           .progress(false)
                           .write_files(shape.write_files)
                           .log_frequent(shape.log_frequent)
                           .memory_budget(budget);
  tk::PeakMemory peak(device);
  peak.reset();
  MemoryFit f;
  const long syncs_before = shape.syncs ? shape.syncs() : 0;
  f.result = tk::fit(trainer, task, options);
  f.syncs = shape.syncs ? shape.syncs() - syncs_before : 0;
  f.peak_bytes = peak.bytes();  // since the plan's last measurement, or the start
  // POSIX, not std::filesystem::remove_all: libtorch.so exports its own std::filesystem
  // symbols, a program linked against it can bind to them, and that remove_all crashes (as
  // tests/support/helpers.hpp's TempDir says).
  ::nftw(dir, [](const char* path, const struct stat*, int, struct FTW*) { return ::remove(path); }, 16,
         FTW_DEPTH | FTW_PHYS);
  std::vector<torch::Tensor> flat;
  for (const auto& p : model.module->parameters()) flat.push_back(p.detach().reshape({-1}).cpu());
  f.params = torch::cat(flat);
  return f;
}

inline void check_memory(torch::Device device, bool dry, std::vector<std::string>& failed) {
  const int64_t rows = dry ? 8 : 64, seq = dry ? 8 : 64;
  std::printf("\n#### Memory plan and out-of-memory replay (bert-tiny, %lld x %lld tokens per step)\n\n",
              static_cast<long long>(rows), static_cast<long long>(seq));
  const double tolerance = device.is_cuda() ? 1e-4 : 1e-5;
  try {
    const MemoryFit whole = fit_for_memory(device, rows, seq, 0, false);
    const double budget = whole.peak_bytes * (device.is_cuda() ? 0.6 : 1.5);
    const MemoryFit planned = fit_for_memory(device, rows, seq, budget, false);
    const MemoryFit replayed = fit_for_memory(device, rows, seq, 0, true);
    auto rel = [](const torch::Tensor& a, const torch::Tensor& b) { return ((a - b).norm() / b.norm()).item<double>(); };
    const double planned_diff = rel(planned.params, whole.params), replayed_diff = rel(replayed.params, whole.params);
    const int64_t pieces = planned.result.piece_items;
    std::printf("whole: peak %.0f MiB. planned (budget %.0f MiB): %s; training peak %.0f MiB; parameters off by %.2e. "
                "replayed: %lld replay(s), pieces of %lld tokens, parameters off by %.2e\n",
                whole.peak_bytes / 1048576.0, budget / 1048576.0,
                planned.result.plan ? planned.result.plan->text().c_str() : "no plan", planned.peak_bytes / 1048576.0,
                planned_diff, static_cast<long long>(replayed.result.replays),
                static_cast<long long>(replayed.result.piece_items), replayed_diff);
    if (!planned.result.plan) failed.push_back("memory: the planned run has no plan");
    if (device.is_cuda() && !(pieces > 0 && pieces < rows * seq))
      failed.push_back("memory: a budget of 60% of the whole run's peak did not split the micro-batch (pieces of " +
                       std::to_string(pieces) + " tokens)");
    if (device.is_cuda() && planned.peak_bytes > budget)
      failed.push_back("memory: the planned run peaked at " + std::to_string(planned.peak_bytes / 1048576.0) +
                       " MiB, over its budget of " + std::to_string(budget / 1048576.0) + " MiB");
    if (replayed.result.replays != 1) failed.push_back("memory: " + std::to_string(replayed.result.replays) + " replays, not 1");
    for (const auto& [name, r, diff] : {std::tuple{"planned", &planned, planned_diff}, std::tuple{"replayed", &replayed, replayed_diff}}) {
      if (!(diff <= tolerance))
        failed.push_back(std::string("memory: the ") + name + " run's parameters are off the whole run's by " +
                         std::to_string(diff) + " (relative; tolerance " + std::to_string(tolerance) + ")");
      if (r->result.applied_steps != whole.result.applied_steps)
        failed.push_back(std::string("memory: the ") + name + " run applied " + std::to_string(r->result.applied_steps) +
                         " steps, the whole run " + std::to_string(whole.result.applied_steps));
    }
  } catch (const std::exception& e) {
    failed.push_back(std::string("memory: ") + e.what());
  }
}

}  // namespace bench
