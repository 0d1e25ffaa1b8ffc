// nccl_startup: how long trainkit's process group takes to form with NCCL at world size 1
// (the in-memory store), and its first collective. Built only where include/trainkit/
// distributed.hpp exists (benchmarks/gpu/CMakeLists.txt) and run by benchmarks/gpu/run.sh.
#include "harness.hpp"

#include <trainkit/distributed.hpp>

#include <cstdio>
#include <iostream>

namespace tk = trainkit;

int main() try {
  const torch::Device device(torch::kCUDA, 0);
  auto x = torch::ones({1 << 20}, torch::TensorOptions().device(device));  // CUDA context first
  bench::synchronize(device);
  const double t0 = bench::now_ms();
  auto group = tk::ProcessGroup::create(tk::DistributedOptions().backend("nccl"), device);
  const double t1 = bench::now_ms();
  std::printf("trainkit NCCL process group, world size %d: created in %.1f ms\n",
              static_cast<int>(group.world_size()), t1 - t0);
  return 0;
} catch (const std::exception& e) {
  std::cerr << "nccl_startup: " << e.what() << "\n";
  return 2;
}
