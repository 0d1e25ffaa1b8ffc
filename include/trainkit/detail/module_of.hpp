#pragma once
/// The model a trainer is given, as a shared torch::nn::Module: from a ModuleHolder (`Linear`,
/// a TORCH_MODULE type), a std::shared_ptr<Module>, or a Module owned by a shared_ptr.
#include <trainkit/detail/type_traits.hpp>

#include <torch/nn/module.h>

#include <memory>
#include <stdexcept>
#include <type_traits>
#include <utility>

namespace trainkit {
namespace detail {

template <class T, class = void>
struct is_module_holder : std::false_type {};
template <class T>
struct is_module_holder<T, std::void_t<decltype(std::declval<T&>().ptr())>>
    : std::is_base_of<torch::nn::Module, typename T::ContainedType> {};

/// The model as a shared Module, from a ModuleHolder (`Linear`), a shared_ptr, or a Module
/// owned by a shared_ptr.
template <class M>
std::shared_ptr<torch::nn::Module> module_of(M& model) {
  if constexpr (is_module_holder<M>::value) {
    return model.ptr();
  } else if constexpr (std::is_base_of_v<torch::nn::Module, M>) {
    try {
      return model.shared_from_this();
    } catch (const std::bad_weak_ptr&) {
      throw std::invalid_argument(
          "Trainer: the model must be owned by a std::shared_ptr (or be a torch::nn::ModuleHolder "
          "such as a TORCH_MODULE type)");
    }
  } else {
    static_assert(always_false<M>,
                  "Trainer(model, ...): model must be a torch::nn::ModuleHolder (a TORCH_MODULE "
                  "type), a std::shared_ptr<Module>, or a Module owned by a shared_ptr");
  }
}
template <class M>
std::shared_ptr<torch::nn::Module> module_of(std::shared_ptr<M>& model) {
  static_assert(std::is_base_of_v<torch::nn::Module, M>,
                "Trainer(model, ...): model must derive from torch::nn::Module");
  TORCH_CHECK(model != nullptr, "Trainer: the model is null");
  return model;
}

}  // namespace detail
}  // namespace trainkit
