#pragma once
/// The definitions of trainkit/trainer_key.hpp (header-only: included by it; compiled mode:
/// by src/trainkit.cpp alone). See docs/design/compiled-mode.md.
#include <trainkit/trainer_key.hpp>

namespace trainkit {

TRAINKIT_INLINE TrainerKey TrainerKey::dispatched() const {
  TrainerKey k = *this;
  k.accumulation = dynamic;
  return k;
}

TRAINKIT_INLINE std::string TrainerKey::name() const {
  const std::string n = accumulation == dynamic ? "Dynamic" : std::to_string(accumulation);
  const std::string p = master_weights ? std::string("MasterWeights<") + to_string(precision) + ">"
                                       : std::string(to_string(precision));
  return "Trainer<" + p + ", Accumulate<" + n + ">, " + to_string(clip) + ">";
}

}  // namespace trainkit
