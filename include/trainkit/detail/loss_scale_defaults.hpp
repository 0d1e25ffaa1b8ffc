#pragma once
/// The loss scale's defaults, in one place: `LossScaleOptions` (step/options.hpp, C++) and the
/// configuration's FP16_* keys (config/train_schema-inl.hpp) both take them from here, so a run
/// from C++ and a run from a configuration file scale alike. Growth and backoff are
/// torch.amp.GradScaler's; the floor and the ceiling are trainkit's (GradScaler has neither: a
/// floor is what makes a scale that cannot back off any further a stop instead of a silent
/// slide towards 0; see docs/design/logging.md, "Health warnings").
namespace trainkit::detail::loss_scale_defaults {

inline constexpr double init_scale = 65536.0;         // 2^16
inline constexpr double growth_factor = 2.0;
inline constexpr double backoff_factor = 0.5;
inline constexpr long long growth_interval = 2000;
inline constexpr long long hysteresis = 1;
inline constexpr double min_scale = 1.0;              // the floor (0: none)
inline constexpr double max_scale = 16777216.0;       // 2^24, the ceiling (infinity: none)
inline constexpr double static_scale = 128.0;         // FP16Static's fixed scale

}  // namespace trainkit::detail::loss_scale_defaults
