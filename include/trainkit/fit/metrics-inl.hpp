#pragma once
/// The definitions of trainkit/fit/metrics.hpp (header-only: included by it; compiled mode:
/// by src/trainkit.cpp alone). See docs/design/compiled-mode.md.
#include <trainkit/fit/metrics.hpp>

namespace trainkit {

TRAINKIT_INLINE void Metrics::add(const std::string& name, const torch::Tensor& value, double weight) {
  TORCH_CHECK(value.numel() == 1, "Metrics::add(\"", name, "\"): expected a scalar, got shape ",
              value.sizes());
  check_weight(name, weight);
  Entry& e = entry(name, value.device());
  if (e.sum.device() != value.device()) e.sum = e.sum.to(value.device());  // once, after a load (CPU)
  e.sum = e.sum + value.detach().reshape({}).to(e.sum.device(), torch::kDouble) * weight;
  e.weight += weight;
}

TRAINKIT_INLINE void Metrics::add_sum(const std::string& name, const torch::Tensor& sum, double items) {
  TORCH_CHECK(sum.numel() == 1, "Metrics::add_sum(\"", name, "\"): expected a scalar, got shape ", sum.sizes());
  check_weight(name, items);
  Entry& e = entry(name, sum.device());
  if (e.sum.device() != sum.device()) e.sum = e.sum.to(sum.device());
  e.sum = e.sum + sum.detach().reshape({}).to(e.sum.device(), torch::kDouble);
  e.weight += items;
}

TRAINKIT_INLINE void Metrics::add_items(const std::string& name, double items) {
  check_weight(name, items);
  entry(name, torch::kCPU).weight += items;  // (a new entry's sum moves to the first sum's device)
}

TRAINKIT_INLINE void Metrics::add(const std::string& name, double value, double weight) {
  check_weight(name, weight);
  Entry& e = entry(name, torch::kCPU);
  e.sum = e.sum + value * weight;
  e.weight += weight;
}

TRAINKIT_INLINE double Metrics::Totals::mean(const std::string& name) const {
  const auto it = of.find(name);
  return it == of.end() || it->second.second == 0 ? 0.0 : it->second.first / it->second.second;
}

TRAINKIT_INLINE Metrics::Totals Metrics::totals() const {
  Totals t;
  if (order_.empty()) return t;
  // The sums are gathered on their device and copied once (a copy per device where the
  // metrics live on several: a CPU one after a load, say), not one copy per metric.
  std::map<std::string, std::vector<size_t>> by_device;  // device -> indices into order_
  std::map<std::string, std::vector<torch::Tensor>> sums;
  for (size_t i = 0; i < order_.size(); ++i) {
    const torch::Tensor& sum = entries_.at(order_[i]).sum;
    const std::string device = sum.device().str();
    by_device[device].push_back(i);
    sums[device].push_back(sum.reshape({1}));
  }
  for (auto& [device, indices] : by_device) {
    const torch::Tensor host = torch::cat(sums.at(device)).cpu();
    const double* v = host.data_ptr<double>();
    for (size_t j = 0; j < indices.size(); ++j)
      t.of[order_[indices[j]]] = {v[j], entries_.at(order_[indices[j]]).weight};
  }
  return t;
}

TRAINKIT_INLINE std::map<std::string, double> Metrics::means() const {
  std::map<std::string, double> m;
  const Totals t = totals();
  for (const auto& name : order_) m[name] = t.mean(name);
  return m;
}

TRAINKIT_INLINE void Metrics::reset() {
  entries_.clear();
  order_.clear();
}

TRAINKIT_INLINE Metrics Metrics::from_totals(const Totals& totals) {
  Metrics m;
  for (const auto& [name, sw] : totals.of) {
    m.order_.push_back(name);
    m.entries_[name] = Entry{torch::full({}, sw.first, torch::kDouble), sw.second};
  }
  return m;
}

TRAINKIT_INLINE void Metrics::save(torch::serialize::OutputArchive& archive, const std::string& prefix) const {
  detail::write_value(archive, prefix + ".count", static_cast<std::int64_t>(order_.size()));
  for (size_t i = 0; i < order_.size(); ++i) {
    const auto& e = entries_.at(order_[i]);
    const std::string key = prefix + "." + std::to_string(i);
    detail::write_value(archive, key + ".name", order_[i]);
    detail::write_tensor(archive, key + ".sum", e.sum);
    detail::write_value(archive, key + ".weight", e.weight);
  }
}

TRAINKIT_INLINE void Metrics::load(torch::serialize::InputArchive& archive, const std::string& prefix) {
  Metrics loaded;
  const auto count = detail::read_value(archive, prefix + ".count").toInt();
  for (std::int64_t i = 0; i < count; ++i) {
    const std::string key = prefix + "." + std::to_string(i);
    const std::string name = detail::read_value(archive, key + ".name").toStringRef();
    const torch::Tensor sum = detail::read_tensor(archive, key + ".sum");
    const double weight = detail::read_value(archive, key + ".weight").toDouble();
    loaded.order_.push_back(name);
    loaded.entries_[name] = Entry{sum.clone(), weight};
  }
  *this = std::move(loaded);
}

TRAINKIT_INLINE void Metrics::check_weight(const std::string& name, double weight) {
  if (!(weight >= 0))
    throw std::invalid_argument("Metrics::add(\"" + name + "\"): the weight must be >= 0, got " +
                                std::to_string(weight));
}

TRAINKIT_INLINE Metrics::Entry& Metrics::entry(const std::string& name, torch::Device device) {
  auto it = entries_.find(name);
  if (it != entries_.end()) return it->second;
  order_.push_back(name);
  return entries_[name] = Entry{torch::zeros({}, torch::dtype(torch::kDouble).device(device)), 0.0};
}

}  // namespace trainkit
