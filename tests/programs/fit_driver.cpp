// fit_driver: a tiny training program driven by tk::fit, for the process-level tests of the fit
// loop (tests/unit/test_fit_process.cpp): SIGKILL at random instants, SIGTERM, resume.
//
//   fit_driver --model-dir DIR [--set K=V]... [--sleep-ms MS] [--raise EPOCH:INDEX[:COUNT]] [--hidden H]
//              [--batches B]
//   fit_driver --bench-checkpoint HIDDEN --model-dir DIR     (times a checkpoint, blocking and in the background)
//
// Trains a 2-layer MLP (hidden width H, 16 by default: --hidden makes checkpoints as large as wanted) with dropout (FP16Dynamic, Accumulate<2>, ClipNorm, AdamW) on a fixed
// regression set, 7 micro-batches per epoch (--batches: 1 to 8), the batch of (epoch, index) drawn from a generator
// seeded by (RNG_SEED, epoch). On completion prints "final-hash <hex>": an FNV-1a hash of the
// parameters, the optimizer's moments, the loss scale and the step counters. Exit status 0 when
// it finished or stopped on a signal, 1 on an error (message on stderr).
#include <trainkit/run/dispatch.hpp>
#include <trainkit/fit/fit.hpp>

#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cinttypes>
#include <csignal>
#include <cstdio>
#include <optional>
#include <string>
#include <thread>
#include <vector>

namespace tk = trainkit;

namespace {

struct MlpImpl : torch::nn::Module {
  explicit MlpImpl(int hidden)
      : fc1(register_module("fc1", torch::nn::Linear(8, hidden))),
        fc2(register_module("fc2", torch::nn::Linear(hidden, 3))),
        drop(register_module("drop", torch::nn::Dropout(0.2))) {}
  torch::Tensor forward(const torch::Tensor& x) { return fc2(drop(torch::tanh(fc1(x)))); }
  torch::nn::Linear fc1, fc2;
  torch::nn::Dropout drop;
};
TORCH_MODULE(Mlp);

using Trainer = tk::Trainer<tk::PrecisionPolicy<tk::FP16Dynamic>, tk::AccumulationPolicy<2>,
                            tk::ClipPolicy<tk::ClipNorm>>;

struct Batch {
  torch::Tensor x, y;
};

std::uint64_t fnv1a(std::uint64_t h, const torch::Tensor& t) {
  const auto c = t.contiguous().cpu();
  const auto* p = static_cast<const unsigned char*>(c.data_ptr());
  for (size_t i = 0; i < c.nbytes(); ++i) h = (h ^ p[i]) * 1099511628211ull;
  return h;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0.0 : v[v.size() / 2];
}

// Times a checkpoint's cost to the training loop: a micro-step without a save; save()
// (blocking: the loop waits for the file); save_in_background() (the pause), the writer
// thread's time, and the micro-steps run while it writes.
int bench_checkpoint(int hidden, const std::string& dir) {
  using Ms = std::chrono::duration<double, std::milli>;
  torch::manual_seed(0);
  Mlp model(hidden);
  Trainer trainer(model, tk::AdamW{1e-3});
  const auto x = torch::randn({12, 8}), y = torch::randn({12, 3});
  const auto step = [&] {
    const auto t0 = std::chrono::steady_clock::now();
    trainer.micro_step([&] { return torch::mse_loss(model(x), y); });
    return Ms(std::chrono::steady_clock::now() - t0).count();
  };
  tk::CheckpointManager checkpoints(dir, "bench", 2);
  checkpoints.create_directory();
  std::vector<double> plain, blocking, pause, writer, during;
  for (int i = 0; i < 20; ++i) plain.push_back(step());
  tk::LoopState state;
  // Peak resident memory above the resident memory before each phase (tk::PeakMemory: VmHWM).
  const tk::PeakMemory peak(torch::kCPU);
  const auto rss_mb = [] { return tk::detail::proc_status_bytes("VmRSS") / 1e6; };
  const double rss_blocking = rss_mb();
  peak.reset();
  for (int i = 0; i < 7; ++i) {
    state.position = {i + 1, 0};
    const auto t0 = std::chrono::steady_clock::now();
    checkpoints.save(trainer, state, true);
    blocking.push_back(Ms(std::chrono::steady_clock::now() - t0).count());
    step();
  }
  const double peak_blocking = peak.bytes() / 1e6 - rss_blocking;
  const double rss_background = rss_mb();
  peak.reset();
  std::size_t bytes = 0;
  for (int i = 0; i < 7; ++i) {
    state.position = {i + 8, 0};
    const auto t0 = std::chrono::steady_clock::now();
    checkpoints.save_in_background(trainer, state, true);
    pause.push_back(Ms(std::chrono::steady_clock::now() - t0).count());
    std::optional<tk::CheckpointManager::Written> done;
    while (!(done = checkpoints.background_done())) during.push_back(step());
    writer.push_back(done->seconds * 1e3);
    bytes = done->bytes;
  }
  const double peak_background = peak.bytes() / 1e6 - rss_background;
  const auto t0 = std::chrono::steady_clock::now();
  const bool ok = tk::CheckpointManager::is_complete(checkpoints.epoch_path(13));
  const double check_ms = Ms(std::chrono::steady_clock::now() - t0).count();
  std::printf("parameters %lld  file %.1f MB  micro-step %.2f ms  save (blocking) %.1f ms  background: pause %.1f ms, "
              "writer %.1f ms, %zu micro-steps during the writes at %.2f ms  integrity check %.1f ms (%s)  "
              "peak resident memory above the run's: blocking +%.1f MB, background +%.1f MB\n",
              static_cast<long long>(trainer.parameters().numel()), static_cast<double>(bytes) / 1e6, median(plain),
              median(blocking), median(pause), median(writer), during.size(), median(during), check_ms,
              ok ? "complete" : "DAMAGED", peak_blocking, peak_background);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    torch::set_num_threads(1);  // deterministic and cheap: the model is tiny
    const auto cl = tk::CommandLine::parse(argc, argv);
    int sleep_ms = 0, hidden = 16;
    std::int64_t batches = 7;
    std::int64_t raise_epoch = -1, raise_index = -1, raise_count = 1;
    for (size_t i = 0; i < cl.rest.size(); ++i) {
      const std::string a = cl.rest[i];
      const bool has_value = i + 1 < cl.rest.size();
      if (a == "--sleep-ms" && has_value) {
        sleep_ms = std::stoi(cl.rest[++i]);
      } else if (a == "--hidden" && has_value) {
        hidden = std::stoi(cl.rest[++i]);
      } else if (a == "--batches" && has_value) {
        batches = std::stoll(cl.rest[++i]);
        if (batches < 1 || batches > 8) throw std::runtime_error("--batches B: 1 to 8 (96 samples, 12 a batch)");
      } else if (a == "--raise" && has_value) {
        long long e = -1, x = -1, n = 1;
        if (std::sscanf(cl.rest[++i].c_str(), "%lld:%lld:%lld", &e, &x, &n) < 2) throw std::runtime_error("--raise EPOCH:INDEX[:COUNT]");
        raise_epoch = e, raise_index = x, raise_count = n;
      } else if (a == "--bench-checkpoint" && has_value) {
        return bench_checkpoint(std::stoi(cl.rest[++i]), cl.model_dir.empty() ? "./bench" : cl.model_dir);
      } else {
        throw std::runtime_error("unknown argument '" + a + "'");
      }
    }

    tk::Config config;
    config.load_string("{}", tk::Config::Format::json, cl.overrides());
    const tk::RunPlan plan = tk::RunPlan::from(config, 1);
    const tk::FitOptions options = tk::FitOptions(plan.fit).progress(false);
    torch::manual_seed(static_cast<std::uint64_t>(options.seed()));

    Mlp model(hidden);
    Trainer trainer(model, tk::AdamW{1e-2}, plan.trainer_options);
    auto gen = at::make_generator<at::CPUGeneratorImpl>(42);
    const auto x = torch::randn({96, 8}, gen);
    const auto y = torch::sin(x.matmul(torch::randn({8, 3}, gen)));

    tk::Task<Batch> task;
    task.batches_per_epoch = [batches](std::int64_t) { return batches; };
    task.batch = [&](std::int64_t epoch, std::int64_t index) {
      auto g = at::make_generator<at::CPUGeneratorImpl>(static_cast<std::uint64_t>(options.seed() * 1000 + epoch));
      const auto rows = torch::randperm(96, g).narrow(0, index * 12, 12);
      return Batch{x.index_select(0, rows), y.index_select(0, rows)};
    };
    task.loss = [&](const Batch& b, tk::Metrics&) { return torch::mse_loss(model(b.x), b.y); };

    tk::Callbacks callbacks;
    callbacks.batch_end = [&](tk::BatchEnd& e) {
      if (sleep_ms > 0) std::this_thread::sleep_for(std::chrono::milliseconds(sleep_ms));
      if (e.epoch == raise_epoch && e.index == raise_index)
        for (std::int64_t i = 0; i < raise_count; ++i) std::raise(SIGTERM);
    };
    const tk::FitResult r = tk::fit(trainer, task, options, callbacks);
    if (r.stopped) return 0;  // fit printed how to resume

    std::uint64_t h = 1469598103934665603ull;
    h = fnv1a(h, trainer.parameters());
    auto& rule = dynamic_cast<tk::detail::FusedAdam<tk::AdamW, true>&>(trainer.update_rule());
    for (const auto& t : rule.exp_avg()) h = fnv1a(h, t);
    for (const auto& t : rule.exp_avg_sq()) h = fnv1a(h, t);
    h = fnv1a(h, trainer.loss_scale());
    h = fnv1a(h, trainer.applied_steps());
    h = fnv1a(h, trainer.skipped_steps());
    std::printf("final-hash %016" PRIx64 " windows %lld\n", h, static_cast<long long>(r.windows));
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
}
