#pragma once
/// The definitions of trainkit/detail/rng_state.hpp (header-only: included by it; compiled mode:
/// by src/trainkit.cpp alone). See docs/design/compiled-mode.md.
#include <trainkit/detail/rng_state.hpp>

namespace trainkit::detail {

TRAINKIT_INLINE RngStates RngStates::of(torch::Device device) {
  std::vector<c10::Device> devices{c10::Device(c10::kCPU)};
  if (device.is_cuda()) devices.push_back(device);
  return capture(devices);
}

TRAINKIT_INLINE RngStates RngStates::capture(const std::vector<c10::Device>& devices) {
  RngStates out;
  for (const auto& device : devices) {
    auto generator = at::globalContext().defaultGenerator(device);
    std::lock_guard<std::mutex> lock(generator.mutex());
    out.states.emplace_back(device, generator.get_state());
  }
  return out;
}

TRAINKIT_INLINE void RngStates::restore() const {
  for (const auto& [device, state] : states) {
    auto generator = at::globalContext().defaultGenerator(device);
    std::lock_guard<std::mutex> lock(generator.mutex());
    generator.set_state(state);
  }
}

TRAINKIT_INLINE void save_rng_states(torch::serialize::OutputArchive& archive, torch::Device device) {
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

TRAINKIT_INLINE void load_rng_states(torch::serialize::InputArchive& archive, torch::Device device) {
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

TRAINKIT_INLINE std::uint64_t mix_seed(std::initializer_list<std::uint64_t> parts) {
  std::uint64_t h = 0x243F6A8885A308D3ull;
  for (const std::uint64_t p : parts) {
    std::uint64_t z = (h ^ p) + 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    h = z ^ (z >> 31);
  }
  return h;
}

TRAINKIT_INLINE void seed_rng_states(std::uint64_t seed, torch::Device device) {
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
