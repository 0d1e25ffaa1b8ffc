#pragma once
/// Callbacks for the fit loop that keep their own state in its checkpoints.
///
///   tk::EarlyStopping early("Acc", /*patience*/ 3);   // higher is better by default
///   tk::Callbacks callbacks;
///   early.attach(callbacks);                          // keep `early` alive while fit runs
///   tk::FitResult r = tk::fit(trainer, task, options, callbacks);
///   if (r.finished) ...                               // stopped early; a re-run trains no further
#include <trainkit/detail/inline.hpp>
#include <trainkit/fit/fit_events.hpp>

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
  EarlyStopping(std::string metric, std::int64_t patience, bool higher_is_better = true, double min_delta = 0.0);

  /// Adds itself to `callbacks`: after the epoch_end callback already there, and its state.
  /// This object must outlive the fit() call.
  void attach(Callbacks& callbacks);

  /// The best value so far (NaN: none yet) and the validations since it.
  double best() const noexcept { return best_; }
  std::int64_t bad_validations() const noexcept { return bad_; }

  /// One epoch's end: counts, and asks to finish when patience runs out.
  void observe(EpochEnd& end);

 private:
  std::string metric_;
  std::int64_t patience_;
  bool higher_is_better_;
  double min_delta_;
  double best_ = std::numeric_limits<double>::quiet_NaN();
  std::int64_t bad_ = 0;
};

}  // namespace trainkit

#ifndef TRAINKIT_COMPILED_LIB
#include <trainkit/fit/callbacks-inl.hpp>
#endif
