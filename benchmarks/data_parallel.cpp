// Data parallel: what trainkit sends per optimizer step (one bucketed all-reduce per window)
// against VL-BERT's behaviour (an all-reduce after every micro-batch's backward, as DDP without
// no_sync), for accumulation N = 1, 4, 8, two ranks on loopback (Gloo, CPU), in the same run.
//
//   build/benchmarks/data_parallel [--params-millions 2] [--steps 10] [--repeats 3] [--batch 8]
//
// Started without RANK it launches itself twice (ranks 0 and 1, a free port) and prints rank
// 0's table. Both modes give the same parameters (the eager mode averages each partial sum;
// averaging is linear), the table shows the largest difference. Each rank uses one intra-op
// thread. Timings on a shared machine are noisy: the median over repeats is printed.
#include <trainkit/parallel/data_parallel.hpp>
#include <trainkit/trainer/trainer.hpp>

#include "../tests/support/counting_backend.hpp"

#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <iostream>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include <netinet/in.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

extern char** environ;
namespace tk = trainkit;

namespace {

std::map<std::string, std::string> parse(int argc, char** argv) {
  std::map<std::string, std::string> kv{{"params-millions", "2"}, {"steps", "10"}, {"repeats", "3"}, {"batch", "8"}};
  for (int i = 1; i + 1 < argc; i += 2) kv[std::string(argv[i]).substr(2)] = argv[i + 1];
  return kv;
}

int launch(int argc, char** argv) {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr));
  socklen_t len = sizeof(addr);
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
  ::close(fd);
  const std::string port = std::to_string(ntohs(addr.sin_port));
  std::vector<pid_t> pids;
  for (int r = 0; r < 2; ++r) {
    std::vector<std::string> env;
    for (char** e = environ; *e; ++e) env.emplace_back(*e);
    env.push_back("RANK=" + std::to_string(r));
    env.push_back("WORLD_SIZE=2");
    env.push_back("MASTER_ADDR=127.0.0.1");
    env.push_back("MASTER_PORT=" + port);
    std::vector<char*> envp;
    for (auto& s : env) envp.push_back(s.data());
    envp.push_back(nullptr);
    posix_spawn_file_actions_t actions;
    posix_spawn_file_actions_init(&actions);
    if (r != 0) posix_spawn_file_actions_addopen(&actions, 1, "/dev/null", O_WRONLY, 0);
    pid_t pid;
    if (::posix_spawn(&pid, "/proc/self/exe", &actions, nullptr, argv, envp.data()) != 0) {
      std::cerr << "could not start a rank\n";
      return 1;
    }
    posix_spawn_file_actions_destroy(&actions);
    pids.push_back(pid);
  }
  int rc = 0;
  for (pid_t pid : pids) {
    int status = 0;
    ::waitpid(pid, &status, 0);
    if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) rc = 1;
  }
  (void)argc;
  return rc;
}

int work(const std::map<std::string, std::string>& kv) {
  torch::set_num_threads(1);
  const double millions = std::stod(kv.at("params-millions"));
  const int steps = std::stoi(kv.at("steps")), repeats = std::stoi(kv.at("repeats"));
  const std::int64_t batch = std::stoll(kv.at("batch")), width = 512;
  const int layers = std::max(1, static_cast<int>(millions * 1e6 / (width * width + width) + 0.5));

  auto base = tk::ProcessGroup::create(tk::DistributedOptions().timeout_seconds(300));
  auto counter = c10::make_intrusive<trainkit_testing::CountingBackend>(base.backend());
  tk::ProcessGroup group = base.over(counter);

  using Trainer = tk::Trainer<tk::PrecisionPolicy<tk::FP32>, tk::AccumulationPolicy<tk::Dynamic>>;
  std::printf("data parallel, 2 ranks on loopback (Gloo, CPU, 1 thread each): %d x Linear(%lld, %lld), "
              "micro-batch %lld, %d optimizer steps x %d repeats (median)\n",
              layers, static_cast<long long>(width), static_cast<long long>(width),
              static_cast<long long>(batch), steps, repeats);
  std::printf("%3s  %-26s %10s %12s %10s %9s %12s\n", "N", "mode", "calls/step", "MB/step/rank",
              "ms/step", "vs window", "max |diff|");
  for (const int n : {1, 4, 8}) {
    // Both modes side by side, timed in alternation (repeat r of one, then of the other), so
    // that a change of the machine's load hits both alike.
    struct Mode {
      bool eager;
      torch::nn::Sequential model;
      std::unique_ptr<Trainer> trainer;
      std::vector<double> times;
      std::int64_t calls = 0, bytes = 0;
    };
    std::vector<Mode> modes;
    for (const bool eager : {false, true}) {
      Mode m{eager, torch::nn::Sequential(), nullptr, {}, 0, 0};
      torch::manual_seed(0);
      for (int l = 0; l < layers; ++l) m.model->push_back(torch::nn::Linear(width, width));
      m.trainer = std::make_unique<Trainer>(m.model, tk::SGD{1e-3}, tk::TrainerOptions().accumulation_steps(n));
      m.trainer->set_replicas(std::make_shared<tk::DataParallel>(group));
      modes.push_back(std::move(m));
    }
    auto gen = at::make_generator<at::CPUGeneratorImpl>(1 + group.rank());
    const auto x = torch::randn({batch, width}, gen);
    auto micro = [&](Mode& m) {
      const bool closes = m.trainer->window_position() + 1 == n;
      m.trainer->micro_step([&] { return m.model->forward(x).square().mean(); });
      if (m.eager && !closes) {
        // VL-BERT / DDP without no_sync: every backward all-reduces (and averages) the
        // gradient accumulated so far.
        auto g = m.trainer->gradients();
        group.all_reduce(g, "eager all-reduce");
        g.mul_(1.0 / group.world_size());
      }
    };
    for (auto& m : modes)
      for (int w = 0; w < n; ++w) micro(m);  // warm-up window
    for (int rep = 0; rep < repeats; ++rep)
      for (auto& m : modes) {
        const auto c0 = counter->all_reduce_calls, b0 = counter->all_reduce_bytes;
        const auto t0 = std::chrono::steady_clock::now();
        for (int s = 0; s < steps * n; ++s) micro(m);
        m.times.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count() / steps);
        m.calls = counter->all_reduce_calls - c0;
        m.bytes = counter->all_reduce_bytes - b0;
      }
    double window_ms = 0;
    for (auto& m : modes) {
      std::sort(m.times.begin(), m.times.end());
      const double ms = m.times[m.times.size() / 2];
      if (!m.eager) window_ms = ms;
      const double diff = (m.trainer->parameters() - modes[0].trainer->parameters()).abs().max().item<double>();
      std::printf("%3d  %-26s %10.1f %12.2f %10.2f %9.2f %12.3g\n", n,
                  m.eager ? "every micro-step (VL-BERT)" : "window boundary (trainkit)",
                  static_cast<double>(m.calls) / steps, static_cast<double>(m.bytes) / steps / 1e6, ms,
                  ms / window_ms, diff);
    }
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    if (std::getenv("RANK") == nullptr) return launch(argc, argv);
    return work(parse(argc, argv));
  } catch (const std::exception& e) {
    std::cerr << "error: " << e.what() << std::endl;
    return 1;
  }
}
