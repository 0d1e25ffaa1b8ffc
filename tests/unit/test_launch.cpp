// Where a configured run trains (trainkit/run/launch.hpp): GPUS against the launch and the
// machine, as a pure function of the device count (no GPU needed), and the one-process launch.
#if __has_include(<gloo/algorithm.h>)

#include "../support/helpers.hpp"

#include <trainkit/run/launch.hpp>

#include <atomic>
#include <chrono>
#include <memory>
#include <stdexcept>
#include <string>
#include <thread>

namespace test_launch {  // this file's names, apart from those of the files it shares a unity batch with

namespace tk = trainkit;

TEST_CASE("GPUS empty: the CPU without CUDA (said once), else the local rank's GPU") {
  const tk::DeviceChoice cpu = tk::choose_device("", 0, 1, 0);
  CHECK(cpu.device == torch::Device(torch::kCPU));
  CHECK(cpu.note == "GPUS is empty and this machine has no CUDA device: training on the CPU");
  CHECK(tk::choose_device("", 1, 2, 0).note.find("Gloo between the ranks") != std::string::npos);
  const tk::DeviceChoice gpu = tk::choose_device("", 3, 4, 8);
  CHECK(gpu.device == torch::Device(torch::kCUDA, 3));
  CHECK(gpu.note.empty());
  CHECK_THROWS_WITH_AS(tk::choose_device("", 2, 4, 2),
                       "GPUS: is empty, so local rank 2 would train on cuda:2, but this machine has 2 CUDA device(s); "
                       "launch at most 2 processes per node",
                       tk::ConfigError);
}

TEST_CASE("GPUS lists one device per process on the node: local rank i trains on the i-th") {
  CHECK(tk::choose_device("2,3", 0, 2, 4).device == torch::Device(torch::kCUDA, 2));
  CHECK(tk::choose_device("2, 3", 1, 2, 4).device == torch::Device(torch::kCUDA, 3));
  CHECK(tk::choose_device("1", 0, 1, 2).device == torch::Device(torch::kCUDA, 1));
}

TEST_CASE("GPUS that the launch or the machine contradicts is refused, naming GPUS") {
  // A list longer than the processes: VL-BERT's one-process DataParallel is not done here.
  CHECK_THROWS_WITH_AS(tk::choose_device("0,1,2,3", 0, 1, 4),
                       "GPUS: lists 4 device(s) ('0,1,2,3'), but this launch runs 1 process on this node: one process per "
                       "device, so launch with `torchrun --nproc-per-node 4 ...`",
                       tk::ConfigError);
  CHECK_THROWS_WITH_AS(tk::choose_device("0", 0, 2, 4), doctest::Contains("or list 2 devices"), tk::ConfigError);
  CHECK_THROWS_WITH_AS(tk::choose_device("0", 0, 1, 0),
                       "GPUS: lists CUDA device(s) '0', but this machine has no CUDA device (torch::cuda::is_available() "
                       "is false); set GPUS: '' to train on the CPU",
                       tk::ConfigError);
  CHECK_THROWS_WITH_AS(tk::choose_device("0,5", 1, 2, 4),
                       "GPUS: names cuda:5 ('0,5'), but this machine has 4 CUDA device(s), cuda:0 to cuda:3", tk::ConfigError);
  CHECK_THROWS_WITH_AS(tk::choose_device("1,1", 0, 2, 4), "GPUS: names cuda:1 twice ('1,1'); each process needs its own device",
                       tk::ConfigError);
}

TEST_CASE("one process: no group, rank 0 of 1, values pass through") {
  const tk::Launch l = tk::Launch::single();
  CHECK(l.world_size() == 1);
  CHECK(l.is_main());
  CHECK_FALSE(l.group().has_value());
  CHECK(l.device() == torch::Device(torch::kCPU));
  CHECK(l.agree(41) == 41);
  std::vector<double> values{1.5, 2.0};
  l.replicas().all_reduce(values, tk::Reduce::sum);
  CHECK(values == std::vector<double>{1.5, 2.0});
}

TEST_CASE("joining the group has a deadline: a join that never returns is an error, not an exit") {
  // (c10d's store client can wait forever on a port that answers but is no store; the library
  // must report it and leave the process to the program, never end it itself.)
  auto release = std::make_shared<std::atomic<bool>>(false);
  const auto t0 = std::chrono::steady_clock::now();
  CHECK_THROWS_WITH_AS(tk::detail::within(0.2, "joining took too long",
                                          [release] {
                                            while (!*release) std::this_thread::sleep_for(std::chrono::milliseconds(5));
                                            return 1;
                                          }),
                       "joining took too long", tk::DistributedError);
  const double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  CHECK(waited >= 0.2);
  CHECK(waited < 5.0);
  *release = true;  // the join left behind ends on its own
  CHECK(tk::detail::within(5.0, "unused", [] { return 41 + 1; }) == 42);
  CHECK_THROWS_WITH_AS(tk::detail::within(5.0, "unused", []() -> int { throw std::runtime_error("no store"); }),
                       "no store", std::runtime_error);
}

}  // namespace test_launch

#endif
