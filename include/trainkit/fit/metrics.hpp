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
#include <trainkit/detail/inline.hpp>
#include <trainkit/archive/checkpoint_io.hpp>

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
  void add(const std::string& name, const torch::Tensor& value, double weight = 1.0);
  void add(const std::string& name, double value, double weight = 1.0);
  /// Adds `sum` (a scalar tensor), a sum over `items` items: the running value is then
  /// sum(sums) / sum(items). A sum whose items are counted elsewhere takes items 0.
  void add_sum(const std::string& name, const torch::Tensor& sum, double items);
  /// Adds `items` items to `name`'s weight alone (the items of sums added with 0 before).
  void add_items(const std::string& name, double items);

  /// The names, in the order they were first added.
  const std::vector<std::string>& names() const { return order_; }
  bool empty() const { return order_.empty(); }

  /// Weighted sums and total weights, all read in one host copy.
  struct Totals {
    std::map<std::string, std::pair<double, double>> of;  // name -> (sum, weight)
    double mean(const std::string& name) const;
  };
  Totals totals() const;
  /// The running means (one sync).
  std::map<std::string, double> means() const;

  void reset();

  /// Metrics whose sums and weights are `totals` (host values): what a data-parallel checkpoint
  /// holds, the mean over the ranks of their running sums.
  static Metrics from_totals(const Totals& totals);

  /// State for checkpoints, under `prefix` (sums, weights, order).
  void save(torch::serialize::OutputArchive& archive, const std::string& prefix) const;
  void load(torch::serialize::InputArchive& archive, const std::string& prefix);

 private:
  struct Entry {
    torch::Tensor sum;  // float64 scalar on the device of the first value
    double weight = 0;
  };
  static void check_weight(const std::string& name, double weight);
  Entry& entry(const std::string& name, torch::Device device);

  std::map<std::string, Entry> entries_;
  std::vector<std::string> order_;
};

}  // namespace trainkit

#ifndef TRAINKIT_COMPILED_LIB
#include <trainkit/fit/metrics-inl.hpp>
#endif
