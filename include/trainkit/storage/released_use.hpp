#pragma once
/// ZeRO stage 3: a unit's parameters exist only inside its call through tk::unit; between its
/// calls their storage is released (detail/released_storage.hpp), and an operator that reads a
/// released parameter reads LibTorch's null data pointer: a view of it is refused with
/// "out of bounds for storage of size 0", an element-wise operation crashes the process. While a
/// ReleasedUseGuard lives (the trainer's first forward at stage 3, Trainer::forward), every
/// operator's tensor inputs are checked first: a released unit's buffer is allocated (zeros),
/// so that the operator reads memory, and remembered; check(), after the forward, releases it
/// again and throws a std::logic_error naming the unit and the operator. Later forwards are not
/// checked (the check costs an observer call per operator); a view of a released parameter is
/// still named there (UnitGathers::released_use).
///
/// The observer is ATen's (at::RecordFunction, thread-local, registered only while the guard
/// lives); its function has no user data, so the guard it serves is this thread's
/// (docs/design/README.md, the ambient states).
#include <trainkit/detail/released_storage.hpp>
#include <trainkit/storage/unit_gathers.hpp>

#include <ATen/record_function.h>

#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

namespace trainkit::detail {

class ReleasedUseGuard {
 public:
  explicit ReleasedUseGuard(const UnitGathers& gathers) : gathers_(gathers) {
    TORCH_CHECK(active() == nullptr, "ReleasedUseGuard: one at a time on a thread");
    active() = this;
    handle_ = at::addThreadLocalCallback(
        at::RecordFunctionCallback(&ReleasedUseGuard::starts).needsInputs(true).scopes({at::RecordScope::FUNCTION}));
  }
  ~ReleasedUseGuard() {
    at::removeCallback(handle_);
    active() = nullptr;
    for (const auto u : used_) gathers_.release_unit_buffer(u);  // (also when check() was not reached)
  }
  ReleasedUseGuard(const ReleasedUseGuard&) = delete;
  ReleasedUseGuard& operator=(const ReleasedUseGuard&) = delete;

  /// After the forward: throws when an operator read a released unit's parameter.
  void check() {
    if (used_.empty()) return;
    throw std::logic_error("trainkit: the forward used a parameter of unit " + gathers_.units_text(used_, " and ") +
                           " while the unit was released (first in " + first_op_ + "): at ZeRO stage 3 "
                           "(TRAIN.ZERO_STAGE: 3) a unit's parameters exist only inside its call through tk::unit. " +
                           UnitGathers::call_through_unit());
  }

 private:
  static ReleasedUseGuard*& active() {
    thread_local ReleasedUseGuard* guard = nullptr;
    return guard;
  }
  static std::unique_ptr<at::ObserverContext> starts(const at::RecordFunction& fn) {
    ReleasedUseGuard* self = active();
    if (self == nullptr) return nullptr;
    for (const auto& input : fn.inputs()) {
      if (input.isTensor()) self->seen(input.toTensor(), fn);
      else if (input.isTensorList())
        for (const auto& t : input.toTensorVector()) self->seen(t, fn);
    }
    return nullptr;
  }
  void seen(const at::Tensor& t, const at::RecordFunction& fn) {
    if (!t.defined() || !t.has_storage() || !is_released(t)) return;
    const std::int64_t u = gathers_.unit_of_storage(t.storage().unsafeGetStorageImpl());
    if (u < 0) return;
    gathers_.allocate_unit_buffer(u);  // (zeros: the operator reads memory; check() throws)
    if (used_.empty()) first_op_ = fn.name();
    used_.push_back(u);
  }

  const UnitGathers& gathers_;
  at::CallbackHandle handle_ = 0;
  std::vector<std::int64_t> used_;
  std::string first_op_;
};

}  // namespace trainkit::detail
