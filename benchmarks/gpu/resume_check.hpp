// The resume check of gpu_check and nccl_startup: a run of 12 optimizer steps against one that
// saves after step 6, and a fresh model and trainer that load that checkpoint and run steps
// 7-12. The losses of steps 7-12 and the final parameters must be the uninterrupted run's.
#pragma once

#include "harness.hpp"

#include <trainkit/trainkit.hpp>

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

namespace bench {

struct ResumeResult {
  std::vector<double> uninterrupted;  ///< the losses of all 12 steps, uninterrupted
  std::vector<double> resumed;        ///< steps 7-12 after the save and load
  double loss_diff = 0.0;             ///< max |difference| over steps 7-12
  double param_diff = 0.0;            ///< max |difference| of the final parameters
  bool bit_equal() const { return loss_diff == 0.0 && param_diff == 0.0; }
};

struct ResumeSettings {
  std::string model = "bert-tiny";
  int64_t micro_batch = 8, seq = 32;
  torch::Device device = torch::kCPU;
  int64_t accumulation = 2;  ///< micro-batches per step (the trainer's accumulation_steps)
  bool items = false;        ///< pass each micro-batch's item count (its tokens) to micro_step
  std::string tag;           ///< names the checkpoint file
};

/// `make(task)` returns a std::unique_ptr<Trainer> over task.module (set_replicas done, where
/// the check is data parallel). Steps 1-6, the save, the load and steps 7-12 use fresh tasks
/// (the same initial weights and batches) and fresh trainers, as a restarted job does.
template <class Make>
ResumeResult check_resume(const ResumeSettings& s, Make&& make) {
  const auto path = (std::filesystem::temp_directory_path() /
                     ("trainkit_resume_" + s.tag + "_" + std::to_string(::getpid()) + ".pt"))
                        .string();
  constexpr int64_t kSteps = 12, kSaveAfter = 6;
  auto run = [&](int64_t from, int64_t to, bool load, bool save, torch::Tensor& params) {
    auto task = make_task(s.model, s.micro_batch, s.seq, s.device);
    auto trainer = make(task);
    if (load) trainer->load(path);
    std::vector<double> losses;
    int64_t k = from * s.accumulation;
    const int64_t items = s.micro_batch * s.seq;
    while (static_cast<int64_t>(losses.size()) < to - from) {
      auto closure = [&] { return task.loss(k++); };
      auto r = s.items ? trainer->micro_step(closure, items) : trainer->micro_step(closure);
      if (r.window_closed) losses.push_back(r.report.loss());
    }
    if (save) trainer->save(path);
    params = trainer->parameters().detach().to(torch::kCPU, /*non_blocking=*/false, /*copy=*/true);
    return losses;
  };
  ResumeResult out;
  torch::Tensor full_params, first_params, resumed_params;
  out.uninterrupted = run(0, kSteps, false, false, full_params);
  run(0, kSaveAfter, false, true, first_params);
  out.resumed = run(kSaveAfter, kSteps, true, false, resumed_params);
  std::filesystem::remove(path);
  for (int64_t i = 0; i < kSteps - kSaveAfter; ++i)
    out.loss_diff = std::max(out.loss_diff, std::abs(out.resumed[i] - out.uninterrupted[kSaveAfter + i]));
  out.param_diff = (resumed_params - full_params).abs().max().item<double>();
  return out;
}

/// One line for the report, and a failure (appended to `failed`) when steps 7-12 differ from
/// the uninterrupted run's by more than `tolerance` (relative, on the losses; absolute on the
/// parameters), or a loss is not finite.
inline void report_resume(const std::string& row, const ResumeResult& r, double tolerance,
                          std::vector<std::string>& failed) {
  const double scale = std::max(1e-30, std::abs(r.uninterrupted.back()));
  std::printf("- %s: save after step 6, load into a fresh trainer: steps 7-12 losses %.6f .. %.6f, "
              "max |difference| from the uninterrupted run: losses %.3g, parameters %.3g (%s)\n",
              row.c_str(), r.resumed.front(), r.resumed.back(), r.loss_diff, r.param_diff,
              r.bit_equal() ? "bit-equal" : "not bit-equal");
  std::fflush(stdout);
  bool finite = true;
  for (double l : r.resumed) finite = finite && std::isfinite(l);
  if (!finite) failed.push_back(row + ": a resumed loss is not finite");
  if (!(r.loss_diff <= tolerance * scale) || !(r.param_diff <= tolerance))
    failed.push_back(row + ": the resumed steps 7-12 differ from the uninterrupted run's (losses " +
                     std::to_string(r.loss_diff) + ", parameters " + std::to_string(r.param_diff) + ")");
}

}  // namespace bench
