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
/// still named there (released_use, below).
///
/// The observer is ATen's (at::RecordFunction, thread-local, registered only while the guard
/// lives); its function has no user data, so the guard it serves is this thread's
/// (docs/design/README.md, the ambient states).
#include <trainkit/detail/released_storage.hpp>
#include <trainkit/storage/unit_gathers.hpp>

#include <ATen/record_function.h>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <sstream>
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

/// The forward failed with LibTorch's `error`. When it is the refusal to view a released
/// parameter (a unit's module called without tk::unit, or one of its parameters used outside
/// its unit's call: the weight's transpose in a Linear), what to say instead: the units
/// released at this point, those holding a parameter of the error's sizes (in any order: the
/// view may be the transpose) first. Empty for any other error.
inline std::string released_use(const UnitGathers& gathers, const std::string& error) {
  if (error.find("out of bounds for storage of size 0") == std::string::npos) return {};
  std::vector<std::int64_t> wanted;  // "sizes [a, b, ...]" of the refused view, sorted
  if (const auto at = error.find("sizes ["); at != std::string::npos) {
    std::istringstream in(error.substr(at + 7, error.find(']', at) - at - 7));
    for (std::string n; std::getline(in, n, ',');) wanted.push_back(std::stoll(n));
    std::sort(wanted.begin(), wanted.end());
  }
  const auto sized = [&](std::int64_t u) {
    for (size_t i = 0; i < gathers.params_.size(); ++i) {
      if (gathers.member_of_[i] != u) continue;
      auto sizes = gathers.params_[i].sizes().vec();
      std::sort(sizes.begin(), sizes.end());
      if (sizes == wanted) return true;
    }
    return false;
  };
  std::vector<std::int64_t> matching, released;
  for (std::int64_t u = 0; u < static_cast<std::int64_t>(gathers.units_.size()); ++u)
    if (!gathers.units_[static_cast<size_t>(u)].whole && !gathers.gathered(u))
      (sized(u) ? matching : released).push_back(u);
  if (matching.empty() && released.empty()) return {};
  const std::string which =
      !matching.empty() ? "unit " + gathers.units_text(matching, " or ") + " (a parameter of its sizes)"
                        : "one of the units released at this point, " + gathers.units_text(released, " or ");
  return "trainkit: the forward used a parameter of " + which +
         " while the unit was released: at ZeRO stage 3 (TRAIN.ZERO_STAGE: 3) a unit's parameters exist only "
         "inside its call through tk::unit. " + UnitGathers::call_through_unit() + ". LibTorch said: " +
         error.substr(0, error.find('\n'));
}

}  // namespace trainkit::detail
