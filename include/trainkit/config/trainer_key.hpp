#pragma once
/// What a configuration asks the registry for, as values (no torch): the precision, clipping and
/// accumulation of the Trainer type (TrainerKey) and the optimizer with its settings.
#include <string>

namespace trainkit {

/// The precision a configuration asks for (the PrecisionPolicy tag it dispatches to).
enum class PrecisionKind { FP32, BF16, FP16Static, FP16Dynamic };
/// The clipping a configuration asks for (the ClipPolicy tag it dispatches to).
enum class ClipKind { NoClip, ClipNorm, ClipValue };

inline const char* to_string(PrecisionKind p) {
  switch (p) {
    case PrecisionKind::FP32: return "FP32";
    case PrecisionKind::BF16: return "BF16";
    case PrecisionKind::FP16Static: return "FP16Static";
    case PrecisionKind::FP16Dynamic: return "FP16Dynamic";
  }
  return "?";
}
inline const char* to_string(ClipKind c) {
  switch (c) {
    case ClipKind::NoClip: return "NoClip";
    case ClipKind::ClipNorm: return "ClipNorm";
    case ClipKind::ClipValue: return "ClipValue";
  }
  return "?";
}

/// Which Trainer type a configuration needs: the three policies as values. Mirrors
/// `Trainer<PrecisionPolicy<P>, AccumulationPolicy<N>, ClipPolicy<C>>` without needing torch.
struct TrainerKey {
  /// AccumulationPolicy<Dynamic>: the window length is read at run time.
  static constexpr int dynamic = -1;
  PrecisionKind precision = PrecisionKind::FP32;
  int accumulation = 1;  ///< micro-batches per window, or `dynamic`
  ClipKind clip = ClipKind::NoClip;
  /// PrecisionPolicy<MasterWeights<precision>> (precision BF16 or FP16*; TRAIN.MASTER_WEIGHTS).
  bool master_weights = false;

  /// The key the registry (registry.hpp) runs: the same with AccumulationPolicy<Dynamic>, whose
  /// window length is then the run-time TrainerOptions::accumulation_steps. A fixed count
  /// generates the same step (measured: benchmarks/accumulation_fixed_vs_dynamic), so the
  /// registry compiles Dynamic only.
  TrainerKey dispatched() const {
    TrainerKey k = *this;
    k.accumulation = dynamic;
    return k;
  }
  /// Trainer<...>::name() of this key: "Trainer<FP16Dynamic, Accumulate<4>, ClipNorm>".
  std::string name() const {
    const std::string n = accumulation == dynamic ? "Dynamic" : std::to_string(accumulation);
    const std::string p = master_weights ? std::string("MasterWeights<") + to_string(precision) + ">"
                                         : std::string(to_string(precision));
    return "Trainer<" + p + ", Accumulate<" + n + ">, " + to_string(clip) + ">";
  }
  friend bool operator==(const TrainerKey& a, const TrainerKey& b) {
    return a.precision == b.precision && a.accumulation == b.accumulation && a.clip == b.clip &&
           a.master_weights == b.master_weights;
  }
  friend bool operator!=(const TrainerKey& a, const TrainerKey& b) { return !(a == b); }
};

/// The optimizer a configuration asks for, with VL-BERT's settings (AdamW: betas (0.9, 0.999),
/// eps 1e-6, decay on every parameter; Adam: torch.optim.Adam's defaults; SGD: dampening 0).
struct OptimizerSettings {
  std::string name = "SGD";  ///< "SGD", "Adam" or "AdamW"
  double lr = 0.1;           ///< the base learning rate (after LR_SCALING)
  double weight_decay = 1e-4;
  double momentum = 0.9;     ///< SGD only
  double beta1 = 0.9, beta2 = 0.999;
  double eps = 1e-8;
};

}  // namespace trainkit
