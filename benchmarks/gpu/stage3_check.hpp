// Step 6 of nccl_startup: ZeRO stage 3 at world size 1 cut as a sharded run, in half precision,
// against the memory prediction and with a checkpoint set written in the background.
//   - MasterWeights<FP16Dynamic> (half units gathered from half copies) and BF16 (autocast's half
//     copies of fp32 units): the device allocator's peak over a micro-batch that does not close
//     its window (forward and backward; the update apart; from the second window on), above what
//     was allocated before it,
//     against the prediction's in-step terms (HeldBytes::gathered, unit_gradients, autocast) and
//     the activations; the memory held between steps against HeldBytes::total();
//   - the collectives of one window counted: every unit all-gathered for each micro-batch's
//     forward and again for its backward (but the last, kept into it), and reduce-scattered once
//     per micro-batch;
//   - a checkpoint set written in the background (the pause, the time save_in_background takes,
//     against the write), loaded into a fresh trainer (through the page-locked slots on a GPU),
//     and the next window's loss and the state bit-equal to the uninterrupted run's.
// On the CPU (--dry-run, Gloo) the same code runs, with the allocator's assertions left out (its
// peak is the process's).
#pragma once

#include "harness.hpp"
#include "../../tests/support/counting_backend.hpp"

#include <trainkit/parallel/data_parallel.hpp>
#include <trainkit/trainkit.hpp>
#include <trainkit/trainer/unit.hpp>

#include <c10/core/CachingDeviceAllocator.h>

#include <ftw.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace bench {

// Linear(width, width) layers with tanh between, each called through tk::unit.
struct Stage3StackImpl : torch::nn::Module {
  Stage3StackImpl(int64_t n, int64_t width) {
    layers = register_module("layers", torch::nn::ModuleList());
    for (int64_t i = 0; i < n; ++i) layers->push_back(torch::nn::Linear(width, width));
  }
  torch::Tensor forward(torch::Tensor x) {
    for (const auto& m : *layers) {
      auto* layer = m->as<torch::nn::LinearImpl>();
      x = torch::tanh(trainkit::unit(layer, [&](const torch::Tensor& in) { return layer->forward(in); }, x));
    }
    return x;
  }
  torch::nn::ModuleList layers{nullptr};
};
TORCH_MODULE(Stage3Stack);

struct Stage3Setup {
  torch::Device device = torch::kCPU;
  bool dry = false;
  std::function<std::shared_ptr<trainkit::DataParallel>()> replicas;  // cut as sharded at world size 1
  c10::intrusive_ptr<trainkit_testing::CountingBackend> counter;      // under those replicas
};

// The device allocator's bytes allocated now and at the peak since its last reset (0 on the CPU).
inline std::pair<double, double> allocated(const torch::Device& device) {
  if (device.is_cpu()) return {0, 0};
  const auto stats = c10::getDeviceAllocator(device.type())->getDeviceStats(device.index());
  const auto& a = stats.allocated_bytes[static_cast<size_t>(c10::CachingAllocator::StatType::AGGREGATE)];
  return {static_cast<double>(a.current), static_cast<double>(a.peak)};
}

template <class Precision>
void check_stage3_precision(const Stage3Setup& s, const std::string& name, std::vector<std::string>& failed) {
  namespace tk = trainkit;
  using T = tk::Trainer<tk::PrecisionPolicy<Precision>, tk::AccumulationPolicy<2>, tk::ClipPolicy<tk::ClipNorm>>;
  const int64_t units = 6, width = s.dry ? 64 : 1024, rows = s.dry ? 8 : 256, windows = 4;
  const auto options = tk::TrainerOptions()
                           .max_grad_norm(1.0)
                           .sharding(tk::Sharding::parameters)
                           .units({"layers.*"})
                           .unit_prefetch(1);
  const auto x = torch::randn({rows, width}, torch::TensorOptions().device(s.device));
  const auto loss_of = [&](Stage3Stack& model, int64_t k) {
    return (model->forward(x) * (1.0 + 0.01 * static_cast<double>(k))).to(torch::kFloat).square().mean();
  };
  const auto make = [&](Stage3Stack& model) {
    auto t = std::make_unique<T>(model, tk::AdamW{1e-3, 1e-2}, options);
    t->set_replicas(s.replicas());
    return t;
  };
  char dir[] = "/tmp/gpu-check-stage3-XXXXXX";
  if (!::mkdtemp(dir)) throw std::runtime_error("mkdtemp failed");
  torch::manual_seed(7);
  Stage3Stack model(units, width);
  model->to(s.device);
  auto t = make(model);
  // Windows 1 .. windows: the first micro-batch of each (no update) measured.
  double rise = 0;
  std::int64_t gathers = 0, scatters = 0;
  std::vector<double> losses;
  std::string saved;
  double pause_ms = 0, write_ms = 0;
  tk::CheckpointManager checkpoints(dir, "s3", 2);
  checkpoints.set_format(tk::CheckpointFormat::sharded);
  for (int64_t k = 0; static_cast<int64_t>(losses.size()) < windows; ++k) {
    // (from the second window: the first allocates the kernels' workspaces, kept after)
    const bool opens = k % 2 == 0 && k >= 2;
    const double now = allocated(s.device).first;
    if (opens && !s.device.is_cpu()) c10::getDeviceAllocator(s.device.type())->resetPeakStats(s.device.index());
    const auto g0 = s.counter->all_gather_calls, r0 = s.counter->reduce_scatter_calls;
    auto r = t->micro_step([&] { return loss_of(model, k); });
    if (opens) {
      synchronize(s.device);
      rise = std::max(rise, allocated(s.device).second - now);
    }
    if (k == 2 || k == 3) gathers += s.counter->all_gather_calls - g0, scatters += s.counter->reduce_scatter_calls - r0;
    if (!r.window_closed) continue;
    losses.push_back(r.report.loss());
    if (losses.size() == 2) {  // after window 2: the set, in the background
      const double t0 = now_ms();
      checkpoints.save_in_background(*t, tk::LoopState{}, false);
      pause_ms = now_ms() - t0;
      const auto written = checkpoints.wait_background();
      write_ms = now_ms() - t0;
      saved = written ? written->path : "";
    }
  }
  const auto predicted = t->predicted_held();
  const double held = static_cast<double>(t->held_bytes());
  // Saved activations: every layer's input and tanh output per row (fp32 or half), as a bound;
  // and autograd's gradient of one weight, before the hook moves it into its unit's buffer.
  const double activations = 2.0 * 4.0 * static_cast<double>(rows * width * units) + 4.0 * static_cast<double>(width * width);
  const double in_step = predicted.gathered + predicted.unit_gradients + predicted.autocast;
  const auto b = [](double bytes) { return trainkit::format_bytes(bytes); };
  std::printf("- stage 3, %s, %lld units of %lld x %lld, rows %lld: held %s between steps (predicted %s); a forward "
              "and backward rose %s above what was allocated (predicted in a step: gathered %s, gradients %s, "
              "autocast %s; activations at most %s); one window: %lld all-gathers, %lld reduce-scatters; a set in the "
              "background: the pause %.1f ms, the write %.1f ms\n",
              name.c_str(), static_cast<long long>(units), static_cast<long long>(width), static_cast<long long>(width),
              static_cast<long long>(rows), b(held).c_str(), b(predicted.total()).c_str(), b(rise).c_str(),
              b(predicted.gathered).c_str(), b(predicted.unit_gradients).c_str(), b(predicted.autocast).c_str(),
              b(activations).c_str(), static_cast<long long>(gathers), static_cast<long long>(scatters), pause_ms,
              write_ms);
  const std::string tag = "stage 3 " + name + ": ";
  if (std::abs(held - predicted.total()) > 0.01 * held)
    failed.push_back(tag + "held " + std::to_string(held) + " bytes between steps, predicted " +
                     std::to_string(predicted.total()));
  if (!s.device.is_cpu()) {
    if (rise > in_step + activations)
      failed.push_back(tag + "a forward and backward allocated " + std::to_string(rise / 1048576.0) +
                       " MiB above what was held, more than the prediction's " + std::to_string(in_step / 1048576.0) +
                       " MiB in a step and " + std::to_string(activations / 1048576.0) + " MiB of activations");
    if (rise < 0.5 * predicted.gathered)
      failed.push_back(tag + "a forward and backward allocated " + std::to_string(rise / 1048576.0) +
                       " MiB, less than half of the units gathered: the peak was not measured");
  }
  // One window: 2 micro-batches, each gathering every unit for its forward and for its backward
  // but the one the forward ends with (kept into the backward), and reduce-scattering every
  // unit's gradient.
  if (gathers != 2 * (2 * units - 1) || scatters != 2 * units)
    failed.push_back(tag + "one window made " + std::to_string(gathers) + " all-gathers and " +
                     std::to_string(scatters) + " reduce-scatters, not " + std::to_string(2 * (2 * units - 1)) +
                     " and " + std::to_string(2 * units));
  // The set, loaded into a fresh trainer: windows 3-4 again, bit for bit.
  if (saved.empty()) {
    failed.push_back(tag + "the background save wrote nothing");
  } else {
    torch::manual_seed(99);  // (other weights: the load must replace them)
    Stage3Stack fresh(units, width);
    fresh->to(s.device);
    auto u = make(fresh);
    checkpoints.load(*u, saved);
    std::vector<double> again;
    for (int64_t k = 4; static_cast<int64_t>(again.size()) < windows - 2; ++k) {
      auto r = u->micro_step([&] { return loss_of(fresh, k); });
      if (r.window_closed) again.push_back(r.report.loss());
    }
    const bool same_losses = again == std::vector<double>(losses.begin() + 2, losses.end());
    const bool same_state = torch::equal(u->storage().replicated_state().cpu(), t->storage().replicated_state().cpu());
    if (!same_losses || !same_state)
      failed.push_back(tag + "resumed from the set written in the background, " +
                       (same_losses ? "the state differs" : "the losses differ"));
  }
  ::nftw(dir, [](const char* path, const struct stat*, int, struct FTW*) { return ::remove(path); }, 16,
         FTW_DEPTH | FTW_PHYS);
}

inline void check_stage3(const Stage3Setup& s, std::vector<std::string>& failed) {
  try {
    check_stage3_precision<trainkit::MasterWeights<trainkit::FP16Dynamic>>(s, "MasterWeights<FP16Dynamic>", failed);
  } catch (const std::exception& e) {
    failed.push_back(std::string("stage 3 MasterWeights<FP16Dynamic>: ") + e.what());
  }
  try {
    check_stage3_precision<trainkit::BF16>(s, "BF16 (autocast)", failed);
  } catch (const std::exception& e) {
    failed.push_back(std::string("stage 3 BF16: ") + e.what());
  }
}

}  // namespace bench
