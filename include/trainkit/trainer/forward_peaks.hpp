#pragma once
/// How close the forward comes to its precision's range: the largest |output| of each module,
/// so that a user sees which layer approaches half's 65504 before it overflows. The forward
/// half of the overflow diagnosis (nonfinite_watch.hpp is the gradient's). Opt-in
/// (TRAIN.FORWARD_PEAKS, FitOptions::forward_peaks): the fit loop records the forward of each
/// log window's micro-batches and logs the peaks there.
///
///   tk::ForwardPeaks peaks(*model);
///   { auto recording = peaks.record(); loss = loss_of(model, batch); }  // this thread's ops
///   tk::ForwardPeakTable table = peaks.take();                          // one host read
///
/// How: LibTorch's C++ modules have no forward hooks, so the peaks come from ATen's operator
/// observer (at::RecordFunction, the profiler's): while a Recording lives, a thread-local
/// callback sees each operator the forward calls, with its inputs and outputs. Only the
/// outermost operators count (an operator another one calls, autocast's casts included, is
/// part of its caller's output), and outputs that are views of an input are skipped (their
/// values are the input's). Each counted output adds one reduction, max |x| in fp32 (fp64
/// outputs: in fp64) on its device (`linalg_vector_norm(x, inf)`), kept there until take()
/// reads them all at once.
///
/// Which module an operator's output belongs to: the module that owns a parameter among its
/// inputs (`linear(x, W, b)` is W's Linear's); an operator without parameter inputs belongs to
/// the parent of the last module whose parameters were used (after a block's query and key
/// projections, their product and its softmax are the attention block's; the activation
/// between two Linears is their parent's). Operators before any parameter is used belong to the
/// model itself, named "(model)".
///
/// Costs: none when not recording (no callback is registered). While recording, every
/// operator of the forward is boxed for the observer and each counted output adds the
/// reduction: RESULTS.md, "Step speed / Forward peaks", measures a recorded window against a
/// plain one.
#include <trainkit/detail/inline.hpp>

#include <torch/nn/module.h>
#include <torch/types.h>

#include <ATen/record_function.h>

#include <cstdint>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

namespace trainkit {

/// The forward's peaks since they were last taken, on the host.
struct ForwardPeakTable {
  /// What an output's values are compared with: the largest finite value of its dtype.
  enum Kind : int { half = 0, bfloat16 = 1, wider = 2 };
  static constexpr int kinds = 3;
  static double range(int kind);
  static const char* kind_name(int kind);

  /// The modules: "(model)" first, then every module that owns a parameter and every module
  /// above one, in the model's order.
  std::vector<std::string> modules;
  /// modules.size() x kinds: the largest |output| of that module in that kind of dtype; +inf
  /// where an output was not finite (NaN included); -1 where none was seen.
  std::vector<double> peaks;
  /// Module indices, in the order the forward first reached them (modules it did not reach: none).
  std::vector<std::int64_t> forward_order;
  /// The module of the forward's first output that was not finite (-1: none on this rank).
  std::int64_t origin = -1;
  /// Outputs this rank did not measure (the reduction failed: out of memory...), and why the
  /// first did not; text() says so. The forward itself goes on.
  std::int64_t missed = 0;
  std::string error;

  double peak(size_t module, int kind) const { return peaks.at(module * kinds + static_cast<size_t>(kind)); }
  bool any() const;

  struct Row {
    std::string module;
    double peak = 0;     ///< the largest |output| (+inf: not finite)
    int kind = wider;    ///< of the dtype nearest its range, relative to it
    double fraction = 0; ///< peak / range(kind)
  };
  /// The modules with an output, nearest their range first (not finite first; then by
  /// fraction; ties in the forward's order).
  std::vector<Row> rows() const;
  /// The module whose output was the forward's first not finite (where only other ranks' were:
  /// the first such module in this rank's order); empty when none. The forward passes a
  /// non-finite value on to every module after it: this is where it began.
  std::string first_nonfinite() const;
  /// "A 3.1e+04 (fp16, 47% of 65504); B ...": the `top` rows nearest their range, led by where
  /// the output first stopped being finite if it did.
  std::string text(size_t top = 3) const;
};

namespace detail {
struct ForwardPeaksState;
}

class ForwardPeaks {
 public:
  /// The modules and parameters of `model` (every parameter, trainable or frozen). The model's
  /// parameters must stay the same tensors (trainkit's storages keep them, moving their data).
  explicit ForwardPeaks(const torch::nn::Module& model);
  ~ForwardPeaks();
  ForwardPeaks(const ForwardPeaks&) = delete;
  ForwardPeaks& operator=(const ForwardPeaks&) = delete;

  /// RAII: while it lives, the operators this thread calls are recorded. An empty one (default)
  /// records nothing. One at a time per ForwardPeaks and per thread.
  class Recording {
   public:
    Recording() = default;
    Recording(Recording&& other) noexcept;
    Recording& operator=(Recording&& other) noexcept;
    ~Recording() { stop(); }
    Recording(const Recording&) = delete;
    Recording& operator=(const Recording&) = delete;

   private:
    friend class ForwardPeaks;
    explicit Recording(detail::ForwardPeaksState* state);
    void stop() noexcept;
    detail::ForwardPeaksState* state_ = nullptr;
    at::CallbackHandle handle_ = 0;
  };
  Recording record();

  /// Outputs counted since the last take() (host value).
  std::int64_t outputs_recorded() const;
  /// Where the records stand, to drop what follows (a forward that failed and runs again: the
  /// fit loop's replay after out-of-memory).
  struct Mark {
    std::size_t outputs = 0, reached = 0;
  };
  Mark mark() const;
  /// The records after `m` dropped (none when take() came between).
  void discard_since(const Mark& m);
  /// The peaks since the last take() (one host read per device the outputs were on), and a
  /// fresh start. An output whose reduction failed is counted in `missed`, not thrown: the
  /// forward went on, and ranks must all reach their log window's collective.
  ForwardPeakTable take();

 private:
  std::unique_ptr<detail::ForwardPeaksState> state_;
};

}  // namespace trainkit

#ifndef TRAINKIT_COMPILED_LIB
#include <trainkit/trainer/forward_peaks-inl.hpp>
#endif
