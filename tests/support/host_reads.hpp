#pragma once
// Counts the calls that read a tensor's value to the host, which on a GPU wait for the stream
// (.item(), a data-dependent shape), at any depth, through ATen's RecordFunction callbacks: the
// CPU tests' stand-in for gpu_check's count of CUDA synchronising calls.
//
// Not counted: reads inside the fused optimizer kernels (aten::_fused_adamw_, _fused_adam_,
// _fused_sgd_), whose CPU versions read their tensor LR, scale and found-inf flag on the host
// where the CUDA kernels read them on the device; and `.cpu()`, since on the CPU a
// device-to-host copy cannot be told from a host one (gpu_check counts those on a GPU).
#include <ATen/record_function.h>

#include <atomic>
#include <cstdint>
#include <string>

namespace trainkit_testing {

/// host_reads_in(f): the host reads f makes (on any thread).
template <class F>
std::int64_t host_reads_in(F&& f) {
  static std::atomic<std::int64_t> reads{0};
  static thread_local int in_fused_kernel = 0;
  static auto fused_kernel = [](const std::string& name) {
    return name == "aten::_fused_adamw_" || name == "aten::_fused_adam_" || name == "aten::_fused_sgd_";
  };
  const auto handle = at::addGlobalCallback(
      at::RecordFunctionCallback(
          [](const at::RecordFunction& fn) -> std::unique_ptr<at::ObserverContext> {
            const std::string name = fn.name();
            if (fused_kernel(name)) ++in_fused_kernel;
            else if (in_fused_kernel == 0 && (name == "aten::_local_scalar_dense" || name == "aten::is_nonzero" ||
                                              name == "aten::nonzero" || name == "aten::equal"))
              ++reads;
            return nullptr;
          },
          [](const at::RecordFunction& fn, at::ObserverContext*) {
            if (fused_kernel(fn.name())) --in_fused_kernel;
          })
          .scopes({at::RecordScope::FUNCTION}));
  reads = 0;
  struct Remove {
    at::CallbackHandle handle;
    ~Remove() { at::removeCallback(handle); }
  } remove{handle};
  f();
  return reads.load();
}

}  // namespace trainkit_testing
