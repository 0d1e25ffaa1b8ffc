// gpu_check: trainkit on a GPU, BERT-base at sequence 128 (benchmarks/gpu/run.sh runs it).
//
//   gpu_check [--micro-batch 32] [--steps 10] [--precisions fp32,bf16,fp16,fp16master]
//   gpu_check --dry-run          # the same code on the CPU, bert-tiny, 2 steps (no GPU needed)
//
// For each precision: the step time (median of the timed optimizer steps, accumulation 1,
// ClipNorm, fused AdamW), the achieved TFLOP/s (the model's matrix-product FLOPs, forward x 3)
// against the bf16 matrix-product peak measured first, the peak GPU memory (the caching
// allocator's peak allocated bytes), and host synchronisations per step, counted two ways:
// calls of the CUDA runtime's synchronising functions (this program defines them, ahead of
// libcudart's, counting and forwarding) and the syncs LibTorch itself reports in its sync debug
// mode (c10::cuda::warning_state(), as torch.cuda.set_sync_debug_mode). The hand-written
// LibTorch loop (../compare/run_baselines.cpp) is measured alongside for comparison. Then the
// resume check (resume_check.hpp): a save after step 6 of 12, loaded into a fresh model and
// trainer, must give the uninterrupted run's steps 7-12 (FP32, FP16Dynamic, and FP16 with
// master weights where trainkit has them). Then the memory check (memory_check.hpp): a fit
// planned under TRAIN.MEMORY_BUDGET and one with an injected out-of-memory error must end at
// an unplanned run's parameters, the planned one within its budget.
#include "bench_features.hpp"  // generated: TRAINKIT_BENCH_HAVE_MASTER_WEIGHTS (../compare/CMakeLists.txt)
#include "harness.hpp"
#include "memory_check.hpp"
#include "resume_check.hpp"

#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#include <cuda_runtime_api.h>
#include <dlfcn.h>

#include <atomic>
#include <cmath>
#include <map>
#include <cstdio>
#include <iostream>
#include <sstream>

// --- counting the CUDA runtime's synchronising calls ----------------------------------------
namespace {
std::atomic<long> cuda_syncs{0};
template <class F>
F next_symbol(const char* name) {
  void* f = dlsym(RTLD_NEXT, name);
  if (f == nullptr) {
    std::fprintf(stderr, "gpu_check: %s not found after this program (%s)\n", name, dlerror());
    std::abort();
  }
  return reinterpret_cast<F>(f);
}
}  // namespace

extern "C" {
cudaError_t cudaStreamSynchronize(cudaStream_t stream) {
  static auto real = next_symbol<cudaError_t (*)(cudaStream_t)>("cudaStreamSynchronize");
  ++cuda_syncs;
  return real(stream);
}
cudaError_t cudaDeviceSynchronize(void) {
  static auto real = next_symbol<cudaError_t (*)()>("cudaDeviceSynchronize");
  ++cuda_syncs;
  return real();
}
cudaError_t cudaEventSynchronize(cudaEvent_t event) {
  static auto real = next_symbol<cudaError_t (*)(cudaEvent_t)>("cudaEventSynchronize");
  ++cuda_syncs;
  return real(event);
}
cudaError_t cudaMemcpy(void* dst, const void* src, size_t count, cudaMemcpyKind kind) {
  static auto real = next_symbol<cudaError_t (*)(void*, const void*, size_t, cudaMemcpyKind)>("cudaMemcpy");
  ++cuda_syncs;
  return real(dst, src, count, kind);
}
}

namespace {

/// Counts LibTorch's "called a synchronizing CUDA operation" warnings (sync debug mode).
class SyncWarnings final : public c10::WarningHandler {
 public:
  void process(const c10::Warning& w) override {
    if (w.msg().find("synchroniz") != std::string::npos) ++count;
    else c10::WarningHandler().process(w);
  }
  long count = 0;
};

struct Counts {
  long cuda = 0, torch = 0, windows = 0;
};

/// Training FLOPs of one step: 3 x the forward's matrix products (2 per multiply-add).
double step_flops(const bench::ModelSpec& m, int64_t batch, int64_t seq) {
  const double tokens = static_cast<double>(batch) * seq, h = m.hidden;
  const double dense = 2.0 * tokens * (m.layers * 12.0 * h * h + h * m.vocab);
  const double attention = m.layers * 4.0 * batch * double(seq) * seq * h;
  return 3.0 * (dense + attention);
}

double matmul_peak_tflops(torch::Device device, int64_t n, torch::ScalarType dtype = torch::kBFloat16) {
  auto a = torch::randn({n, n}, torch::dtype(dtype).device(device));
  auto b = torch::randn({n, n}, torch::dtype(dtype).device(device));
  std::vector<double> ms;
  for (int i = 0; i < 12; ++i) {
    bench::synchronize(device);
    const double t0 = bench::now_ms();
    auto c = torch::mm(a, b);
    bench::synchronize(device);
    if (i >= 2) ms.push_back(bench::now_ms() - t0);
  }
  return 2.0 * n * n * n / (*std::min_element(ms.begin(), ms.end()) * 1e-3) / 1e12;
}

std::vector<std::string> split(const std::string& s) {
  std::vector<std::string> out;
  std::stringstream in(s);
  for (std::string item; std::getline(in, item, ',');) out.push_back(item);
  return out;
}

}  // namespace

int main(int argc, char** argv) try {
  bool dry = false;
  int64_t micro_batch = 32, steps = 10;
  std::string precisions = "fp32,bf16,fp16";
#if TRAINKIT_BENCH_HAVE_MASTER_WEIGHTS
  precisions += ",fp16master";
#endif
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto value = [&] {
      if (i + 1 >= argc) throw std::invalid_argument(a + " needs a value");
      return std::string(argv[++i]);
    };
    if (a == "--dry-run") dry = true;
    else if (a == "--micro-batch") micro_batch = std::stoll(value());
    else if (a == "--steps") steps = std::stoll(value());
    else if (a == "--precisions") precisions = value();
    else throw std::invalid_argument("unknown option " + a);
  }
  const std::string model = dry ? "bert-tiny" : "bert-base";
  if (dry) {
    micro_batch = 1;
    steps = 2;
  }
  if (!dry && !torch::cuda::is_available())
    throw std::runtime_error("no CUDA device (use --dry-run to check this program on the CPU)");
  const torch::Device device = dry ? torch::Device(torch::kCPU) : torch::Device(torch::kCUDA, 0);
  const auto spec = bench::model_spec(model);
  const int64_t seq = dry ? 8 : spec.seq;

  const double peak = matmul_peak_tflops(device, dry ? 256 : 8192);
  // FP32 rows against an fp32 product's peak (TF32 where LibTorch allows it), not bf16's.
  const double peak_fp32 = matmul_peak_tflops(device, dry ? 256 : 8192, torch::kFloat);
  const double flops = step_flops(spec, micro_batch, seq);
  std::printf("gpu_check: %s, micro-batch %lld x %lld tokens, %.3f TFLOP per step; matmul peaks measured: "
              "bf16 %.3g TFLOP/s, fp32 %.3g TFLOP/s (%s)\n",
              model.c_str(), static_cast<long long>(micro_batch), static_cast<long long>(seq),
              flops / 1e12, peak, peak_fp32, dry ? "CPU dry run" : "cuda:0");
  // What must hold; the last line is PASS or the list of what failed (exit 1).
  std::vector<std::string> failed;
  std::map<std::string, double> first_loss, peak_memory;  // by "impl/precision"

  // Does each way of counting see a sync it must see (a .item())?
  Counts self;
  {
    SyncWarnings warnings;
    c10::WarningUtils::WarningHandlerGuard guard(&warnings);
    if (device.is_cuda())
      c10::cuda::warning_state().set_sync_debug_mode(c10::cuda::SyncDebugMode::L_WARN);
    const long before = cuda_syncs;
    (void)torch::ones({1}, torch::TensorOptions().device(device)).sum().item<float>();
    self.cuda = cuda_syncs - before;
    self.torch = warnings.count;
    if (device.is_cuda())
      c10::cuda::warning_state().set_sync_debug_mode(c10::cuda::SyncDebugMode::L_DISABLED);
  }
  std::printf("sync counters, checked on one .item(): CUDA runtime calls %ld, LibTorch sync-debug "
              "warnings %ld (each should be >= 1 on a GPU; 0 means that counter cannot see syncs)\n",
              self.cuda, self.torch);

  std::printf("\n| implementation | precision | step ms | TFLOP/s | of peak (bf16; fp32 rows: fp32) | peak GPU memory MiB | "
              "syncs per step (CUDA calls / LibTorch) | first / last loss |\n");
  std::printf("|---|---|---|---|---|---|---|---|\n");
  for (const auto& impl : {std::string("trainkit"), std::string("libtorch")}) {
    for (const auto& precision : split(precisions)) {
      if (impl == "libtorch" && precision == "fp16master") continue;
      bench::Settings s;
      s.impl = impl;
      s.model = model;
      s.precision = precision;
      s.micro_batch = micro_batch;
      s.seq = seq;
      s.windows = steps;
      s.warmup = dry ? 1 : 3;
      s.device = device;
      s.time_phase = false;
      auto run = [&](bench::Settings& settings) {
        auto task = bench::make_task(model, micro_batch, seq, device);
        return impl == "trainkit" ? bench::run_trainkit(settings, task)
                                  : bench::run_libtorch(settings, task);
      };
      if (device.is_cuda()) {
        c10::cuda::CUDACachingAllocator::emptyCache();
        c10::cuda::CUDACachingAllocator::resetPeakStats(device.index());
      }
      auto r = run(s);
      std::vector<double> losses;
      for (auto& l : r.losses) losses.push_back(l());
      double peak_mib = 0;
      if (device.is_cuda()) {
        const auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(device.index());
        peak_mib = stats.allocated_bytes[static_cast<size_t>(c10::CachingAllocator::StatType::AGGREGATE)]
                       .peak / 1048576.0;
      }

      // A short second run counts the syncs inside its windows (sync debug mode on).
      Counts c;
      SyncWarnings warnings;
      {
        c10::WarningUtils::WarningHandlerGuard guard(&warnings);
        long cuda_at_start = 0, torch_at_start = 0;
        bench::Settings counted = s;
        counted.windows = 3;
        counted.warmup = 1;
        int64_t window = 0;
        counted.on_window = [&](bool begin) {
          if (window++ < 2 * counted.warmup) return;  // warm-up windows: 2 calls each
          if (begin) {
            cuda_at_start = cuda_syncs;
            torch_at_start = warnings.count;
          } else {
            c.cuda += cuda_syncs - cuda_at_start;
            c.torch += warnings.count - torch_at_start;
            ++c.windows;
          }
        };
        if (device.is_cuda())
          c10::cuda::warning_state().set_sync_debug_mode(c10::cuda::SyncDebugMode::L_WARN);
        run(counted);
        if (device.is_cuda())
          c10::cuda::warning_state().set_sync_debug_mode(c10::cuda::SyncDebugMode::L_DISABLED);
      }
      const double ms = bench::median(r.window_ms);
      const double tflops = flops / (ms * 1e-3) / 1e12;
      const std::string row = impl + "/" + precision;
      first_loss[row] = losses.front();
      peak_memory[row] = peak_mib;
      if (impl == "trainkit" && device.is_cuda() && c.cuda != 0)
        failed.push_back(row + ": " + std::to_string(c.cuda) + " CUDA synchronising calls in " +
                         std::to_string(c.windows) + " counted steps (must be 0)");
      if (!std::isfinite(losses.back())) failed.push_back(row + ": the last loss is not finite");
      std::printf("| %s | %s | %.2f | %.3g | %.0f%% | %.0f | %.2f / %.2f | %.4f / %.4f |\n",
                  impl == "trainkit" ? "trainkit" : "hand-written LibTorch", precision.c_str(), ms,
                  tflops, 100.0 * tflops / (precision == "fp32" ? peak_fp32 : peak), peak_mib,
                  c.windows ? double(c.cuda) / c.windows : 0.0,
                  c.windows ? double(c.torch) / c.windows : 0.0, losses.front(), losses.back());
      std::fflush(stdout);
    }
  }
  // Resume: save after step 6 of 12, load into a fresh model and trainer (resume_check.hpp).
  // Two micro-batches per step, item-weighted; exact on the CPU; on CUDA the same kernels on
  // the same inputs give the same bits too, unless a kernel's reduction order varies.
  std::printf("\n#### Resume (bert-tiny, 2 micro-batches per step, item-weighted)\n\n");
  {
    namespace tk = trainkit;
    bench::ResumeSettings rs;
    rs.device = device;
    rs.items = true;
    rs.micro_batch = dry ? 2 : 8;
    rs.seq = dry ? 8 : 32;
    const double tolerance = device.is_cuda() ? 1e-6 : 0.0;
    auto resume = [&](auto mode, const std::string& name) {
      using Mode = decltype(mode);
      using T = tk::Trainer<tk::PrecisionPolicy<Mode>, tk::AccumulationPolicy<tk::Dynamic>,
                            tk::ClipPolicy<tk::ClipNorm>>;
      rs.tag = name;
      try {
        const auto r = bench::check_resume(rs, [&](bench::Task& task) {
          return std::make_unique<T>(task.module, tk::AdamW{1e-3, 1e-2},
                                     tk::TrainerOptions().max_grad_norm(1.0).accumulation_steps(2));
        });
        bench::report_resume("trainkit/" + name, r, tolerance, failed);
      } catch (const std::exception& e) {
        failed.push_back("trainkit/" + name + " resume: " + e.what());
      }
    };
    resume(tk::FP32{}, "fp32");
    resume(tk::FP16Dynamic{}, "fp16");
#if TRAINKIT_BENCH_HAVE_MASTER_WEIGHTS
    resume(tk::MasterWeights<tk::FP16Dynamic>{}, "fp16master");
#endif
  }

  bench::check_memory(device, dry, failed);  // the memory plan and the out-of-memory replay (memory_check.hpp)

  // The same model, weights and first batch: the first FP32 loss is the same computation.
  if (first_loss.count("trainkit/fp32") && first_loss.count("libtorch/fp32")) {
    const double a = first_loss["trainkit/fp32"], b = first_loss["libtorch/fp32"];
    if (!(std::abs(a - b) <= 1e-5 * std::abs(b)))
      failed.push_back("the first FP32 loss: trainkit " + std::to_string(a) + ", hand-written LibTorch " + std::to_string(b));
  }
  // Peak memory no higher than the hand-written loop's (2% for the allocator's rounding).
  for (const auto& [row, mib] : peak_memory) {
    const std::string precision = row.substr(row.find('/') + 1);
    const auto theirs = peak_memory.find("libtorch/" + precision);
    if (row.rfind("trainkit/", 0) == 0 && theirs != peak_memory.end() && mib > 1.02 * theirs->second)
      failed.push_back(row + ": peak memory " + std::to_string(mib) + " MiB, the hand-written loop's " +
                       std::to_string(theirs->second) + " MiB");
  }
  if (failed.empty()) {
    std::printf("\nPASS\n");
    return 0;
  }
  std::printf("\nFAIL:\n");
  for (const auto& f : failed) std::printf("- %s\n", f.c_str());
  return 1;
} catch (const std::exception& e) {
  std::cerr << "gpu_check: " << e.what() << "\n";
  return 2;
}
