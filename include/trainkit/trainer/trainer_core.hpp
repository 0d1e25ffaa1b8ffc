#pragma once
/// What every Trainer<P, A, C> shares and no policy changes (TrainerCore): the options, the
/// model and its device, the update rule, the LR schedule and its device table, the replicas, the
/// counters, the window's loss and its loss terms; the checkpoint records of those, the checks of
/// a checkpoint before a load, the loss check. Not a template: in the compiled mode
/// (TRAINKIT_COMPILED_LIB) its definitions (trainer_core-inl.hpp) are compiled once.
/// trainer.hpp's Trainer<P, A, C> adds the policies, the storage and the step.
#include <trainkit/detail/inline.hpp>
#include <trainkit/step/accumulation.hpp>
#include <trainkit/trainer/any_trainer.hpp>
#include <trainkit/step/clip.hpp>
#include <trainkit/archive/checkpoint_io.hpp>
#include <trainkit/detail/module_of.hpp>
#include <trainkit/detail/out_of_memory.hpp>
#include <trainkit/detail/rng_state.hpp>
#include <trainkit/storage/master_storage.hpp>
#include <trainkit/step/optim.hpp>
#include <trainkit/step/options.hpp>
#include <trainkit/step/precision.hpp>
#include <trainkit/step/replicas.hpp>
#include <trainkit/step/schedule.hpp>
#include <trainkit/step/step_report.hpp>
#include <trainkit/storage/storage.hpp>
#include <trainkit/trainer/trainer_key.hpp>
#include <trainkit/version.hpp>

#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>
#include <torch/serialize/archive.h>
#include <torch/types.h>

#include <algorithm>
#include <cstdint>
#include <iostream>
#include <limits>
#include <memory>
#include <mutex>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace trainkit {

namespace detail {

/// The host counters a data-parallel load compares across ranks: windows run, window position.
torch::Tensor host_counters(std::int64_t windows, std::int64_t position);

/// Host values as a 1-D tensor of `dtype` on `device`, with no host sync on a GPU.
torch::Tensor device_values(const std::vector<double>& values, at::ScalarType dtype, torch::Device device);

/// What every Trainer<P, A, C> shares and no policy changes: the options, the model and its
/// device, the update rule, the LR schedule and its device table, the replicas, the counters and
/// the window's loss; the checkpoint records of those, the checks of a checkpoint before a load,
/// the loss check. Not a template: in the compiled mode (TRAINKIT_COMPILED_LIB) its definitions
/// (trainer_core-inl.hpp) are compiled once. Trainer<P, A, C> adds the policies, the storage and the
/// step.
class TrainerCore : public AnyTrainer {
 public:
  TRAINKIT_INLINE void set_schedule(std::shared_ptr<Schedule> schedule) override;
  void schedule_changed() override { build_lr_table(std::max<std::int64_t>(1024, 2 * (windows_ + 1))); }
  const Schedule& schedule() const override { return *schedule_; }
  /// After an epoch's validation (the fit loop): hands `metric` to the schedule (plateau) and
  /// rebuilds the LR table when the schedule changed. Returns whether it changed.
  TRAINKIT_INLINE bool on_epoch_end(std::int64_t epoch, double metric) override;

  /// rank(), world_size(), is_main() for the loop; all_reduce() for its metrics.
  Replicas& replicas() override { return *replicas_; }
  const Replicas& replicas() const override { return *replicas_; }

  /// Optimizer phases run (applied + skipped); host value, no sync.
  std::int64_t windows() const override { return windows_; }
  /// Applied optimizer steps (device scalar; `.item()` syncs).
  const torch::Tensor& applied_steps() const override { return applied_; }
  const torch::Tensor& skipped_steps() const override { return skipped_; }
  UpdateRule& update_rule() { return *rule_; }
  bool allocate_optimizer_state() override {
    for (auto* state : rule_->flat_states()) state->allocate();
    return rule_->state_is_flat();
  }
  const TrainerOptions& options() const override { return options_; }
  torch::nn::Module& model() override { return *module_; }
  torch::Device device() const override { return device_; }
  double base_lr() const override { return rule_->base_lr(); }
  TRAINKIT_INLINE HeldBytes predicted_held() const override;
  /// The ZeRO stage the update runs at: the option's, or 0 where the replicas do not
  /// communicate (one process).
  TRAINKIT_INLINE int sharding_stage() const override;

 protected:
  TrainerCore(TrainerOptions options, std::shared_ptr<torch::nn::Module> module);
  /// The end of Trainer's construction, once the storage exists: the update rule, the counters
  /// and the constant schedule. `half_autocast`: the forward autocasts to float16, which a CPU
  /// runs slowly; said once per process.
  void start(std::unique_ptr<UpdateRule> rule, bool half_autocast = false);

  // Checkpoint records of the shared state (Trainer::write_state and read_state put the
  // policies' and the storage's between them).
  void write_meta(torch::serialize::OutputArchive& archive) const;
  void write_buffers(torch::serialize::OutputArchive& archive) const;
  void write_counters(torch::serialize::OutputArchive& archive) const;
  void write_schedule_and_generators(torch::serialize::OutputArchive& archive) const;
  void read_buffers(torch::serialize::InputArchive& archive);
  void read_counters(torch::serialize::InputArchive& archive);
  void read_window_loss(torch::serialize::InputArchive& archive);
  void read_schedule_and_generators(torch::serialize::InputArchive& archive);
  /// Before load() changes anything: the checkpoint's trainer type and optimizer are this
  /// trainer's, and every parameter and buffer of the model is in it with its shape. Throws
  /// naming `source` and the first mismatch.
  void check_checkpoint(torch::serialize::InputArchive& archive, const std::string& source) const;
  /// held_bytes(): the bytes of the distinct storages among `tensors` (the storage's buffers),
  /// the model's parameters and gradients and the rule's flat state.
  TRAINKIT_INLINE std::int64_t distinct_bytes(std::vector<torch::Tensor> tensors) const;
  /// storage_shape(): the rule's fp32 values per parameter (none counted for a torch::optim
  /// optimizer's own state) and the window's length.
  TRAINKIT_INLINE StorageShape shape_of(bool master_weights, bool autocast_copies) const;
  /// The error of an optimizer state the rule cannot read (`prefix` names the archive).
  [[noreturn]] void refuse_optimizer_state(torch::serialize::InputArchive& archive, const std::string& prefix,
                                           const std::exception& e) const;
  /// The error of memory that ran out in the optimizer phase (it cannot be replayed).
  [[noreturn]] void optimizer_phase_out_of_memory(const std::exception& e) const;

  /// The loss a closure returned: defined, requiring grad, one element (or, in a window of
  /// loss terms, one per term).
  void check_loss(const torch::Tensor& loss) const;
  /// begin_window's work that no policy changes: the terms' counts summed over the ranks and
  /// turned into their weights (terms_).
  void count_terms(const std::vector<std::int64_t>& items);
  /// The records of an open window of loss terms (a checkpoint inside a window), and back
  /// (read_terms leaves terms_ empty where the archive has none: a window of one loss value).
  void write_terms(torch::serialize::OutputArchive& archive) const;
  void read_terms(torch::serialize::InputArchive& archive);
  /// The phase's divisor without loss scaling, a device scalar remade only when its value
  /// changes (1 in every full window; item-weighted or partial windows vary).
  const torch::Tensor& constant(double value);
  void ensure_lr_table() {
    if (windows_ + 1 >= lr_table_.size(0)) build_lr_table(2 * (windows_ + 1));
  }
  /// The schedule evaluated on the host for every applied-step position up to `size`, moved to
  /// the device once; the step indexes it with the device-resident applied count.
  void build_lr_table(std::int64_t size);

  TrainerOptions options_;
  std::shared_ptr<torch::nn::Module> module_;
  torch::Device device_;
  std::unique_ptr<UpdateRule> rule_;
  std::shared_ptr<Schedule> schedule_;
  std::shared_ptr<Replicas> replicas_ = std::make_shared<SingleProcess>();
  std::vector<torch::Tensor> lrs_;
  torch::Tensor lr_table_;
  torch::Tensor applied_, skipped_, window_loss_;
  torch::Tensor constant_;  // constant()
  double constant_value_ = 0.0;
  std::int64_t windows_ = 0;
  /// The open window's loss terms (begin_window); none (items empty) when its loss is one value.
  /// In such a window window_loss_ holds the terms' sums so far, one per term.
  struct Terms {
    std::vector<std::int64_t> items;  // this rank's items of each term in the window
    torch::Tensor weights;            // 1 / (each term's items over every rank), fp32, on the device
    torch::Tensor local_weights;      // 1 / (this rank's items of each term): the report's loss
    std::int64_t micro_batches = 0;   // the micro-batches counted: the window may not run more
    bool active() const { return !items.empty(); }
  } terms_;

 private:
  static torch::Device first_device(torch::nn::Module& module);
};

}  // namespace detail

}  // namespace trainkit

#ifndef TRAINKIT_COMPILED_LIB
#include <trainkit/trainer/trainer_core-inl.hpp>
#endif
