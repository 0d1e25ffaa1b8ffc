#pragma once
/// The definitions of trainkit/step/options.hpp (header-only: included by it; compiled mode:
/// by src/trainkit.cpp alone). See docs/design/compiled-mode.md.
#include <trainkit/step/options.hpp>

namespace trainkit {

TRAINKIT_INLINE void TrainerOptions::validate() const {
  auto fail = [](const std::string& what) {
    throw std::invalid_argument("trainkit::TrainerOptions: " + what);
  };
  const auto& s = loss_scale_;
  if (!(s.init_scale() > 0) || !std::isfinite(s.init_scale()))
    fail("loss_scale.init_scale must be finite and > 0, got " + std::to_string(s.init_scale()));
  if (!(s.growth_factor() > 1))
    fail("loss_scale.growth_factor must be > 1, got " + std::to_string(s.growth_factor()));
  if (!(s.backoff_factor() > 0 && s.backoff_factor() < 1))
    fail("loss_scale.backoff_factor must be in (0, 1), got " + std::to_string(s.backoff_factor()));
  if (s.growth_interval() < 1)
    fail("loss_scale.growth_interval must be >= 1, got " + std::to_string(s.growth_interval()));
  if (s.hysteresis() < 1)
    fail("loss_scale.hysteresis must be >= 1, got " + std::to_string(s.hysteresis()));
  if (!(s.min_scale() >= 0) || !(s.max_scale() > s.min_scale()))
    fail("loss_scale.min_scale/max_scale must satisfy 0 <= min < max");
  if (!(s.init_scale() >= s.min_scale() && s.init_scale() <= s.max_scale()))
    fail("loss_scale.init_scale " + std::to_string(s.init_scale()) + " must lie within [min_scale, max_scale] = [" +
         std::to_string(s.min_scale()) + ", " + std::to_string(s.max_scale()) + "]");
  if (s.collapse_windows() < 0)
    fail("loss_scale.collapse_windows must be >= 0 (0 disables the check)");
  if (!(s.static_scale() > 0) || !std::isfinite(s.static_scale()))
    fail("loss_scale.static_scale must be finite and > 0, got " + std::to_string(s.static_scale()));
  if (!(max_grad_norm_ > 0))
    fail("max_grad_norm must be > 0, got " + std::to_string(max_grad_norm_));
  if (unit_prefetch_ < 0) fail("unit_prefetch must be >= 0 (units gathered ahead), got " + std::to_string(unit_prefetch_));
  if (!(clip_value_ > 0)) fail("clip_value must be > 0, got " + std::to_string(clip_value_));
  if (master_chunk_ < 1) fail("master_chunk must be >= 1, got " + std::to_string(master_chunk_));
  if (accumulation_steps_ < 1)
    fail("accumulation_steps must be >= 1, got " + std::to_string(accumulation_steps_));
  for (const auto& [name, mult] : lr_mult_)
    if (!(mult >= 0) || !std::isfinite(mult))
      fail("lr_mult[\"" + name + "\"] must be finite and >= 0, got " + std::to_string(mult));
  for (const auto& name : no_decay_)
    if (name.empty()) fail("no_decay has an empty name (it would match every parameter)");
}

}  // namespace trainkit
