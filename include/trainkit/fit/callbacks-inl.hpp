#pragma once
/// The definitions of trainkit/fit/callbacks.hpp (header-only: included by it; compiled mode:
/// by src/trainkit.cpp alone). See docs/design/compiled-mode.md.
#include <trainkit/fit/callbacks.hpp>

namespace trainkit {

TRAINKIT_INLINE EarlyStopping::EarlyStopping(std::string metric, std::int64_t patience, bool higher_is_better,
                                             double min_delta)
    : metric_(std::move(metric)), patience_(patience), higher_is_better_(higher_is_better), min_delta_(min_delta) {
  if (metric_.empty()) throw std::invalid_argument("EarlyStopping: the metric's name is empty");
  if (patience_ < 1) throw std::invalid_argument("EarlyStopping: patience must be >= 1, got " + std::to_string(patience_));
  if (!(min_delta_ >= 0) || !std::isfinite(min_delta_))
    throw std::invalid_argument("EarlyStopping: min_delta must be finite and >= 0");
}

TRAINKIT_INLINE void EarlyStopping::attach(Callbacks& callbacks) {
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

TRAINKIT_INLINE void EarlyStopping::observe(EpochEnd& end) {
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

}  // namespace trainkit
