#pragma once
/// The definitions of trainkit/storage/readiness.hpp (header-only: included by it; compiled mode:
/// by src/trainkit.cpp alone). See docs/design/compiled-mode.md.
#include <trainkit/storage/readiness.hpp>

#include <algorithm>
#include <limits>
#include <stdexcept>

namespace trainkit::detail {

TRAINKIT_INLINE Readiness::Readiness(const std::vector<Range>& parameters, const std::vector<std::int64_t>& order,
                                     std::vector<std::string> names, const Partition& partition)
    : names_(std::move(names)), initial_(static_cast<size_t>(partition.buckets()), 0) {
  // Each bucket's expected completion: the earliest model place among its parameters (the
  // backward reaches it last). A bucket of padding alone is complete at once.
  std::vector<std::int64_t> completes(initial_.size(), std::numeric_limits<std::int64_t>::max());
  for (size_t i = 0; i < parameters.size(); ++i) {
    const auto& p = parameters[i];
    std::int64_t first = 0;
    while (first + 1 < partition.buckets() && partition.bucket(first + 1).begin <= p.begin) ++first;
    std::int64_t last = first;
    while (last + 1 < partition.buckets() && partition.bucket(last + 1).begin < p.end()) ++last;
    spans_.push_back({first, last});
    elements_.push_back(p.length);
    total_elements_ += p.length;
    for (auto b = first; b <= last; ++b) {
      ++initial_[static_cast<size_t>(b)];
      completes[static_cast<size_t>(b)] = std::min(completes[static_cast<size_t>(b)], order[i]);
    }
  }
  // Latest place first; among equals (a parameter over several buckets) the higher bucket first.
  for (std::int64_t b = partition.buckets() - 1; b >= 0; --b) order_.push_back(b);
  std::stable_sort(order_.begin(), order_.end(), [&](std::int64_t a, std::int64_t b) {
    return completes[static_cast<size_t>(a)] > completes[static_cast<size_t>(b)];
  });
}

TRAINKIT_INLINE void Readiness::arm(Reduction& reduction) {
  waiting_ = initial_;
  fired_.assign(spans_.size(), false);
  pending_elements_ = total_elements_;
  next_ = 0;
  reduction_ = &reduction;
}

TRAINKIT_INLINE void Readiness::launch_rest() {
  if (!reduction_) return;
  for (; next_ < static_cast<std::int64_t>(order_.size()); ++next_) {
    reduction_->launch(order_[static_cast<size_t>(next_)]);
    ++launches_;  // (the backward has ended: nothing left to hide behind)
  }
}

TRAINKIT_INLINE void Readiness::ready(size_t i) {
  if (!reduction_) return;
  const auto [first, last] = spans_[i];
  if (fired_[i]) {
    // A second accumulation in one backward: the reentrant backward of tk::recompute for a
    // parameter used inside and outside its region. Harmless until the bucket has left.
    bool sent = false;  // a bucket of it has left
    for (std::int64_t k = 0; k < next_ && !sent; ++k) sent = order_[static_cast<size_t>(k)] >= first && order_[static_cast<size_t>(k)] <= last;
    if (sent)
      throw std::runtime_error("trainkit: parameter '" + names_[i] + "' received a second gradient in one backward "
                               "after its bucket's reduction had started (a parameter used both inside and outside "
                               "tk::recompute?); set TrainerOptions::overlap_reduction(false) (TRAIN.OVERLAP_REDUCTION: false)");
    return;
  }
  fired_[i] = true;
  pending_elements_ -= elements_[i];
  for (auto b = first; b <= last; ++b) --waiting_[static_cast<size_t>(b)];
  while (next_ < static_cast<std::int64_t>(order_.size()) && waiting_[static_cast<size_t>(order_[static_cast<size_t>(next_)])] == 0) {
    reduction_->launch(order_[static_cast<size_t>(next_++)]);
    if (pending_elements_ > 0) ++overlapped_;  // (launched by the last gradient: nothing left to overlap)
    ++launches_;
    left_sum_ += total_elements_ > 0 ? static_cast<double>(pending_elements_) / static_cast<double>(total_elements_) : 0.0;
  }
}

}  // namespace trainkit::detail
