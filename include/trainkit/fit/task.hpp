#pragma once
/// The application's side of training: what a micro-batch is, how its loss is computed, and
/// (optionally) how it is counted, split and validated. tk::fit (fit.hpp) trains on a Task;
/// tk::evaluate (evaluate.hpp) validates one.
#include <trainkit/fit/metrics.hpp>

#include <torch/types.h>

#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <vector>

namespace trainkit {

/// The application's task. Data are addressed by (epoch, index): the batch for a position must
/// be a pure function of the seed, the epoch and the index (shuffle with a generator seeded from
/// them), so that the data sampler's state is just (epoch, index) and resuming is exact.
template <class Batch>
struct Task {
  /// Micro-batches in `epoch` (on this rank).
  std::function<std::int64_t(std::int64_t epoch)> batches_per_epoch;
  /// Micro-batch `index` of `epoch`. With FitOptions::workers > 0 it runs on worker threads,
  /// several at once, ahead of the step: it must be thread-safe and use its own generator.
  std::function<Batch(std::int64_t epoch, std::int64_t index)> batch;
  /// Forward: the loss as a scalar tensor. May record more scalars, averaged over the epoch by
  /// the loop: metrics.add("MLM-Acc", accuracy, count). Runs inside the precision region.
  std::function<torch::Tensor(const Batch&, Metrics& metrics)> loss;
  /// Optional: the micro-batch's item count (samples, tokens): the window's gradient and the
  /// logged means are then weighted by items (Trainer::micro_step with items). With terms it
  /// sizes pieces and counts samples only.
  std::function<std::int64_t(const Batch&)> items;
  /// Optional: a loss of several terms, each a mean over its own items (masked language
  /// modelling over labelled tokens, region classification over labelled regions). `terms`
  /// names them (logged as Train-<name>, each the exact mean over its items; "Loss" is their
  /// sum); loss() then returns each term's *sum* over its items in the batch, one value per
  /// term (torch::stack({mlm_sum, mvrc_sum})), and term_items gives each term's item count
  /// in a batch, on the host. The loop counts a window's items before it runs it (it makes the
  /// window's micro-batches first and holds them), sums them over the ranks, and weights
  /// each term by 1 / its count (Trainer::begin_window): the gradient is that of one
  /// micro-batch holding the whole global batch, however the batch is split. (Sum in fp32: a
  /// half-precision sum over many items overflows where their mean would not; under autocast
  /// cross_entropy and its sums already run in fp32.)
  std::vector<std::string> terms;
  std::function<std::vector<std::int64_t>(const Batch&)> term_items;
  /// Optional (needs items): `parts` pieces of a micro-batch, together holding its items, each
  /// a Batch that loss() takes; loss() must be the mean over a batch's items (or, with terms,
  /// the sums), so that the items-weighted mean of the pieces' losses is the batch's. With it,
  /// the loop runs micro-batches that do not fit in memory as pieces (FitOptions::memory_budget,
  /// piece_items) and replays a window after an out-of-memory error (fit.hpp, "Memory"). At
  /// ZeRO stage 3 a rank with fewer pieces than another runs stand-ins (a piece again, its loss
  /// weighted 0), which it takes from this micro-batch cut into the other rank's number of
  /// parts: `parts` may then exceed the batch's items (return fewer pieces, or empty ones).
  std::function<std::vector<Batch>(const Batch&, std::int64_t parts)> split;
  /// Optional: validation after an epoch; the metrics are logged as Val-<name>. tk::fit runs it
  /// with the model in eval mode and under NoGradGuard (the model's mode restored after).
  std::function<std::map<std::string, double>(std::int64_t epoch)> validate;
  /// Optional: the validation metric that ranks checkpoints (the best is kept) and drives the
  /// plateau schedule.
  std::string best_metric;
  bool higher_is_better = true;
};

}  // namespace trainkit
