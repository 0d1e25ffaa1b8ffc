#pragma once
/// Once per window the storage checks that the model's parameters and their .grad are still its
/// views (docs/design/storage.md): a parameter whose data were replaced after the trainer was
/// built (torch::load(model, ...), set_data, model->to(...)), or a .grad reset by zero_grad(),
/// is a std::logic_error naming the parameter; otherwise the optimizer would update a copy the
/// model no longer reads. A pointer compare per parameter.
#include <trainkit/storage/placement.hpp>

#include <c10/core/StorageImpl.h>
#include <torch/types.h>

#include <stdexcept>
#include <string>
#include <vector>

namespace trainkit::detail {

class ViewCheck {
 public:
  void clear() { views_.clear(); }
  /// Records `e`'s views as they are now (after its data and .grad are set). The .grad is
  /// compared by its storage (a StorageImpl: stage 2 releases and reallocates the gradient's
  /// memory, so its data pointer changes while the views stay); a parameter without .grad
  /// (stage 3: they exist only inside a backward) is compared by its data alone.
  void record(const PlacedParameter& e) {
    views_.push_back({e.param, e.param.grad().defined() ? e.param.grad().storage().unsafeGetStorageImpl() : nullptr,
                      e.param.storage().unsafeGetStorageImpl(), e.name});
  }
  /// Every parameter of `parameters` recorded afresh.
  void record_all(const std::vector<PlacedParameter>& parameters) {
    views_.clear();
    for (const auto& e : parameters) record(e);
  }
  void check() const {
    for (const auto& v : views_)
      if (v.param.storage().unsafeGetStorageImpl() != v.param_storage)
        throw std::logic_error(
            "Trainer: parameter '" + v.name + "' no longer lives in the trainer's storage: its data were replaced "
            "after the trainer was built (torch::load(model, file), param.set_data(...), model->to(...)), so the "
            "optimizer would update a copy the model does not read and the loss would never change. Load weights "
            "or move the model before building the trainer, or use trainer.load(path) or tk::load_weights(model, "
            "path), which copy into the parameters");
    for (const auto& v : views_)
      if (v.grad_storage != nullptr &&
          (!v.param.grad().defined() || v.param.grad().storage().unsafeGetStorageImpl() != v.grad_storage))
        throw std::logic_error(
            "Trainer: the .grad of parameter '" + v.name +
            "' was replaced or reset (model->zero_grad() or an optimizer's zero_grad()?); the "
            "trainer owns gradients and zeroes them itself after each optimizer step");
  }

 private:
  struct View {
    torch::Tensor param;
    const c10::StorageImpl* grad_storage;   // the .grad's storage
    const c10::StorageImpl* param_storage;  // the parameter's (its data move when a unit of stage 3 is gathered)
    std::string name;
  };
  std::vector<View> views_;
};

}  // namespace trainkit::detail
