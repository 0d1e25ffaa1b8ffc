#pragma once
/// What Trainer<P, A, C> (trainer.hpp) does with a window outside the step: the replicas attached,
/// an epoch's partial window (TrainerOptions::partial_window), a window or a micro-batch dropped
/// before the fit loop replays it after an out-of-memory error, and the memory plan's trial
/// backward. Included by trainer.hpp at its end.
#include <trainkit/trainer/trainer.hpp>

namespace trainkit {

template <class Precision, class Accumulation, class Clip>
void Trainer<Precision, Accumulation, Clip>::discard_micro_batch() {
  TORCH_CHECK(storage_.reduces_each_micro_batch(), "discard_micro_batch: the gradient is reduced once per window "
              "here (not Sharding::gradients with several ranks): discard the window (discard_window)");
  storage_.discard_micro_batch();
  accumulation_.load_state(started_.accumulation);
  window_loss_ = started_.window_loss;
}

template <class Precision, class Accumulation, class Clip>
void Trainer<Precision, Accumulation, Clip>::discard_window() {
  storage_.zero();
  accumulation_.discard();
}

template <class Precision, class Accumulation, class Clip>
std::optional<StepReport> Trainer<Precision, Accumulation, Clip>::flush() {
  if (accumulation_.position() == 0) return std::nullopt;
  switch (options_.partial_window()) {
    case PartialWindow::flush:
      return close_window();
    case PartialWindow::span:
      return std::nullopt;
    case PartialWindow::drop:
      storage_.zero();
      window_loss_ = torch::zeros({}, window_loss_.options());
      accumulation_.reset();
      terms_ = {};
      return std::nullopt;
  }
  return std::nullopt;
}

template <class Precision, class Accumulation, class Clip>
void Trainer<Precision, Accumulation, Clip>::set_replicas(std::shared_ptr<Replicas> replicas) {
  TORCH_CHECK(replicas != nullptr, "set_replicas: the replicas are null (use tk::SingleProcess)");
  TORCH_CHECK(accumulation_.position() == 0, "set_replicas: a window is open (",
              accumulation_.position(), " micro-batches); attach between windows");
  const bool was_sharded = storage_.sharded();
  if (options_.sharding() != Sharding::none && replicas->communicates() && windows_ > 0)
    throw std::logic_error("set_replicas: with sharding (TrainerOptions::sharding, TRAIN.ZERO_STAGE) the optimizer's "
                           "state is cut by rank: attach the replicas before the first optimizer step (" +
                           std::to_string(windows_) + " have run), then load() a checkpoint to continue");
  replicas_ = std::move(replicas);
  if (storage_.attach(*replicas_, *module_) || was_sharded)
    for (auto* state : rule_->flat_states()) state->resize(storage_.state_numel());
}

template <class Precision, class Accumulation, class Clip>
void Trainer<Precision, Accumulation, Clip>::trial_backward(const LossClosure& closure) {
  TORCH_CHECK(accumulation_.position() == 0, "trial_backward: a window is open (", accumulation_.position(),
              " micro-batches of ", accumulation_.window(), "); measure between windows");
  const auto window_loss = window_loss_;
  try {
    const torch::Tensor loss = forward(closure);
    const detail::BackwardDone done{/*closes=*/false, /*micro_batch_ends=*/true, window_weights()};
    backward(loss, 1.0, /*first_of_window=*/true, done);
    storage_.backward_done(done);
  } catch (...) {
    window_loss_ = window_loss;
    // (A reduction already sent cannot be dropped, and discard_window says so: the error
    // that stopped the trial is the one to report.)
    try {
      discard_window();
    } catch (const std::exception&) {
    }
    throw;
  }
  discard_window();
  window_loss_ = window_loss;
}

}  // namespace trainkit
