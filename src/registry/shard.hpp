#pragma once
/// One shard of the registry (registry.hpp): the definition of detail::make_registered<P> and
/// the explicit instantiations of TrainerOf<P, Dynamic, C> for every registered clip C.
/// Included only by the shard files that trainkit_add_registry (cmake/trainkitRegistry.cmake)
/// generates from the list in registry.hpp, each of which says
///   TRAINKIT_REGISTRY_SHARD(FP16Dynamic)
/// for some of the precisions: every registered Trainer type is compiled in exactly one
/// translation unit.
#include <trainkit/run/registry.hpp>
#include <trainkit/trainer/trainer.hpp>

#include <memory>
#include <utility>

namespace trainkit::detail {

template <class P>
std::unique_ptr<AnyTrainer> make_registered(ClipKind clip, std::shared_ptr<torch::nn::Module> model,
                                            const OptimizerSettings& optimizer, TrainerOptions options) {
  auto build = [&](auto clip_tag) -> std::unique_ptr<AnyTrainer> {
    using T = TrainerOf<P, Dynamic, typename decltype(clip_tag)::type>;
    return with_optimizer(optimizer, [&](auto rule) -> std::unique_ptr<AnyTrainer> {
      return std::make_unique<T>(model, rule, options);
    });
  };
#define TRAINKIT_SHARD_CASE_(P, C) \
  if (clip == C::kind) return build(TypeTag<C>{});
  TRAINKIT_REGISTRY_CLIPS(TRAINKIT_SHARD_CASE_, P)
#undef TRAINKIT_SHARD_CASE_
  throw ConfigError("TRAIN.CLIP_GRAD_NORM", std::string("no registered clipping '") + to_string(clip) + "'");
}

}  // namespace trainkit::detail

/// The shard of precision tag P: make_registered<P> and the registered Trainer<P, ...> types.
#define TRAINKIT_REGISTRY_SHARD(P)                                                          \
  namespace trainkit {                                                                      \
  TRAINKIT_REGISTRY_CLIPS(TRAINKIT_REGISTRY_INSTANTIATE_, P)                                \
  template std::unique_ptr<AnyTrainer> detail::make_registered<P>(                          \
      ClipKind, std::shared_ptr<torch::nn::Module>, const OptimizerSettings&, TrainerOptions); \
  }
