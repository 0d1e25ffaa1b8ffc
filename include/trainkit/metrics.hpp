#pragma once
/// Running, weighted means of named scalars (losses, accuracies) over an epoch.
///
///   metrics.add("MLM-Acc", correct.sum() / count, count);   // a device scalar: no host sync
///   metrics.means();                                          // {"MLM-Acc": ...}: one sync
///
/// Each value is a mean over `weight` items (or 1 for one micro-batch); the running value is
/// sum(value_i * weight_i) / sum(weight_i), the mean over all items seen, never an average of
/// averages. Sums are kept in float64 on the value's device, weights on the host, so add()
/// costs one small kernel and no sync; values are read only when asked for. add() makes a new
/// sum rather than adding in place, so a copy of a Metrics is a snapshot that later adds do not
/// change (the fit loop rolls the window's metrics back that way when it replays a window).
#include <trainkit/detail/checkpoint_io.hpp>

#include <torch/serialize/archive.h>
#include <torch/types.h>

#include <cstdint>
#include <map>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace trainkit {

class Metrics {
 public:
  /// Adds `value` (a scalar tensor on any device, or a number), the mean over `weight` items.
  void add(const std::string& name, const torch::Tensor& value, double weight = 1.0) {
    TORCH_CHECK(value.numel() == 1, "Metrics::add(\"", name, "\"): expected a scalar, got shape ",
                value.sizes());
    check_weight(name, weight);
    Entry& e = entry(name, value.device());
    if (e.sum.device() != value.device()) e.sum = e.sum.to(value.device());  // once, after a load (CPU)
    e.sum = e.sum + value.detach().reshape({}).to(e.sum.device(), torch::kDouble) * weight;
    e.weight += weight;
  }
  void add(const std::string& name, double value, double weight = 1.0) {
    check_weight(name, weight);
    Entry& e = entry(name, torch::kCPU);
    e.sum = e.sum + value * weight;
    e.weight += weight;
  }

  /// The names, in the order they were first added.
  const std::vector<std::string>& names() const { return order_; }
  bool empty() const { return order_.empty(); }

  /// Weighted sums and total weights, all read in one host copy.
  struct Totals {
    std::map<std::string, std::pair<double, double>> of;  // name -> (sum, weight)
    double mean(const std::string& name) const {
      const auto it = of.find(name);
      return it == of.end() || it->second.second == 0 ? 0.0 : it->second.first / it->second.second;
    }
  };
  Totals totals() const {
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
  /// The running means (one sync).
  std::map<std::string, double> means() const {
    std::map<std::string, double> m;
    const Totals t = totals();
    for (const auto& name : order_) m[name] = t.mean(name);
    return m;
  }

  void reset() {
    entries_.clear();
    order_.clear();
  }

  /// Metrics whose sums and weights are `totals` (host values): what a data-parallel checkpoint
  /// holds, the mean over the ranks of their running sums.
  static Metrics from_totals(const Totals& totals) {
    Metrics m;
    for (const auto& [name, sw] : totals.of) {
      m.order_.push_back(name);
      m.entries_[name] = Entry{torch::full({}, sw.first, torch::kDouble), sw.second};
    }
    return m;
  }

  /// State for checkpoints, under `prefix` (sums, weights, order).
  void save(torch::serialize::OutputArchive& archive, const std::string& prefix) const {
    detail::write_value(archive, prefix + ".count", static_cast<std::int64_t>(order_.size()));
    for (size_t i = 0; i < order_.size(); ++i) {
      const auto& e = entries_.at(order_[i]);
      const std::string key = prefix + "." + std::to_string(i);
      detail::write_value(archive, key + ".name", order_[i]);
      detail::write_tensor(archive, key + ".sum", e.sum);
      detail::write_value(archive, key + ".weight", e.weight);
    }
  }
  void load(torch::serialize::InputArchive& archive, const std::string& prefix) {
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

 private:
  struct Entry {
    torch::Tensor sum;  // float64 scalar on the device of the first value
    double weight = 0;
  };
  static void check_weight(const std::string& name, double weight) {
    if (!(weight >= 0))
      throw std::invalid_argument("Metrics::add(\"" + name + "\"): the weight must be >= 0, got " +
                                  std::to_string(weight));
  }
  Entry& entry(const std::string& name, torch::Device device) {
    auto it = entries_.find(name);
    if (it != entries_.end()) return it->second;
    order_.push_back(name);
    return entries_[name] = Entry{torch::zeros({}, torch::dtype(torch::kDouble).device(device)), 0.0};
  }

  std::map<std::string, Entry> entries_;
  std::vector<std::string> order_;
};

}  // namespace trainkit
