#pragma once
/// The definitions of trainkit/any_trainer.hpp (header-only: included by it; compiled mode:
/// by src/trainkit.cpp alone). See docs/design/compiled-mode.md.
#include <trainkit/any_trainer.hpp>

namespace trainkit {

TRAINKIT_INLINE MicroStepResult AnyTrainer::micro_step(const LossClosure& loss, std::int64_t items) {
  TORCH_CHECK(items >= 0, "micro_step: the item count must be >= 0, got ", items);
  return run_micro_step(loss, items);
}

TRAINKIT_INLINE MicroStepResult AnyTrainer::micro_step_pieces(const PieceLoss& loss,
                                                              const std::vector<std::int64_t>& items) {
  return run_micro_step_pieces(loss, items);
}

TRAINKIT_INLINE std::optional<AutocastRegion> AnyTrainer::precision_region() const {
  const auto dtype = autocast_dtype();
  if (!dtype) return std::nullopt;
  return std::optional<AutocastRegion>(std::in_place, device().type(), *dtype);
}

TRAINKIT_INLINE void AnyTrainer::save(const std::string& path) const {
  torch::serialize::OutputArchive archive;
  save(archive);
  if (saves_collectively() && !replicas().is_main()) return;
  detail::write_archive_atomically(archive, path);
}

TRAINKIT_INLINE void AnyTrainer::load(const std::string& path) {
  torch::serialize::InputArchive archive;
  detail::read_archive(archive, path);
  detail::load_or_restore(*this, archive, path);
}

}  // namespace trainkit
