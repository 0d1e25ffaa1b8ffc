#pragma once
/// The optimizer a configuration asks for, as values (no LibTorch).
#include <string>

namespace trainkit {

/// VL-BERT's settings (AdamW: betas (0.9, 0.999), eps 1e-6, decay on every parameter; Adam:
/// torch.optim.Adam's defaults; SGD: dampening 0). tk::with_optimizer (registry.hpp) makes the
/// optimizer they describe.
struct OptimizerSettings {
  std::string name = "SGD";  ///< "SGD", "Adam" or "AdamW"
  double lr = 0.1;           ///< the base learning rate (after LR_SCALING)
  double weight_decay = 1e-4;
  double momentum = 0.9;     ///< SGD only
  double beta1 = 0.9, beta2 = 0.999;
  double eps = 1e-8;
};

}  // namespace trainkit
