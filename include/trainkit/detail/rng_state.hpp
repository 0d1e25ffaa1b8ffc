#pragma once
/// The random generators a training state includes (docs/design/checkpoints.md), saved and restored in
/// one place: the CPU generator (data order, CPU dropout) and, when the trainer's device is a
/// GPU, that device's CUDA generator (dropout on the GPU). Records "rng.cpu" and "rng.cuda".
/// RngStates holds them in memory.
#include <trainkit/detail/inline.hpp>
#include <trainkit/archive/checkpoint_io.hpp>

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
  static RngStates of(torch::Device device);

  static RngStates capture(const std::vector<c10::Device>& devices);
  void restore() const;
};

void save_rng_states(torch::serialize::OutputArchive& archive, torch::Device device);

/// Restores what save_rng_states wrote; a checkpoint without "rng.cuda" (written on the CPU)
/// leaves the CUDA generator as it is. Throws when "rng.cpu" is missing.
void load_rng_states(torch::serialize::InputArchive& archive, torch::Device device);

/// A seed that is a pure function of `parts` (splitmix64 over each in turn).
std::uint64_t mix_seed(std::initializer_list<std::uint64_t> parts);

/// Seeds the CPU generator and, on a GPU, that device's CUDA generator (no other device's; no
/// host sync: a CUDA generator's seed is host state).
void seed_rng_states(std::uint64_t seed, torch::Device device);

}  // namespace trainkit::detail

#ifndef TRAINKIT_COMPILED_LIB
#include <trainkit/detail/rng_state-inl.hpp>
#endif
