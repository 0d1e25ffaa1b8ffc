#pragma once
/// The records of Trainer<P, A, C> (trainer.hpp): every part's, in one order, written by save()
/// and snapshot(), read back by load() (with its checks and the ranks' agreement) and restore().
/// Included by trainer.hpp at its end.
#include <trainkit/trainer/trainer.hpp>

namespace trainkit {

template <class Precision, class Accumulation, class Clip>
void Trainer<Precision, Accumulation, Clip>::load(torch::serialize::InputArchive& archive, const std::string& source) {
  storage_.check_loadable(source);  // (stage 3: refused while every unit is held gathered)
  check_checkpoint(archive, source);
  std::exception_ptr failure;
  bool damaged = false;
  try {
    read_state(archive, "checkpoint '" + source + "': ", /*snapshot=*/false);
  } catch (const detail::DamagedArchive&) {
    failure = std::current_exception();
    damaged = true;
  } catch (...) {
    failure = std::current_exception();
  }
  // Data parallel: a rank that could not read its part (a damaged piece of a set, which that
  // rank alone reads) fails every rank's load alike, before the collective below; damage as
  // damage, so that every rank can go back to an older checkpoint together.
  const auto failed = replicas_->count_failures({damaged, failure && !damaged});
  // Every rank throws the same kind: damage (which a resume may skip for an older checkpoint)
  // only when damage was every failure.
  const auto ranks = [](std::int64_t n) { return std::to_string(n) + " rank(s)"; };
  if (failed[1] > 0) {
    if (failure && !damaged) std::rethrow_exception(failure);
    throw std::runtime_error("checkpoint '" + source + "': " + ranks(failed[1]) + " could not load their part of it" +
                             (damaged ? " (and this rank found its part damaged)" : "") +
                             " (each says why); nothing was loaded");
  }
  if (failure) std::rethrow_exception(failure);
  if (failed[0] > 0) throw detail::DamagedArchive(source, ranks(failed[0]) + " found their part of it damaged (each names the file)");
  storage_.after_load();  // (stage 3: the root unit from the slices every rank read)
  // Every rank loads the whole state it holds; check that they loaded the same.
  replicas_->check_same_state({storage_.replicated_state(), applied_, skipped_, precision_.scale(),
                               detail::host_counters(windows_, accumulation_.position())},
                              "checkpoint '" + source + "': the ranks loaded different training states");
}

template <class Precision, class Accumulation, class Clip>
void Trainer<Precision, Accumulation, Clip>::restore(torch::serialize::InputArchive& snapshot) {
  read_state(snapshot, "restoring the state before a failed load: ", /*snapshot=*/true);
}

template <class Precision, class Accumulation, class Clip>
void Trainer<Precision, Accumulation, Clip>::write_state(torch::serialize::OutputArchive& archive, bool snapshot) const {
  write_meta(archive);
  {
    torch::NoGradGuard no_grad;
    if (snapshot) storage_.snapshot(archive, *module_, *rule_);
    else storage_.save(archive, *module_, *rule_);
  }
  write_buffers(archive);
  rule_->save(archive);
  precision_.save(archive);
  write_counters(archive);
  accumulation_.save(archive);
  // A checkpoint inside a window (span) keeps the partial gradient; at a boundary it is 0.
  if (accumulation_.position() > 0) {
    storage_.save_window(archive, snapshot);
    detail::write_tensor(archive, "window.loss", window_loss_);
    if (terms_.active()) write_terms(archive);
  }
  write_schedule_and_generators(archive);
}

template <class Precision, class Accumulation, class Clip>
void Trainer<Precision, Accumulation, Clip>::read_state(torch::serialize::InputArchive& archive, const std::string& prefix,
                                                      bool snapshot) {
  read_buffers(archive);
  try {
    if (snapshot) storage_.restore(archive, *module_, *rule_);
    else storage_.load(archive, *module_, *rule_);
    rule_->load(archive);
  } catch (const detail::DamagedArchive&) {
    throw;  // (damage, not another optimizer's state)
  } catch (const std::exception& e) {
    refuse_optimizer_state(archive, prefix, e);
  }
  precision_.load(archive);
  read_counters(archive);
  accumulation_.load(archive);
  terms_ = {};
  if (accumulation_.position() > 0) {
    storage_.load_window(archive, snapshot);
    read_window_loss(archive);
    read_terms(archive);  // (when the window's loss was terms)
  } else {
    storage_.zero();
  }
  read_schedule_and_generators(archive);
}

}  // namespace trainkit
