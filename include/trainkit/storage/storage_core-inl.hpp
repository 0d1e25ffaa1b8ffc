#pragma once
/// The definitions of trainkit/storage/storage_core.hpp (header-only: included by it; compiled
/// mode: by src/trainkit.cpp alone). See docs/design/compiled-mode.md. (Its defaults for each
/// mode are in storage_base-inl.hpp, where every mode is complete.)
#include <trainkit/storage/records.hpp>
#include <trainkit/storage/storage_core.hpp>

#include <c10/core/CachingDeviceAllocator.h>

namespace trainkit::detail {

TRAINKIT_INLINE StorageCore::StorageCore(torch::nn::Module& model, const TrainerOptions& options, torch::Device device,
                                         std::int64_t element_size, bool any_floating_point)
    : options_(options),
      device_(device),
      element_size_(element_size),
      units_configured_(options.sharding() == Sharding::parameters),
      placement_(model, options, device, element_size, any_floating_point, units_configured_) {}

TRAINKIT_INLINE void StorageCore::release_cached(torch::Device device) {
  if (!device.is_cpu()) c10::getDeviceAllocator(device.type())->emptyCache();
}

TRAINKIT_INLINE void StorageCore::save_local_values(torch::serialize::OutputArchive& archive,
                                                    torch::nn::Module& module, const ShardingMode& mode) const {
  mode.write_local(archive, "model.param.", params_);
  write_frozen(archive, module);
}

TRAINKIT_INLINE void StorageCore::load_local_values(torch::serialize::InputArchive& archive, torch::nn::Module& module,
                                                    const ShardingMode& mode) {
  mode.read_local(archive, "model.param.", params_);
  read_frozen(archive, module);
}

}  // namespace trainkit::detail
