// Memory per rank and window time of data parallelism replicated and sharded (ZeRO stages 1, 2
// and 3, TrainerOptions::sharding), over 1, 2 and 4 Gloo processes on this machine, for FP32 and
// FP16 master weights, AdamW, on an MLP whose memory is its parameters (16 x Linear(1024, 1024):
// 16.8 M parameters, each layer a unit of stage 3 through tk::unit; micro-batches of 8 rows);
// and the reduction overlapped with the backward
// or not (TrainerOptions::overlap_reduction), 2 processes, FP32, micro-batches of --overlap-batch
// rows (32), so that the backward has work to hide the communication behind.
//
//   build/benchmarks/sharding                        # both tables: every configuration, W processes each
//   build/benchmarks/sharding --table memory|overlap --windows 6 --accumulate 4 --layers 16 --width 1024 --repeat 3
//                             --bucket-mib 25 (DataParallel's bucket) --stages 0123 (the stages measured)
//                             --precisions fp32,master (the memory table's precisions)
//   build/benchmarks/sharding --table checkpoint --layers 8 --repeat 3
//   build/benchmarks/sharding --table prefetch --repeat 3     (stage 3's gathers: --prefetch N --reshard 0|1)
//   (a configuration's processes: --child 1 with RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT set)
//
// SHARDING_TRACE=1 in the environment: each rank prints its high-water mark and resident memory
// after construction, attach and each window (where a peak comes from).
//
// The overlap table: "hidden" is the share of the communication the overlap hides, (off - on) /
// (off - one process), where one process runs the same micro-batches with no communication. The
// biases are in their own group, as BERT's TRAIN.NO_DECAY puts biases and norms (the layout
// then ends with a bucket holding a bias of every layer, complete only at the end of the
// backward); "in backward" is the share of the buckets launched before the backward's last
// gradient, "left at launch" the mean share of the backward's gradient still to come when a
// bucket was launched (what its reduction could hide behind; --no-decay 0: no such group).
//
// The checkpoint table: stage 2, FP32, AdamW, 1, 2 and 4 processes; a checkpoint written as one
// file gathered on rank 0 (TRAIN.CHECKPOINT_FORMAT: single) or as a set, every rank its own file
// (sharded), blocking or in the background. "pause" is the time the loop waits in save() (in the
// background: the copy of the state); "written" the time from save() until the checkpoint is
// complete on disk (rank 0: the file, or the set's index); "window during" the median window
// while the write is in flight, against "window" alone; "peak" the process's high-water mark
// while saving above its resident memory before (VmHWM after clear_refs; in the background,
// where windows run during the write, less the windows' own peak alone), rank 0 and the largest
// of the other ranks; "files" the checkpoint's bytes on disk. Medians of --repeat.
//
// Per rank: "held" is the bytes of every tensor the trainer holds between optimizer steps (the
// model's parameters and gradients, the masters, the optimizer's state, the reduced slices;
// each storage counted once: Trainer::held_bytes), per parameter, next to what the trainer
// predicted for it from its size (Trainer::predicted_held, storage/held_bytes.hpp: ZeRO's formula); "peak" is the
// process's high-water mark (VmHWM) minus its resident memory before the model was built, per
// parameter (on the CPU it includes Gloo's buffers; the ranks run with MALLOC_MMAP_THRESHOLD_ at
// 1 MiB, so that glibc gives freed blocks back rather than keeping its high-water mark). "window" is the
// median time of an optimizer step's window after the first, in ms, and its ratio to the
// replicated run of the same world size and precision. The median over --repeat launches.
#include <trainkit/fit/checkpoint.hpp>
#include <trainkit/parallel/data_parallel.hpp>
#include <trainkit/trainer/trainer.hpp>
#include <trainkit/trainer/unit.hpp>

#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <map>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include <ftw.h>
#include <spawn.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

extern char** environ;

namespace tk = trainkit;

namespace {

struct Settings {
  std::int64_t layers = 16, width = 1024, batch = 8, overlap_batch = 32, windows = 6, accumulate = 1, repeat = 3;
  std::int64_t bucket_mib = 25;  // DataParallel's bucket (25 MiB, DDP's default)
  std::string precision = "fp32", table = "both", format = "single", stages = "0123";
  std::string precisions = "fp32,master";  // the memory table's rows
  int stage = 0, overlap = 1, no_decay = 1, background = 0, prefetch = 1, reshard = 1;
  std::string out;
};

// A resident-memory figure of /proc/self/status, in bytes.
std::int64_t status_bytes(const char* field) {
  std::ifstream f("/proc/self/status");
  std::string line;
  while (std::getline(f, line))
    if (line.rfind(field, 0) == 0) return std::stoll(line.substr(std::string(field).size())) * 1024;
  return 0;
}

// tanh(Linear) --layers times; each Linear a unit (tk::unit: stage 3 gathers it around its call).
struct StackImpl : torch::nn::Module {
  explicit StackImpl(const Settings& s) : layers(register_module("layers", torch::nn::ModuleList())) {
    for (std::int64_t i = 0; i < s.layers; ++i) layers->push_back(torch::nn::Linear(s.width, s.width));
  }
  torch::Tensor forward(torch::Tensor x) {
    for (const auto& m : *layers) {
      auto* layer = m->as<torch::nn::LinearImpl>();
      x = torch::tanh(tk::unit(layer, [&](const torch::Tensor& in) { return layer->forward(in); }, x));
    }
    return x;
  }
  torch::nn::ModuleList layers;
};
TORCH_MODULE(Stack);

Stack make_model(const Settings& s) { return Stack(s); }

double median_of(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// The checkpoint table's figures of one rank: `s.windows` windows alone, one save, then as many
// while it is written (every rank runs as many: they are collectives).
template <class Trainer, class Window>
int checkpoint_child(const Settings& s, tk::ProcessGroup& group, Trainer& trainer, Window&& window) {
  tk::CheckpointManager checkpoints(s.out + ".ckpt", "bench", 1);
  checkpoints.set_format(s.format == "sharded" ? tk::CheckpointFormat::sharded : tk::CheckpointFormat::single);
  checkpoints.create_directory();
  tk::LoopState state;
  state.position = {1, 0};
  const bool saves = group.is_main() || checkpoints.writes_set(trainer);
  // The windows' own peak, without a save, to set the save's against.
  std::int64_t before = status_bytes("VmRSS:");
  std::ofstream("/proc/self/clear_refs") << "5";
  std::vector<double> plain;
  for (std::int64_t w = 0; w < s.windows; ++w) plain.push_back(window());
  const double windows_peak = static_cast<double>(status_bytes("VmHWM:") - before) / 1e6;
  before = status_bytes("VmRSS:");
  std::ofstream("/proc/self/clear_refs") << "5";
  const auto start = std::chrono::steady_clock::now();
  const auto since = [&] { return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count(); };
  if (!saves) {
    torch::serialize::OutputArchive discarded;
    trainer.save(discarded);  // (the gather to rank 0)
  } else if (s.background) {
    checkpoints.save_in_background(trainer, state, true);
  } else {
    checkpoints.save(trainer, state, true);
  }
  const double pause = since();
  double written = s.background ? -1 : pause;
  // Blocking: the save's own peak. In the background: the peak while it is written, windows
  // included (less the windows' own peak alone).
  double peak = s.background ? -1 : static_cast<double>(status_bytes("VmHWM:") - before) / 1e6;
  std::vector<double> during;
  for (std::int64_t w = 0; w < s.windows; ++w) {
    const double ms = window();
    if (written < 0) during.push_back(ms);
    if (written < 0 && (!saves || checkpoints.background_done())) written = since();
  }
  if (written < 0) {
    checkpoints.wait_background();
    written = since();
  }
  if (peak < 0) peak = std::max(0.0, static_cast<double>(status_bytes("VmHWM:") - before) / 1e6 - windows_peak);
  double bytes = 0;
  if (group.is_main()) {
    const std::string name = checkpoints.epoch_path(0);
    std::vector<std::string> files{name};
    if (tk::detail::ShardSource::is_index(name)) files = tk::detail::ShardSource(name).files(), files.push_back(name);
    for (const auto& f : files) {
      struct stat st {};
      if (::stat(f.c_str(), &st) == 0) bytes += static_cast<double>(st.st_size) / 1e6;
    }
  }
  std::ofstream(s.out + ".rank" + std::to_string(group.rank()))
      << pause << " " << written << " " << median_of(during) << " " << median_of(plain) << " " << peak << " " << bytes
      << "\n";
  return 0;
}

template <class Trainer>
int child(const Settings& s) {
  const std::int64_t baseline = status_bytes("VmRSS:");
  auto group = tk::ProcessGroup::create(tk::DistributedOptions().heartbeat_seconds(0));
  torch::manual_seed(1);
  auto model = make_model(s);
  const auto sharding = s.stage == 3   ? tk::Sharding::parameters
                        : s.stage == 2 ? tk::Sharding::gradients
                        : s.stage == 1 ? tk::Sharding::optimizer
                                       : tk::Sharding::none;
  Trainer trainer(model, tk::AdamW{1e-4},
                  tk::TrainerOptions()
                      .accumulation_steps(s.accumulate)
                      .sharding(sharding)
                      .overlap_reduction(s.overlap != 0)
                      .unit_prefetch(s.prefetch)
                      .reshard_after_forward(s.reshard != 0)
                      .units({"layers.*"})
                      .no_decay(s.no_decay ? std::vector<std::string>{"bias"} : std::vector<std::string>{}));
  const bool trace = std::getenv("SHARDING_TRACE") != nullptr;
  auto mark = [&](const char* what) {
    if (trace) std::fprintf(stderr, "rank %d %s: HWM %.2f RSS %.2f B/param\n", group.rank(), what,
                            (status_bytes("VmHWM:") - baseline) / 16.8e6, (status_bytes("VmRSS:") - baseline) / 16.8e6);
  };
  mark("built");
  trainer.set_replicas(std::make_shared<tk::DataParallel>(group, s.bucket_mib << 20));
  mark("attached");
  const auto x = torch::randn({s.batch, s.width});
  std::vector<double> ms;
  for (std::int64_t w = 0; w < s.windows; ++w) {
    const auto start = std::chrono::steady_clock::now();
    for (std::int64_t m = 0; m < s.accumulate; ++m) trainer.micro_step([&] { return model->forward(x).square().mean(); });
    ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count());
    mark("window");
  }
  if (s.table == "checkpoint") return checkpoint_child(s, group, trainer, [&] {
      const auto start = std::chrono::steady_clock::now();
      for (std::int64_t m = 0; m < s.accumulate; ++m) trainer.micro_step([&] { return model->forward(x).square().mean(); });
      return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
    });
  const double params = static_cast<double>(trainer.parameter_count());
  std::sort(ms.begin() + 1, ms.end());
  // Buckets launched by the hooks during a backward, of all reductions' buckets: one reduction
  // per window, or per micro-batch with a sharded gradient.
  const auto reductions = s.windows * (s.stage >= 2 && group.world_size() > 1 ? s.accumulate : 1);
  const double in_backward = static_cast<double>(trainer.storage().overlapped_buckets()) /
                             static_cast<double>(reductions * trainer.storage().partition().buckets());
  std::ofstream(s.out + ".rank" + std::to_string(group.rank()))
      << static_cast<double>(trainer.held_bytes()) / params << " "
      << trainer.predicted_held().total() / params << " " << (status_bytes("VmHWM:") - baseline) / params << " "
      << ms[1 + (ms.size() - 1) / 2] << " " << in_backward << " " << trainer.storage().backward_left_at_launch();
  // Stage 3: gathers per window, those launched ahead, the host's ms in gathers per window.
  const auto& units = trainer.storage().unit_gathers();
  const double windows = static_cast<double>(s.windows);
  std::ofstream(s.out + ".rank" + std::to_string(group.rank()), std::ios::app)
      << " " << (units ? static_cast<double>(units->gathers()) / windows : 0.0) << " "
      << (units ? static_cast<double>(units->gathers_ahead()) / windows : 0.0) << " "
      << (units ? units->gather_seconds() * 1e3 / windows : 0.0) << "\n";
  return 0;
}

struct Result {
  double held = 0, predicted = 0, peak = 0, ms = 0, in_backward = 0, left = 0, gathers = 0, ahead = 0, gather_ms = 0;
};

void run_ranks(const std::string& self, const Settings& s, int world, int port);

// W processes of this program for one configuration; rank 0's figures.
Result launch(const std::string& self, const Settings& s, int world, int port) {
  run_ranks(self, s, world, port);
  Result r;
  std::ifstream(s.out + ".rank0") >> r.held >> r.predicted >> r.peak >> r.ms >> r.in_backward >> r.left >> r.gathers >> r.ahead >> r.gather_ms;
  return r;
}

// The checkpoint table's figures: rank 0's, and the largest peak of the other ranks.
struct SaveResult {
  double pause = 0, written = 0, during = 0, alone = 0, peak = 0, peak_others = 0, bytes = 0;
};
SaveResult launch_save(const std::string& self, const Settings& s, int world, int port) {
  const std::string dir = s.out + ".ckpt";
  ::nftw(dir.c_str(), [](const char* p, const struct stat*, int, struct FTW*) { return ::remove(p); }, 16,
         FTW_DEPTH | FTW_PHYS);
  run_ranks(self, s, world, port);
  SaveResult r;
  for (int rank = 0; rank < world; ++rank) {
    SaveResult x;
    std::ifstream(s.out + ".rank" + std::to_string(rank)) >> x.pause >> x.written >> x.during >> x.alone >> x.peak >> x.bytes;
    if (rank == 0) r = x;
    else r.peak_others = std::max(r.peak_others, x.peak);
  }
  return r;
}

// W processes of this program for one configuration, run to their end.
void run_ranks(const std::string& self, const Settings& s, int world, int port) {
  std::vector<pid_t> pids;
  for (int r = 0; r < world; ++r) {
    std::vector<std::string> env;
    for (char** e = environ; *e; ++e) env.emplace_back(*e);
    env.insert(env.end(), {"RANK=" + std::to_string(r), "WORLD_SIZE=" + std::to_string(world), "LOCAL_RANK=" + std::to_string(r),
                           "MASTER_ADDR=127.0.0.1", "MASTER_PORT=" + std::to_string(port), "OMP_NUM_THREADS=1",
                           // Freed blocks of 1 MiB and more go back to the system: glibc's dynamic
                           // threshold would otherwise keep the per-window temporaries of Gloo's
                           // worker threads in their arenas, and "peak" would measure glibc.
                           "MALLOC_MMAP_THRESHOLD_=1048576"});
    std::vector<std::string> args{self, "--child", "1", "--table", s.table, "--format", s.format,
                                  "--background", std::to_string(s.background),
                                  "--precision", s.precision, "--stage", std::to_string(s.stage),
                                  "--layers", std::to_string(s.layers), "--width", std::to_string(s.width),
                                  "--batch", std::to_string(s.batch), "--windows", std::to_string(s.windows),
                                  "--accumulate", std::to_string(s.accumulate), "--overlap", std::to_string(s.overlap),
                                  "--bucket-mib", std::to_string(s.bucket_mib), "--no-decay", std::to_string(s.no_decay),
                                  "--prefetch", std::to_string(s.prefetch), "--reshard", std::to_string(s.reshard),
                                  "--out", s.out};
    std::vector<char*> argv, envp;
    for (auto& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    for (auto& e : env) envp.push_back(e.data());
    envp.push_back(nullptr);
    pid_t pid = 0;
    if (posix_spawn(&pid, self.c_str(), nullptr, nullptr, argv.data(), envp.data()) != 0)
      throw std::runtime_error("could not start " + self);
    pids.push_back(pid);
  }
  for (auto pid : pids) {
    int status = 0;
    waitpid(pid, &status, 0);
    if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) throw std::runtime_error("a rank failed");
  }
}


}  // namespace

int main(int argc, char** argv) {
  try {
    Settings s;
    bool is_child = false;
    for (int i = 1; i + 1 < argc; i += 2) {
      const std::string k = argv[i], v = argv[i + 1];
      if (k == "--child") is_child = true;
      else if (k == "--precision") s.precision = v;
      else if (k == "--precisions") s.precisions = v;
      else if (k == "--stage") s.stage = std::stoi(v);
      else if (k == "--layers") s.layers = std::stoll(v);
      else if (k == "--width") s.width = std::stoll(v);
      else if (k == "--batch") s.batch = std::stoll(v);
      else if (k == "--windows") s.windows = std::stoll(v);
      else if (k == "--accumulate") s.accumulate = std::stoll(v);
      else if (k == "--overlap") s.overlap = std::stoi(v);
      else if (k == "--overlap-batch") s.overlap_batch = std::stoll(v);
      else if (k == "--table") s.table = v;
      else if (k == "--format") s.format = v;
      else if (k == "--background") s.background = std::stoi(v);
      else if (k == "--bucket-mib") s.bucket_mib = std::stoll(v);
      else if (k == "--no-decay") s.no_decay = std::stoi(v);
      else if (k == "--prefetch") s.prefetch = std::stoi(v);
      else if (k == "--reshard") s.reshard = std::stoi(v);
      else if (k == "--repeat") s.repeat = std::stoll(v);
      else if (k == "--stages") s.stages = v;
      else if (k == "--out") s.out = v;
      else throw std::invalid_argument("unknown option " + k);
    }
    using Acc = tk::AccumulationPolicy<tk::Dynamic>;
    using Clip = tk::ClipPolicy<tk::ClipNorm>;
    if (is_child) {
      torch::set_num_threads(1);
      if (s.precision == "fp32") return child<tk::Trainer<tk::PrecisionPolicy<tk::FP32>, Acc, Clip>>(s);
      return child<tk::Trainer<tk::PrecisionPolicy<tk::MasterWeights<tk::FP16Dynamic>>, Acc, Clip>>(s);
    }
    char dir[] = "/tmp/trainkit-sharding-XXXXXX";
    if (!mkdtemp(dir)) throw std::runtime_error("mkdtemp");
    s.out = std::string(dir) + "/r";
    const std::string self = "/proc/self/exe";
    char path[4096];
    const auto n = readlink(self.c_str(), path, sizeof(path) - 1);
    if (n <= 0) throw std::runtime_error("readlink /proc/self/exe");
    path[n] = '\0';
    int port = 29700 + static_cast<int>(getpid() % 200);
    // The median over --repeat launches of each figure.
    auto measure = [&](const Settings& run, int world) {
      std::vector<Result> runs;
      for (std::int64_t k = 0; k < run.repeat; ++k) runs.push_back(launch(path, run, world, ++port));
      Result m;
      for (double Result::*field : {&Result::held, &Result::predicted, &Result::peak, &Result::ms, &Result::in_backward, &Result::left,
                                        &Result::gathers, &Result::ahead, &Result::gather_ms}) {
        std::vector<double> v;
        for (const auto& r : runs) v.push_back(r.*field);
        std::sort(v.begin(), v.end());
        m.*field = v[v.size() / 2];
      }
      return m;
    };
    const double millions = static_cast<double>(s.layers * (s.width * s.width + s.width)) / 1e6;
    if (s.table == "both" || s.table == "memory") {
      std::printf("%lld x Linear(%lld, %lld): %.1f M parameters, batch %lld, N = %lld, AdamW, %lld windows, "
                  "%lld MiB buckets, median of %lld\n",
                  static_cast<long long>(s.layers), static_cast<long long>(s.width), static_cast<long long>(s.width),
                  millions, static_cast<long long>(s.batch), static_cast<long long>(s.accumulate),
                  static_cast<long long>(s.windows), static_cast<long long>(s.bucket_mib), static_cast<long long>(s.repeat));
      std::printf("| precision | W | stage | held B/param | predicted | peak B/param | window ms | window / stage 0 |\n");
      std::printf("|---|---|---|---|---|---|---|---|\n");
      for (const std::string precision : {"fp32", "master"}) {
        for (const int world : {1, 2, 4}) {
          double replicated_ms = 0;
          for (const int stage : {0, 1, 2, 3}) {
            if (world == 1 && stage > 0) continue;  // one process shards nothing
            if (s.stages.find(static_cast<char>('0' + stage)) == std::string::npos) continue;
            if (s.precisions.find(precision) == std::string::npos) continue;
            Settings run = s;
            run.precision = precision;
            run.stage = stage;
            const Result m = measure(run, world);
            if (stage == 0) replicated_ms = m.ms;
            std::printf("| %s | %d | %d | %.2f | %.2f | %.2f | %.1f | %.2f |\n", precision == "fp32" ? "FP32" : "FP16 master",
                        world, stage, m.held, m.predicted, m.peak, m.ms, m.ms / replicated_ms);
            std::fflush(stdout);
          }
        }
      }
    }
    if (s.table == "both" || s.table == "overlap") {
      std::printf("\nOverlap: FP32, %.1f M parameters%s, batch %lld per process, N = %lld, %lld MiB buckets, 2 processes, "
                  "median of %lld\n",
                  millions, s.no_decay ? " (biases in a group of their own: NO_DECAY)" : "",
                  static_cast<long long>(s.overlap_batch), static_cast<long long>(s.accumulate),
                  static_cast<long long>(s.bucket_mib), static_cast<long long>(s.repeat));
      std::printf("| stage | one process ms | overlap off ms | overlap on ms | on / off | communication hidden | "
                  "buckets launched in backward | backward left at launch |\n");
      std::printf("|---|---|---|---|---|---|---|---|\n");
      Settings run = s;
      run.batch = s.overlap_batch;
      const double alone = measure(run, 1).ms;
      for (const int stage : {0, 1, 2, 3}) {
        if (s.stages.find(static_cast<char>('0' + stage)) == std::string::npos) continue;
        run.stage = stage;
        run.overlap = 0;
        const double off = measure(run, 2).ms;
        run.overlap = 1;
        const Result on = measure(run, 2);
        std::printf("| %d | %.1f | %.1f | %.1f | %.2f | %.0f%% | %.0f%% | %.0f%% |\n", stage, alone, off, on.ms, on.ms / off,
                    100.0 * (off - on.ms) / std::max(off - alone, 1e-9), 100.0 * on.in_backward, 100.0 * on.left);
        std::fflush(stdout);
      }
    }
    if (s.table == "prefetch") {
      std::cout << "\nStage 3 gathers: FP32, " << millions << " M parameters in " << s.layers << " units, batch "
                << s.batch << ", N = " << s.accumulate << ", 2 processes, median of " << s.repeat << "\n"
                << "| unit_prefetch | reshard_after_forward | window ms | gathers / window | launched ahead / window | "
                   "host ms in gathers / window | peak B/param |\n|---|---|---|---|---|---|---|\n";
      for (const auto& [prefetch, reshard] : std::vector<std::pair<int, int>>{{0, 1}, {1, 1}, {2, 1}, {0, 0}, {1, 0}}) {
        Settings run = s;
        run.stage = 3;
        run.prefetch = prefetch;
        run.reshard = reshard;
        const Result m = measure(run, 2);
        std::printf("| %d | %s | %.1f | %.1f | %.1f | %.1f | %.2f |\n", prefetch, reshard ? "true" : "false", m.ms, m.gathers,
                    m.ahead, m.gather_ms, m.peak);
        std::fflush(stdout);
      }
    }
    if (s.table == "checkpoint") {
      std::printf("Checkpoints: FP32, stage 2, %.1f M parameters, AdamW, batch %lld, %lld MiB buckets, %lld windows while "
                  "writing, median of %lld\n",
                  millions, static_cast<long long>(s.batch), static_cast<long long>(s.bucket_mib),
                  static_cast<long long>(s.windows), static_cast<long long>(s.repeat));
      std::printf("| W | format | write | pause ms | written ms | window alone ms | window during ms | peak MB rank 0 | "
                  "peak MB other ranks | files MB |\n|---|---|---|---|---|---|---|---|---|---|\n");
      for (const int world : {1, 2, 4})
        for (const std::string format : {"single", "sharded"})
          for (const int background : {0, 1}) {
            Settings run = s;
            run.stage = 2;
            run.format = format;
            run.background = background;
            std::vector<SaveResult> runs;
            for (std::int64_t k = 0; k < run.repeat; ++k) runs.push_back(launch_save(path, run, world, ++port));
            SaveResult m;
            for (double SaveResult::*field : {&SaveResult::pause, &SaveResult::written, &SaveResult::during, &SaveResult::alone,
                                              &SaveResult::peak, &SaveResult::peak_others, &SaveResult::bytes}) {
              std::vector<double> v;
              for (const auto& r : runs) v.push_back(r.*field);
              m.*field = median_of(v);
            }
            std::printf("| %d | %s | %s | %.1f | %.1f | %.1f | %.1f | %.0f | %s | %.0f |\n", world,
                        format == "single" ? "one file" : "set", background ? "background" : "blocking", m.pause, m.written,
                        m.alone, background ? m.during : 0.0, m.peak,
                        world > 1 ? std::to_string(static_cast<long long>(m.peak_others)).c_str() : "-", m.bytes);
            std::fflush(stdout);
          }
    }
    return 0;
  } catch (const std::exception& e) {
    std::cerr << "error: " << e.what() << std::endl;
    return 1;
  }
}
