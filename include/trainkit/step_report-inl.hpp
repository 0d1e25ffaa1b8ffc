#pragma once
/// The definitions of trainkit/step_report.hpp (header-only: included by it; compiled mode:
/// by src/trainkit.cpp alone). See docs/design/compiled-mode.md.
#include <trainkit/step_report.hpp>

namespace trainkit {

TRAINKIT_INLINE double StepReport::value(Field f) const {
  TORCH_CHECK(values_ != nullptr, "StepReport: this report is empty (no window closed)");
  if (!values_->host) {
    std::vector<torch::Tensor> parts;
    for (const auto& t : values_->device) parts.push_back(t.reshape({1}).to(torch::kDouble));
    const auto host = torch::cat(parts).cpu();  // the one copy (a sync on a GPU)
    const double* read = host.data_ptr<double>();
    std::array<double, kFields> v{};
    std::copy(read, read + kFields, v.begin());
    values_->host = v;
  }
  return (*values_->host)[f];
}

}  // namespace trainkit
