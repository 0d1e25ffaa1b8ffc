#pragma once
/// Releasing a flat buffer's memory while its views stay: Sharding::gradients frees the model's
/// gradient between windows this way, so that the parameters' .grad stay the same tensors.
#include <c10/core/DeviceGuard.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <torch/types.h>

#include <cstddef>
#include <stdexcept>
#include <string>

namespace trainkit::detail {

/// Frees the memory of the flat buffer `t` (a whole storage), leaving its views in place: their
/// sizes stay, their data are gone until allocate_released() (FSDP's storage resize to 0).
/// Sharding::gradients releases the model's gradient between windows this way, so that the
/// parameters' .grad stay the same tensors.
///
/// On a device with streams, the memory is recorded on this thread's current stream first
/// (Tensor::record_stream's call, c10/core/impl/DeviceGuardImplInterface.h
/// recordDataPtrOnStream): the caching allocator then reuses the block, on the stream that
/// allocated it, only once this stream has passed this point. A buffer that a collective used is
/// released after this thread's wait for it (ProcessGroupNCCL's Work::wait makes the current
/// stream wait for the collective's), so the block is never reused before the collective is
/// done, whichever thread and stream allocated it (a unit's gradient: autograd's device thread).
/// Where the allocating stream is this one, the record costs nothing (the allocator ignores it).
/// PGNCCL's own guard does not cover this: it keeps the tensors of a collective in flight
/// alive (TORCH_NCCL_AVOID_RECORD_STREAMS, its default), that is their StorageImpl, whose
/// memory this swaps out.
inline void release_storage(const torch::Tensor& t) {
  auto* impl = t.storage().unsafeGetStorageImpl();
  if (!t.is_cpu() && impl->data_ptr().get() != nullptr) {
    const auto* device = c10::impl::getDeviceGuardImpl(t.device().type());
    device->recordDataPtrOnStream(impl->data_ptr(), device->getStream(t.device()));
  }
  impl->set_data_ptr_noswap(at::DataPtr(nullptr, t.device()));
  impl->set_nbytes(0);
}
/// The memory of the flat buffer `t` taken out of it, as release_storage() leaves the buffer,
/// and handed to the caller instead of freed: memory that a failed collective may still write
/// (Replicas::keep_after_failure).
inline c10::DataPtr take_storage(const torch::Tensor& t) {
  auto* impl = t.storage().unsafeGetStorageImpl();
  auto memory = impl->set_data_ptr(at::DataPtr(nullptr, t.device()));
  impl->set_nbytes(0);
  return memory;
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
