#pragma once
/// Which Trainer type a configuration needs, as values (no LibTorch): the precision, clipping
/// and accumulation of `Trainer<PrecisionPolicy<P>, AccumulationPolicy<N>, ClipPolicy<C>>`.
/// A Trainer's name() is its key's name(): the one place the name is formatted.
#include <trainkit/step/tags.hpp>

#include <string>

namespace trainkit {

struct TrainerKey {
  /// AccumulationPolicy<Dynamic>: the window length is read at run time.
  static constexpr int dynamic = -1;
  PrecisionKind precision = PrecisionKind::FP32;
  int accumulation = 1;  ///< micro-batches per window, or `dynamic`
  ClipKind clip = ClipKind::NoClip;
  /// PrecisionPolicy<MasterWeights<precision>> (precision BF16 or FP16*; TRAIN.MASTER_WEIGHTS).
  bool master_weights = false;

  /// The key of the tags' Trainer: TrainerKey::of<MasterWeights<BF16>, 4, ClipNorm>().
  template <class PrecisionTag, int N, class ClipTag>
  static constexpr TrainerKey of() {
    return {PrecisionTag::kind, N, ClipTag::kind, PrecisionTag::master_weights};
  }

  /// The key the registry (registry.hpp) runs: the same with AccumulationPolicy<Dynamic>, whose
  /// window length is then the run-time TrainerOptions::accumulation_steps. A fixed count
  /// generates the same step (measured: benchmarks/accumulation_fixed_vs_dynamic), so the
  /// registry compiles Dynamic only.
  TrainerKey dispatched() const;
  /// "Trainer<FP16Dynamic, Accumulate<4>, ClipNorm>": logs, checkpoints (checked on load).
  std::string name() const;
  friend constexpr bool operator==(const TrainerKey& a, const TrainerKey& b) {
    return a.precision == b.precision && a.accumulation == b.accumulation && a.clip == b.clip &&
           a.master_weights == b.master_weights;
  }
  friend constexpr bool operator!=(const TrainerKey& a, const TrainerKey& b) { return !(a == b); }
};

inline TrainerKey TrainerKey::dispatched() const {
  TrainerKey k = *this;
  k.accumulation = dynamic;
  return k;
}

inline std::string TrainerKey::name() const {
  const std::string n = accumulation == dynamic ? "Dynamic" : std::to_string(accumulation);
  const std::string p = master_weights ? std::string("MasterWeights<") + to_string(precision) + ">"
                                       : std::string(to_string(precision));
  return "Trainer<" + p + ", Accumulate<" + n + ">, " + to_string(clip) + ">";
}

}  // namespace trainkit
