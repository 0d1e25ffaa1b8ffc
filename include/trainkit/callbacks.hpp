#pragma once
/// Callbacks for the fit loop that keep their own state in its checkpoints.
///
///   tk::EarlyStopping early("Acc", /*patience*/ 3);   // higher is better by default
///   tk::Callbacks callbacks;
///   early.attach(callbacks);                          // keep `early` alive while fit runs
///   tk::FitResult r = tk::fit(trainer, task, options, callbacks);
///   if (r.finished) ...                               // stopped early; a re-run trains no further
#include <trainkit/fit.hpp>

#include <cmath>
#include <cstdint>
#include <limits>
#include <stdexcept>
#include <string>
#include <utility>

namespace trainkit {

/// Ends training when the validation metric `metric` has not improved by more than `min_delta`
/// in `patience` validations in a row. The run is then finished (EpochEnd::request_finish): a
/// checkpoint is written, fit returns with FitResult::finished, and running the same command
/// again in that directory trains no further. The best value and the count of validations
/// without improvement are in every checkpoint (Callbacks::state), so a resumed run counts on
/// from where the stopped one was. Epochs without validation (VAL_FREQUENT) do not count.
class EarlyStopping {
 public:
  EarlyStopping(std::string metric, std::int64_t patience, bool higher_is_better = true, double min_delta = 0.0)
      : metric_(std::move(metric)), patience_(patience), higher_is_better_(higher_is_better), min_delta_(min_delta) {
    if (metric_.empty()) throw std::invalid_argument("EarlyStopping: the metric's name is empty");
    if (patience_ < 1) throw std::invalid_argument("EarlyStopping: patience must be >= 1, got " + std::to_string(patience_));
    if (!(min_delta_ >= 0) || !std::isfinite(min_delta_))
      throw std::invalid_argument("EarlyStopping: min_delta must be finite and >= 0");
  }

  /// Adds itself to `callbacks`: after the epoch_end callback already there, and its state.
  /// This object must outlive the fit() call.
  void attach(Callbacks& callbacks) {
    auto previous = std::move(callbacks.epoch_end);
    callbacks.epoch_end = [this, previous = std::move(previous)](EpochEnd& end) {
      if (previous) previous(end);
      observe(end);
    };
    callbacks.state.push_back({"early_stopping." + metric_,
                               [this](torch::serialize::OutputArchive& a) {
                                 a.write("best", c10::IValue(best_));
                                 a.write("bad", c10::IValue(bad_));
                               },
                               [this](torch::serialize::InputArchive& a) {
                                 c10::IValue best, bad;
                                 a.read("best", best);
                                 a.read("bad", bad);
                                 best_ = best.toDouble();
                                 bad_ = bad.toInt();
                               }});
  }

  /// The best value so far (NaN: none yet) and the validations since it.
  double best() const noexcept { return best_; }
  std::int64_t bad_validations() const noexcept { return bad_; }

  /// One epoch's end: counts, and asks to finish when patience runs out.
  void observe(EpochEnd& end) {
    if (end.validation.empty()) return;
    const auto it = end.validation.find(metric_);
    if (it == end.validation.end())
      throw std::runtime_error("EarlyStopping: the validation has no metric '" + metric_ + "'");
    const double v = it->second;
    const bool better = std::isfinite(v) && (std::isnan(best_) || (higher_is_better_ ? v > best_ + min_delta_ : v < best_ - min_delta_));
    if (better) {
      best_ = v;
      bad_ = 0;
      return;
    }
    if (++bad_ < patience_) return;
    end.request_finish = true;
    char text[160];
    std::snprintf(text, sizeof text, "early stopping: Val-%s has not improved on %.6g for %lld validations", metric_.c_str(),
                  best_, static_cast<long long>(bad_));
    end.finish_reason = text;
  }

 private:
  std::string metric_;
  std::int64_t patience_;
  bool higher_is_better_;
  double min_delta_;
  double best_ = std::numeric_limits<double>::quiet_NaN();
  std::int64_t bad_ = 0;
};

}  // namespace trainkit
