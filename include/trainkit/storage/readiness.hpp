#pragma once
/// What a parameter's post-accumulate-grad hook says (ReadyHook), and who listens: Readiness,
/// the overlap's count of complete buckets (TrainerOptions::overlap_reduction, stages 0-2), or
/// stage 3's unit gathers (unit_gathers.hpp), which move each gradient into its unit's buffer.
/// A mode installs the hooks when it is made (mode.hpp) with its listener; the listener gone
/// (the mode replaced, the storage destroyed), the hooks do nothing.
#include <trainkit/detail/inline.hpp>
#include <trainkit/detail/partition.hpp>
#include <trainkit/step/replicas.hpp>

#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/types.h>

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace trainkit::detail {

/// See the file comment.
class GradientListener {
 public:
  virtual ~GradientListener() = default;
  /// Placed parameter i's gradient is accumulated into `param`'s .grad (the autograd engine's
  /// thread).
  virtual void ready(size_t i, const torch::Tensor& param) = 0;
};

/// During an armed backward, which buckets of the partition are complete. Each parameter's
/// hook counts its gradient in the buckets it lies in. The buckets are launched in one order
/// fixed when the hooks are installed, the same on every rank: by when a backward is expected
/// to complete them, a backward producing the model's parameters' gradients in reverse order
/// (the bucket whose earliest parameter comes last in the model first). Each is launched as
/// soon as it and every bucket before it in that order are complete. The layout groups
/// parameters by weight decay and LR multiplier, so a bucket may hold parameters of every layer
/// (BERT's biases and norms, TRAIN.NO_DECAY): it comes last, and does not hold the others back.
/// What is left when the backward ends (parameters that got no gradient) is launched by
/// launch_rest(), in that order: every rank's launches are that one sequence.
class Readiness final : public GradientListener {
 public:
  /// `parameters`: each parameter's elements in the flat layout; `order`: each one's place
  /// among the model's parameters (its gradient is expected after those of later places).
  Readiness(const std::vector<Range>& parameters, const std::vector<std::int64_t>& order, std::vector<std::string> names,
            const Partition& partition);
  void arm(Reduction& reduction);
  void disarm() { reduction_ = nullptr; }
  /// Launches the buckets the armed backward did not complete, in the launch order.
  void launch_rest();
  /// Buckets launched in the armed backward.
  std::int64_t launched() const { return next_; }
  /// The order in which the buckets are launched.
  const std::vector<std::int64_t>& launch_order() const { return order_; }
  /// Buckets launched by the hooks while parameters' gradients were still to come in their
  /// backward (overlapping it), since the hooks were installed.
  std::int64_t overlapped() const { return overlapped_; }
  /// Over every bucket launched since the hooks were installed: the mean share of its
  /// backward's gradient elements still to come when it was launched (0 for those launched at
  /// the backward's end): how much of the backward a bucket's reduction could hide behind.
  double backward_left() const { return launches_ > 0 ? left_sum_ / static_cast<double>(launches_) : 0.0; }

  /// Parameter i's gradient is accumulated.
  void ready(size_t i);
  void ready(size_t i, const torch::Tensor&) override { ready(i); }

 private:
  std::vector<std::string> names_;
  std::vector<std::pair<std::int64_t, std::int64_t>> spans_;  // each parameter's first and last bucket
  std::vector<std::int64_t> initial_, waiting_;
  std::vector<std::int64_t> order_;  // the buckets in launch order
  std::vector<bool> fired_;
  std::int64_t next_ = 0, overlapped_ = 0;  // next_: the place in order_ of the next launch
  std::vector<std::int64_t> elements_;       // each parameter's elements
  std::int64_t total_elements_ = 0, pending_elements_ = 0;  // pending: still to come in this backward
  std::int64_t launches_ = 0;
  double left_sum_ = 0;  // backward_left()'s sum
  Reduction* reduction_ = nullptr;
};

/// The hook a parameter calls after its gradient is accumulated: tells its listener, if it is
/// still alive.
class ReadyHook final : public torch::autograd::PostAccumulateGradHook {
 public:
  ReadyHook(std::weak_ptr<GradientListener> listener, size_t index) : listener_(std::move(listener)), index_(index) {}
  void operator()(const torch::autograd::Variable& param) override {
    if (auto l = listener_.lock()) l->ready(index_, param);
  }

 private:
  std::weak_ptr<GradientListener> listener_;
  size_t index_;
};

}  // namespace trainkit::detail

#ifndef TRAINKIT_COMPILED_LIB
#include <trainkit/storage/readiness-inl.hpp>
#endif
