#pragma once
/// The definitions of trainkit/step/replicas.hpp (header-only: included by it; compiled mode:
/// by src/trainkit.cpp alone). See docs/design/compiled-mode.md.
#include <trainkit/step/replicas.hpp>

namespace trainkit {

TRAINKIT_INLINE GradientFactor Replicas::reduce_buckets(torch::Tensor& flat_grad, torch::Tensor local,
                                                        const detail::Partition& partition,
                                                        const WindowWeights& window, bool closes) {
  return start_reduction(flat_grad, std::move(local), partition, window, closes)->finish();
}

TRAINKIT_INLINE std::unique_ptr<Reduction> SingleProcess::start_reduction(torch::Tensor& flat_grad,
                                                                          torch::Tensor local,
                                                                          const detail::Partition& partition,
                                                                          const WindowWeights& window, bool) {
  struct Local final : Reduction {
    torch::Tensor flat, local;
    detail::Partition partition;
    double rescale;
    void launch(std::int64_t) override {}
    GradientFactor finish() override {
      if (local.defined())
        for (std::int64_t b = 0; b < partition.buckets(); ++b) {
          const auto s = partition.slice(b);
          local.narrow(0, partition.local(b), s.length).copy_(flat.narrow(0, s.begin, s.length));
        }
      return {rescale, {}};
    }
  };
  auto r = std::make_unique<Local>();
  r->flat = flat_grad, r->local = std::move(local), r->partition = partition, r->rescale = window.rescale;
  return r;
}

TRAINKIT_INLINE torch::Tensor SingleProcess::gather_to_main(const torch::Tensor& local,
                                                            const detail::Partition& partition) {
  auto out = torch::zeros({partition.total()}, local.options().device(torch::kCPU));
  for (std::int64_t b = 0; b < partition.buckets(); ++b) {
    const auto s = partition.slice(b);
    out.narrow(0, s.begin, s.length).copy_(local.narrow(0, partition.local(b), s.length));
  }
  return out;
}

}  // namespace trainkit
