#pragma once
// What every C++ implementation in the comparison shares: the settings of one run, the timing
// of windows and of the optimizer phase, peak resident memory, and the copy bandwidth the
// optimizer phase's floor is measured against. One process runs one implementation on one
// configuration (so that its peak memory is its own); driver.py interleaves the processes.
#include "models.hpp"

#include <ATen/record_function.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/torch.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <functional>
#include <string>
#include <vector>

namespace bench {

struct Settings {
  std::string impl = "trainkit";  ///< trainkit | branching | libtorch | fwdbwd
  std::string model = "bert-tiny";
  std::string precision = "fp32";  ///< fp32 | bf16 | fp16 (FP16 with dynamic loss scaling)
  int64_t accum = 1;
  int64_t micro_batch = 0;  ///< 0: the model's default
  int64_t seq = 0;          ///< tokens per sequence (BERT); 0: the model's
  int64_t windows = 5, warmup = 2;
  int threads = 2;
  double lr = 1e-4, weight_decay = 1e-2, max_norm = 1.0;
  torch::Device device = torch::kCPU;
  /// Time the optimizer phase (on CUDA this costs one device sync per window).
  bool time_phase = true;
  /// Called inside each timed window, after its start and before its end is synchronised
  /// (true at the start, false at the end): what the window itself does lies in between.
  std::function<void(bool)> on_window;
  /// Called after each window, outside its timing (true once the warm-up is over).
  std::function<void(bool)> after_window;
  /// trainkit: after each window, time one window's forward + backward alone in the same
  /// process (Result::fwdbwd_ms), then zero the gradients again: the limit measured in
  /// alternation with the windows it bounds, so that a change of load hits both alike.
  bool interleave_fwdbwd = false;
  /// libtorch: zero_grad(set_to_none=false), the gradients kept allocated between windows as
  /// trainkit's flat gradient (and DDP's buckets) are: the like-for-like memory comparison.
  bool keep_grads = false;
};

inline double now_ms() {
  return std::chrono::duration<double, std::milli>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

inline double median(std::vector<double> v) {
  if (v.empty()) return 0.0;
  std::sort(v.begin(), v.end());
  const auto n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

inline void synchronize(const torch::Device& device) {
  if (device.is_cuda()) torch::cuda::synchronize();
}

/// ATen operator calls made at the top level (not those an operator makes itself), counted
/// once count_ops() has installed its RecordFunction callbacks (which cost ~0.1 us per call, so
/// runs that count are not the runs that time).
inline std::atomic<int64_t> top_level_ops{0};
inline thread_local int64_t op_depth = 0;
/// With TRAINKIT_BENCH_OP_NAMES set, each counted call's name goes to stderr too, and the
/// phase's start is marked "-- phase --" (to list what a phase calls).
inline const bool print_op_names = std::getenv("TRAINKIT_BENCH_OP_NAMES") != nullptr;
inline void count_ops() {
  at::addGlobalCallback(
      at::RecordFunctionCallback(
          [](const at::RecordFunction& fn) -> std::unique_ptr<at::ObserverContext> {
            if (op_depth++ == 0) {
              ++top_level_ops;
              if (print_op_names) std::fprintf(stderr, "op %s\n", fn.name());
            }
            return nullptr;
          },
          [](const at::RecordFunction&, at::ObserverContext*) { --op_depth; })
          .scopes({at::RecordScope::FUNCTION}));
}

/// Where the optimizer phase began: when the window's last backward ended, and the operator
/// count then.
struct PhaseStart {
  double ms = 0;
  int64_t ops = 0;
  void mark() {
    if (print_op_names) std::fprintf(stderr, "-- phase --\n");
    ms = now_ms();
    ops = top_level_ops;
  }
};

/// The per-window figures of one run. `losses` are read after the timed loop (reading one
/// inside it would add a sync to implementations that do not need one).
struct Result {
  std::vector<double> window_ms, phase_ms, phase_ops;
  std::vector<double> fwdbwd_ms;  ///< with Settings::interleave_fwdbwd: one per timed window
  std::vector<std::function<double()>> losses;
  int64_t skipped = 0;  ///< skipped (overflowing) optimizer steps, counted at the end
};

/// Called from the closure on the loss of a micro-step: when the backward that starts from it
/// has finished (every gradient accumulated), `*t` gets the time. This is how the optimizer
/// phase of a trainer, which runs inside micro_step, is timed from outside it.
inline torch::Tensor stamp_backward_end(torch::Tensor loss, PhaseStart* start, torch::Device device) {
  loss.register_hook([start, device](const torch::Tensor&) {
    torch::autograd::Engine::get_default_engine().queue_callback([start, device] {
      synchronize(device);
      start->mark();
    });
  });
  return loss;
}

/// Runs settings.warmup + settings.windows windows; `window(phase_start)` runs one window (its
/// micro-steps and the optimizer phase), marks phase_start when the last backward finished,
/// and returns how to read the window's loss later.
template <class Window>
Result measure(const Settings& s, Window&& window) {
  Result r;
  for (int64_t w = 0; w < s.warmup + s.windows; ++w) {
    synchronize(s.device);
    PhaseStart phase;
    const double t0 = now_ms();
    if (s.on_window) s.on_window(true);
    auto loss = window(phase);
    if (s.on_window) s.on_window(false);
    synchronize(s.device);
    const double t1 = now_ms();
    const int64_t ops = top_level_ops;
    r.losses.push_back(std::move(loss));
    if (s.after_window) s.after_window(w >= s.warmup);
    if (w < s.warmup) continue;
    r.window_ms.push_back(t1 - t0);
    if (s.time_phase) {
      r.phase_ms.push_back(t1 - phase.ms);
      r.phase_ops.push_back(static_cast<double>(ops - phase.ops));
    }
  }
  return r;
}

/// Peak (VmHWM) or current (VmRSS) resident memory of this process, in KiB.
inline int64_t status_kib(const std::string& field) {
  std::ifstream in("/proc/self/status");
  std::string line;
  while (std::getline(in, line))
    if (line.rfind(field + ":", 0) == 0) return std::stoll(line.substr(field.size() + 1));
  return -1;
}

/// Copy bandwidth over n floats (8 bytes moved per element), GB/s, median of `reps` copies.
inline double copy_bandwidth_gbs(int64_t n, torch::Device device, int reps = 11) {
  auto src = torch::randn({n}, torch::dtype(torch::kFloat).device(device));
  auto dst = torch::empty_like(src);
  std::vector<double> ms;
  for (int i = 0; i < reps + 2; ++i) {
    synchronize(device);
    const double t0 = now_ms();
    dst.copy_(src);
    synchronize(device);
    if (i >= 2) ms.push_back(now_ms() - t0);
  }
  return 8.0 * n / median(ms) / 1e6;
}

/// The optimizer phase must at least read p, g, m, v and write p, m, v (AdamW, fp32), and zero
/// g: 8 x 4 bytes per parameter. (A global norm for clipping needs one more read of g, 36 B,
/// which is what a two-pass phase like trainkit's can reach at best.)
constexpr double kFloorBytesPerParameter = 32.0;

// The implementations (run_trainkit.cpp, run_baselines.cpp).
Result run_trainkit(const Settings& s, Task& task);
Result run_branching(const Settings& s, Task& task);
Result run_libtorch(const Settings& s, Task& task);
/// The window's micro-steps alone (forward, loss / N, backward; no optimizer phase): with the
/// floor, the limit a window can reach.
Result run_fwdbwd(const Settings& s, Task& task);
/// One window of run_fwdbwd (micro-batches k, k + 1, ...; k advances); returns the window's loss.
torch::Tensor fwdbwd_window(const Settings& s, Task& task, int64_t& k);
/// One at::_fused_adamw_ step over n fp32 parameters in one flat tensor, plus zeroing the
/// gradient, ms, median of `reps`: the update and zeroing as the kernel does them, next to the
/// floor (kFloorBytesPerParameter over the copy bandwidth).
double fused_adamw_ms(int64_t n, torch::Device device, int reps = 11);

inline std::string json_list(const std::vector<double>& v, int digits = 4) {
  std::string out = "[";
  char buf[48];
  for (size_t i = 0; i < v.size(); ++i) {
    std::snprintf(buf, sizeof buf, "%s%.*f", i ? ", " : "", digits, v[i]);
    out += buf;
  }
  return out + "]";
}

}  // namespace bench
