#pragma once
/// Releasing a flat buffer's memory while its views stay: Sharding::gradients frees the model's
/// gradient between windows this way, so that the parameters' .grad stay the same tensors.
#include <c10/core/DeviceGuard.h>
#include <torch/types.h>

#include <cstddef>
#include <stdexcept>
#include <string>

namespace trainkit::detail {

/// Frees the memory of the flat buffer `t` (a whole storage), leaving its views in place: their
/// sizes stay, their data are gone until allocate_released() (FSDP's storage resize to 0).
/// Sharding::gradients releases the model's gradient between windows this way, so that the
/// parameters' .grad stay the same tensors.
inline void release_storage(const torch::Tensor& t) {
  auto* impl = t.storage().unsafeGetStorageImpl();
  impl->set_data_ptr_noswap(at::DataPtr(nullptr, t.device()));
  impl->set_nbytes(0);
}
/// The storage of the flat buffer `t` allocated again (zeros, unless `zero` is false: its
/// contents are then undefined until written) after release_storage(), on `t`'s device (CUDA's
/// allocator allocates on the current device, which need not be it).
inline void allocate_released(const torch::Tensor& t, bool zero = true) {
  const c10::OptionalDeviceGuard on_its_device(t.device());
  auto* impl = t.storage().unsafeGetStorageImpl();
  const auto bytes = static_cast<size_t>(t.numel()) * t.element_size();
  impl->set_data_ptr_noswap(impl->allocator()->allocate(bytes));
  impl->set_nbytes(bytes);
  if (zero) t.zero_();
}
inline bool is_released(const torch::Tensor& t) { return t.storage().nbytes() == 0 && t.numel() > 0; }

/// Throws unless `t` (model parameter `name`) holds its data: a parameter of a unit of ZeRO
/// stage 3 is released between the trainer's uses of it, and reading or writing it then would
/// touch no memory. `what` says what was about to use it.
inline void check_not_released(const std::string& name, const torch::Tensor& t, const std::string& what) {
  if (t.defined() && is_released(t))
    throw std::logic_error(what + ": parameter '" + name + "' is sharded over the ranks (ZeRO stage 3, "
                           "TRAIN.ZERO_STAGE: 3) and released on this rank between the trainer's uses of it; "
                           "save or load through the trainer (trainer.save / trainer.load, which read and write "
                           "every rank's slices), or load weights before building the trainer");
}

}  // namespace trainkit::detail
