#pragma once
/// The random generators a training state includes (step.md, "State"), saved and restored in
/// one place: the CPU generator (data order, CPU dropout) and, when the trainer's device is a
/// GPU, that device's CUDA generator (dropout on the GPU). Records "rng.cpu" and "rng.cuda".
/// RngStates holds them in memory.
#include <trainkit/detail/checkpoint_io.hpp>

#include <ATen/Context.h>
#include <ATen/core/Generator.h>
#include <torch/serialize/archive.h>
#include <torch/types.h>

#include <cstdint>
#include <initializer_list>
#include <mutex>
#include <utility>
#include <vector>

namespace trainkit::detail {

/// The states of the default generators of some devices (the CPU, and CUDA devices), to put
/// back in the same process: recompute's replayed forward, a replayed window. A CUDA
/// generator's state (seed and offset) is host state: neither taking nor restoring it syncs.
struct RngStates {
  std::vector<std::pair<c10::Device, torch::Tensor>> states;

  /// The generators a trainer on `device` draws from: the CPU's and, on a GPU, that device's.
  static RngStates of(torch::Device device) {
    std::vector<c10::Device> devices{c10::Device(c10::kCPU)};
    if (device.is_cuda()) devices.push_back(device);
    return capture(devices);
  }

  static RngStates capture(const std::vector<c10::Device>& devices) {
    RngStates out;
    for (const auto& device : devices) {
      auto generator = at::globalContext().defaultGenerator(device);
      std::lock_guard<std::mutex> lock(generator.mutex());
      out.states.emplace_back(device, generator.get_state());
    }
    return out;
  }
  void restore() const {
    for (const auto& [device, state] : states) {
      auto generator = at::globalContext().defaultGenerator(device);
      std::lock_guard<std::mutex> lock(generator.mutex());
      generator.set_state(state);
    }
  }
};

inline void save_rng_states(torch::serialize::OutputArchive& archive, torch::Device device) {
  {
    auto generator = at::detail::getDefaultCPUGenerator();
    std::lock_guard<std::mutex> lock(generator.mutex());
    archive.write("rng.cpu", generator.get_state(), /*is_buffer=*/true);
  }
  if (device.is_cuda()) {
    auto generator = at::globalContext().defaultGenerator(device);
    std::lock_guard<std::mutex> lock(generator.mutex());
    archive.write("rng.cuda", generator.get_state(), /*is_buffer=*/true);
  }
}

/// Restores what save_rng_states wrote; a checkpoint without "rng.cuda" (written on the CPU)
/// leaves the CUDA generator as it is. Throws when "rng.cpu" is missing.
inline void load_rng_states(torch::serialize::InputArchive& archive, torch::Device device) {
  const torch::Tensor cpu = read_tensor(archive, "rng.cpu");
  {
    auto generator = at::detail::getDefaultCPUGenerator();
    std::lock_guard<std::mutex> lock(generator.mutex());
    generator.set_state(cpu);
  }
  torch::Tensor cuda;
  if (device.is_cuda() && archive.try_read("rng.cuda", cuda, /*is_buffer=*/true)) {
    auto generator = at::globalContext().defaultGenerator(device);
    std::lock_guard<std::mutex> lock(generator.mutex());
    generator.set_state(cuda);
  }
}

/// A seed that is a pure function of `parts` (splitmix64 over each in turn).
inline std::uint64_t mix_seed(std::initializer_list<std::uint64_t> parts) {
  std::uint64_t h = 0x243F6A8885A308D3ull;
  for (const std::uint64_t p : parts) {
    std::uint64_t z = (h ^ p) + 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    h = z ^ (z >> 31);
  }
  return h;
}

/// Seeds the CPU generator and, on a GPU, that device's CUDA generator (no other device's; no
/// host sync: a CUDA generator's seed is host state).
inline void seed_rng_states(std::uint64_t seed, torch::Device device) {
  {
    auto generator = at::detail::getDefaultCPUGenerator();
    std::lock_guard<std::mutex> lock(generator.mutex());
    generator.set_current_seed(seed);
  }
  if (device.is_cuda()) {
    auto generator = at::globalContext().defaultGenerator(device);
    std::lock_guard<std::mutex> lock(generator.mutex());
    generator.set_current_seed(seed);
  }
}

}  // namespace trainkit::detail
