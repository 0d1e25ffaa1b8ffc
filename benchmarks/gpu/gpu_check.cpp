// gpu_check: trainkit on a GPU, BERT-base at sequence 128 (benchmarks/gpu/run.sh runs it).
//
//   gpu_check [--micro-batch 32] [--steps 10] [--precisions fp32,bf16,fp16,fp16master]
//             [--losses-json FILE]   # the FP32 rows' window losses, for run.sh's Python comparison
//   gpu_check --dry-run          # the same code on the CPU, bert-tiny, 2 steps (no GPU needed)
//
// For each precision: the step time (median of the timed optimizer steps, accumulation 1,
// ClipNorm, fused AdamW), the achieved TFLOP/s (the model's matrix-product FLOPs, forward x 3)
// against the bf16 matrix-product peak measured first, the peak GPU memory (the caching
// allocator's peak allocated bytes), and host synchronisations per step, counted two ways:
// calls of the CUDA runtime's synchronising functions (this program defines them, ahead of
// libcudart's, counting and forwarding) and the syncs LibTorch itself reports in its sync debug
// mode (c10::cuda::warning_state(), as torch.cuda.set_sync_debug_mode). The hand-written
// LibTorch loop (../compare/run_baselines.cpp) is measured alongside for comparison, twice for
// memory: with zero_grad() setting the gradients to none (what a PyTorch user writes), and with
// them kept between windows (zero_grad(false)), which is what trainkit does: its gradient is one
// flat buffer that the reduction, the clipping and the fused update work on (DDP's buckets and
// Apex's flat buffers are kept alike). So trainkit's peak must be within 2% of the kept loop's,
// and over the set-to-none loop's by no more than that buffer (4 bytes per parameter). On CUDA
// the bytes allocated at a window's start (the parameters, gradients and optimizer state, over
// what the task's own batches hold) must be at most 16 per parameter (+2%) for every trainkit row,
// master weights included (docs/guide/memory.md: 4 + 2 + 2 + 8). Then the
// resume check (resume_check.hpp): a save after step 6 of 12, loaded into a fresh model and
// trainer, must give the uninterrupted run's steps 7-12 (FP32, FP16Dynamic, and FP16 with
// master weights). Then the memory check (memory_check.hpp): a fit
// planned under TRAIN.MEMORY_BUDGET and one with an injected out-of-memory error must end at
// an unplanned run's parameters, the planned one within its budget. Then the host syncs of
// tk::fit: none between log windows, at most 4 per log window. Then tk::recompute on CUDA
// (the unit tests' one CUDA case).
#include "harness.hpp"
#include "memory_check.hpp"
#include "resume_check.hpp"
#include "../../tests/support/recompute_model.hpp"

#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#include <cuda_runtime_api.h>
#include <dlfcn.h>

#include <atomic>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <iomanip>
#include <iostream>
#include <map>
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
  std::string precisions = "fp32,bf16,fp16,fp16master", losses_json;
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
    else if (a == "--losses-json") losses_json = value();
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
  // A Linear's forward and backward in fp32 and in bf16 before any row's baseline: the cuBLAS
  // handles and workspaces (32 MiB each on Hopper) of the main thread and of the autograd
  // thread, which persist, then exist before the first row measures what its task holds, and
  // are not counted as that row's state. (The forward's addmm with a bias goes to cuBLASLt,
  // which in LibTorch 2.11 shares its handle's cuBLAS workspace unless
  // TORCH_CUBLASLT_UNIFIED_WORKSPACE=0: then the Linear creates its own here too.)
  for (const auto dtype : {torch::kFloat, torch::kBFloat16}) {
    const auto o = torch::TensorOptions().device(device).dtype(dtype);
    auto w = torch::randn({64, 64}, o).requires_grad_();
    auto b = torch::randn({64}, o).requires_grad_();
    torch::nn::functional::linear(torch::randn({2, 8, 64}, o), w, b).matmul(w).sum().backward();
  }
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
  if (device.is_cuda() && (self.cuda < 1 || self.torch < 1))
    failed.push_back("a sync counter saw no sync on .item() (CUDA runtime calls " + std::to_string(self.cuda) +
                     ", LibTorch warnings " + std::to_string(self.torch) + "): its '0 syncs per step' proves nothing");

  std::printf("\n| implementation | precision | step ms | TFLOP/s | of peak (bf16; fp32 rows: fp32) | peak GPU memory MiB | "
              "bytes per parameter at a window's start | syncs per step (CUDA calls / LibTorch) | first / last loss |\n");
  std::printf("|---|---|---|---|---|---|---|---|---|\n");
  // "libtorch-kept": the hand-written loop with zero_grad(false), measured for memory only.
  std::map<std::string, std::vector<double>> losses_by_row;
  int64_t parameters = 0;
  for (const auto& impl : {std::string("trainkit"), std::string("libtorch"), std::string("libtorch-kept")}) {
    const bool kept = impl == "libtorch-kept";
    for (const auto& precision : split(precisions)) {
      if (impl != "trainkit" && precision == "fp16master") continue;
      bench::Settings s;
      s.impl = kept ? "libtorch" : impl;
      s.keep_grads = kept;
      s.model = model;
      s.precision = precision;
      s.micro_batch = micro_batch;
      s.seq = seq;
      s.windows = steps;
      s.warmup = dry ? 1 : 3;
      s.device = device;
      s.time_phase = false;
      auto allocated = [&] {
        if (!device.is_cuda()) return 0.0;
        const auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(device.index());
        return double(stats.allocated_bytes[static_cast<size_t>(c10::CachingAllocator::StatType::AGGREGATE)].current);
      };
      double task_bytes = 0, window_start_bytes = 0;  // what the task holds; allocated at the last window's start
      auto run = [&](bench::Settings& settings) {
        auto task = bench::make_task(model, micro_batch, seq, device);
        parameters = 0;
        for (const auto& p : task.module->parameters()) parameters += p.numel();
        task_bytes = allocated();
        return impl == "trainkit" ? bench::run_trainkit(settings, task) : bench::run_libtorch(settings, task);
      };
      if (device.is_cuda()) {
        c10::cuda::CUDACachingAllocator::emptyCache();
        c10::cuda::CUDACachingAllocator::resetPeakStats(device.index());
      }
      s.on_window = [&](bool begin) {
        if (begin) window_start_bytes = allocated();  // host-side counters: no sync
      };
      auto r = run(s);
      s.on_window = nullptr;
      std::vector<double> losses;
      for (auto& l : r.losses) losses.push_back(l());
      double peak_mib = 0;
      if (device.is_cuda()) {
        const auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(device.index());
        peak_mib = stats.allocated_bytes[static_cast<size_t>(c10::CachingAllocator::StatType::AGGREGATE)]
                       .peak / 1048576.0;
      }
      // Over the task's batches (what it held less its fp32 parameters): the parameters, the
      // gradients and the optimizer's state.
      const double state_per_param =
          device.is_cuda() ? (window_start_bytes - (task_bytes - 4.0 * parameters)) / double(parameters) : 0.0;

      // A short second run counts the syncs inside its windows (sync debug mode on); not for
      // the kept-gradient loop, measured for its memory only.
      Counts c;
      SyncWarnings warnings;
      if (!kept) {
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
      losses_by_row[row] = losses;
      if (impl == "trainkit" && device.is_cuda() && c.cuda != 0)
        failed.push_back(row + ": " + std::to_string(c.cuda) + " CUDA synchronising calls in " +
                         std::to_string(c.windows) + " counted steps (must be 0)");
      if (impl == "trainkit" && device.is_cuda() && !(state_per_param <= 16.0 * 1.02))
        failed.push_back(row + ": " + std::to_string(state_per_param) +
                         " bytes per parameter at a window's start (parameters, gradients, AdamW's moments; "
                         "stated: 16, docs/guide/memory.md)");
      if (!std::isfinite(losses.back())) failed.push_back(row + ": the last loss is not finite");
      const std::string name = impl == "trainkit" ? "trainkit" : kept ? "hand-written LibTorch, zero_grad(false)"
                                                                      : "hand-written LibTorch";
      const std::string syncs = kept ? std::string("-")
                                     : std::to_string(c.windows ? double(c.cuda) / c.windows : 0.0).substr(0, 4) + " / " +
                                           std::to_string(c.windows ? double(c.torch) / c.windows : 0.0).substr(0, 4);
      std::printf("| %s | %s | %.2f | %.3g | %.0f%% | %.0f | %.2f | %s | %.4f / %.4f |\n", name.c_str(),
                  precision.c_str(), ms, tflops, 100.0 * tflops / (precision == "fp32" ? peak_fp32 : peak), peak_mib,
                  state_per_param, syncs.c_str(), losses.front(), losses.back());
      std::fflush(stdout);
    }
  }
  if (!losses_json.empty()) {  // run.sh compares the Python loop's FP32 losses with these
    std::ofstream out(losses_json);
    out << "{";
    const char* sep = "";
    for (const auto& [row, values] : losses_by_row) {
      out << sep << "\"" << row << "\": [";
      for (size_t i = 0; i < values.size(); ++i) {
        out << (i ? ", " : "");
        if (std::isfinite(values[i])) out << std::setprecision(9) << values[i];
        else out << (std::isnan(values[i]) ? "NaN" : values[i] > 0 ? "Infinity" : "-Infinity");  // Python's json reads these
      }
      out << "]";
      sep = ", ";
    }
    out << "}\n";
    if (!out) failed.push_back("could not write " + losses_json);
  }
  // Resume: save after step 6 of 12, load into a fresh model and trainer (resume_check.hpp).
  // Two micro-batches per step, item-weighted; exact on the CPU. On CUDA, deterministic
  // algorithms are on for this check (warn_only: an op without a deterministic kernel warns,
  // and is named) and run.sh sets CUBLAS_WORKSPACE_CONFIG=:4096:8 (the size cuBLAS gets on
  // Hopper anyway), so the same kernels on the same inputs give the same bits; the tolerance is
  // 1e-6 then. Where an op warned (a fused attention backward's atomics, say), the last bits of
  // a gradient may differ from run to run: 1e-5 then, above the 6-step drift that such a
  // rounding difference leaves under AdamW's lr-bounded update, far below a resume error (a
  // lost or repeated step, a stale moment, a wrong scale), which moves the losses by >1e-3.
  std::printf("\n#### Resume (bert-tiny, 2 micro-batches per step, item-weighted)\n\n");
  {
    namespace tk = trainkit;
    bench::ResumeSettings rs;
    rs.device = device;
    rs.items = true;
    rs.micro_batch = dry ? 2 : 8;
    rs.seq = dry ? 8 : 32;
    struct NondeterminismWarnings final : public c10::WarningHandler {
      void process(const c10::Warning& w) override {
        if (w.msg().find("deterministic") != std::string::npos) {
          if (ops.size() < 4 && ops.find(w.msg().substr(0, 80)) == std::string::npos) ops += w.msg().substr(0, 80) + "; ";
          ++count;
        } else {
          c10::WarningHandler().process(w);
        }
      }
      long count = 0;
      std::string ops;
    } nondeterministic;
    c10::WarningUtils::WarningHandlerGuard guard(&nondeterministic);
    if (device.is_cuda()) at::globalContext().setDeterministicAlgorithms(true, /*warn_only=*/true);
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
        const double tolerance = !device.is_cuda() ? 0.0 : nondeterministic.count == 0 ? 1e-6 : 1e-5;
        if (nondeterministic.count)
          std::printf("- (nondeterministic ops warned: %s tolerance 1e-5)\n", nondeterministic.ops.c_str());
        bench::report_resume("trainkit/" + name, r, tolerance, failed);
      } catch (const std::exception& e) {
        failed.push_back("trainkit/" + name + " resume: " + e.what());
      }
    };
    resume(tk::FP32{}, "fp32");
    resume(tk::FP16Dynamic{}, "fp16");
    resume(tk::MasterWeights<tk::FP16Dynamic>{}, "fp16master");
    if (device.is_cuda()) at::globalContext().setDeterministicAlgorithms(false, false);
  }

  bench::check_memory(device, dry, failed);  // the memory plan and the out-of-memory replay (memory_check.hpp)

  // Host syncs of tk::fit, between log windows and at one: one epoch of one-micro-batch windows
  // (bert-tiny, files written as a run writes them), counted by the CUDA runtime calls above.
  // Between log windows there must be none: 4 more windows add no sync. A log window reads
  // what it reports in a few copies (the step report's one, the metrics' one): at most 4.
  std::printf("\n#### Host syncs in tk::fit (bert-tiny, one micro-batch per window)\n\n");
  try {
    auto syncs = [&](std::int64_t windows, std::int64_t log_frequent) {
      bench::FitShape shape;
      shape.micro_batches = windows;
      shape.log_frequent = log_frequent;
      shape.write_files = true;
      shape.syncs = [] { return cuda_syncs.load(); };
      return bench::fit_for_memory(device, dry ? 2 : 8, dry ? 8 : 32, 0, false, shape).syncs;
    };
    (void)syncs(2, 1000);  // warm-up: one-time set-up is not counted
    const long quiet4 = syncs(4, 1000), quiet8 = syncs(8, 1000), logged8 = syncs(8, 1);
    std::printf("- CUDA synchronising calls in one epoch with no log window inside it: 4 windows %ld, 8 windows %ld; "
                "8 windows, each logged: %ld (%.2f per log window)\n",
                quiet4, quiet8, logged8, double(logged8 - quiet8) / 8.0);
    if (device.is_cuda() && quiet8 != quiet4)
      failed.push_back("tk::fit: " + std::to_string(quiet8 - quiet4) + " CUDA synchronising calls in 4 windows without a log window (must be 0)");
    if (device.is_cuda() && logged8 - quiet8 > 8 * 4)
      failed.push_back("tk::fit: " + std::to_string(double(logged8 - quiet8) / 8.0) +
                       " CUDA synchronising calls per log window (at most 4: the report's copy and the metrics')");
  } catch (const std::exception& e) {
    failed.push_back(std::string("tk::fit syncs: ") + e.what());
  }

  // tk::recompute on the device: tests/unit/test_recompute.cpp's CUDA case, which the unit
  // tests (run on the CPU) skip. The recomputed forward gives the direct call's output and
  // gradients bit for bit, dropout included; the backward's recomputation puts the CUDA
  // generator back; FP16 autocast likewise, and autocast is off after it.
  std::printf("\n#### Recomputation (tk::recompute) on %s\n\n", device.str().c_str());
  {
    namespace rm = trainkit_testing::recompute_model;
    auto model = rm::make_model();
    model->to(device);
    const auto x = torch::randn({64, 32}).to(device), w = torch::randn({64, 32}).to(device);
    auto differs = [](const rm::Run& a, const rm::Run& b) -> std::string {
      if (!torch::equal(a.output, b.output)) return "the output";
      if (!torch::equal(a.input_grad, b.input_grad)) return "the input's gradient";
      for (size_t i = 0; i < a.grads.size(); ++i)
        if (!a.grads[i].defined() || !b.grads[i].defined() || !torch::equal(a.grads[i], b.grads[i]))
          return "parameter " + std::to_string(i) + "'s gradient";
      if (!torch::equal(a.rng_after, b.rng_after)) return "the CPU generator after backward";
      return "";
    };
    auto report = [&](const std::string& what, const std::string& diff) {
      std::printf("- %s: %s\n", what.c_str(), diff.empty() ? "recomputed equals direct, bit for bit" : ("differs in " + diff).c_str());
      if (!diff.empty()) failed.push_back("recompute, " + what + ": " + diff + " differs from the direct call's");
    };
    report("fp32", differs(rm::run(model, x, w, false, 21), rm::run(model, x, w, true, 21)));
    if (device.is_cuda()) {
      auto state = [&] { return at::globalContext().defaultGenerator(device).get_state(); };
      torch::manual_seed(21);
      const auto loss = model->forward(x.clone().requires_grad_(), true).sum();
      (void)torch::rand({1000}, torch::TensorOptions().device(device));  // moves the CUDA generator on
      const auto before = state();
      loss.backward();
      const bool kept = torch::equal(state(), before);
      std::printf("- the CUDA generator after a recomputing backward: %s\n", kept ? "as before it" : "moved");
      if (!kept) failed.push_back("recompute: the backward's recomputation left the CUDA generator moved");
      const auto fp16 = [] { return std::optional<trainkit::AutocastRegion>(std::in_place, c10::kCUDA, at::kHalf); };
      report("fp16 autocast", differs(rm::run(model, x, w, false, 22, true, fp16), rm::run(model, x, w, true, 22, true, fp16)));
      if (at::autocast::is_autocast_enabled(c10::kCUDA)) failed.push_back("recompute: autocast is still on after the fp16 runs");
    }
  }

  // The same model, weights and first batch: the first FP32 loss is the same computation.
  if (first_loss.count("trainkit/fp32") && first_loss.count("libtorch/fp32")) {
    const double a = first_loss["trainkit/fp32"], b = first_loss["libtorch/fp32"];
    if (!(std::abs(a - b) <= 1e-5 * std::abs(b)))
      failed.push_back("the first FP32 loss: trainkit " + std::to_string(a) + ", hand-written LibTorch " + std::to_string(b));
  }
  // Peak memory: within 2% (the allocator's rounding) of the hand-written loop that keeps its
  // gradients as trainkit does, and over the set-to-none loop's by at most the flat gradient
  // (4 bytes per parameter), 2% allowed on top.
  const double flat_grad_mib = 4.0 * double(parameters) / 1048576.0;
  std::printf("\n#### Peak memory against the hand-written loop\n\n");
  for (const auto& [row, mib] : peak_memory) {
    if (row.rfind("trainkit/", 0) != 0) continue;
    const std::string precision = row.substr(row.find('/') + 1);
    const auto kept = peak_memory.find("libtorch-kept/" + precision), none = peak_memory.find("libtorch/" + precision);
    if (kept != peak_memory.end() && none != peak_memory.end()) {
      std::printf("- %s: peak %.0f MiB; the hand-written loop's %.0f MiB with zero_grad(false) (x%.3f), %.0f MiB "
                  "with gradients set to none (+%.0f MiB; the flat gradient is %.0f MiB)\n",
                  row.c_str(), mib, kept->second, kept->second > 0 ? mib / kept->second : 0.0, none->second,
                  mib - none->second, flat_grad_mib);
      if (mib > 1.02 * kept->second)
        failed.push_back(row + ": peak memory " + std::to_string(mib) + " MiB, over 1.02 x the hand-written loop's " +
                         std::to_string(kept->second) + " MiB (gradients kept, zero_grad(false))");
      if (mib > 1.02 * (none->second + flat_grad_mib))
        failed.push_back(row + ": peak memory " + std::to_string(mib) + " MiB, over 1.02 x (the set-to-none loop's " +
                         std::to_string(none->second) + " MiB + the flat gradient's " + std::to_string(flat_grad_mib) +
                         " MiB)");
    }
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
