#pragma once
/// The definitions of trainkit/trainer/trainer_core.hpp (header-only: included by it; compiled
/// mode: by src/trainkit.cpp alone). See docs/design/compiled-mode.md.
#include <trainkit/trainer/trainer_core.hpp>

#include <unordered_set>

namespace trainkit::detail {

TRAINKIT_INLINE torch::Tensor host_counters(std::int64_t windows, std::int64_t position) {
  return torch::tensor({static_cast<double>(windows), static_cast<double>(position)}, torch::kDouble);
}

TRAINKIT_INLINE TrainerCore::TrainerCore(TrainerOptions options, std::shared_ptr<torch::nn::Module> module)
    : options_(std::move(options)), module_(std::move(module)), device_(first_device(*module_)) {}

TRAINKIT_INLINE torch::Device TrainerCore::first_device(torch::nn::Module& module) {
  for (const auto& p : module.parameters(true))
    if (p.requires_grad()) return p.device();
  throw std::invalid_argument("Trainer: the model has no trainable parameters (none has requires_grad=true)");
}

TRAINKIT_INLINE void TrainerCore::start(std::unique_ptr<UpdateRule> rule, bool half_autocast) {
  rule_ = std::move(rule);
  // float16 on a CPU: LibTorch's CPU kernels for it are slow (few CPUs compute in fp16), and
  // autocast adds a cast per op (docs/guide/memory.md's table has this project's figures).
  // Said once per process.
  static std::once_flag said;
  if (half_autocast && device_.is_cpu())
    std::call_once(said, [&] {
      std::cerr << "trainkit: warning: " << type_name() << " on the CPU: the forward autocasts to float16, whose "
                << "CPU kernels are slow (several times FP32's time per step); FP16 and its loss scaling are for "
                << "GPUs. On a CPU train in FP32, or BF16 where the CPU has bfloat16 instructions (AVX512-BF16, "
                << "AMX) and the model's matrices are large (docs/guide/memory.md, \"Which precision\")" << std::endl;
    });
  if (options_.sharding() != Sharding::none && !rule_->fused())
    throw std::invalid_argument("trainkit::TrainerOptions: sharding (TRAIN.ZERO_STAGE) needs trainkit's fused "
                                "optimizers (tk::SGD, tk::Adam, tk::AdamW): a torch::optim::Optimizer keeps the "
                                "state of every parameter itself");
  const auto long_opts = torch::dtype(torch::kLong).device(device_);
  applied_ = torch::zeros({1}, long_opts);
  skipped_ = torch::zeros({1}, long_opts);
  window_loss_ = torch::zeros({}, torch::dtype(torch::kFloat).device(device_));
  set_schedule(std::make_shared<ConstantSchedule>());
}

TRAINKIT_INLINE int TrainerCore::sharding_stage() const {
  return replicas_->communicates() ? static_cast<int>(options_.sharding()) : 0;
}

TRAINKIT_INLINE HeldBytes TrainerCore::predicted_held() const {
  return predict_held(model_size(), storage_shape(), sharding_stage(), replicas_->world_size());
}

TRAINKIT_INLINE std::int64_t TrainerCore::distinct_bytes(std::vector<torch::Tensor> tensors) const {
  for (const auto& p : module_->parameters()) tensors.insert(tensors.end(), {p, p.grad()});
  for (const auto* state : static_cast<const UpdateRule&>(*rule_).flat_states())
    if (state->allocated()) tensors.push_back(state->flat());
  std::unordered_set<const c10::StorageImpl*> seen;
  std::int64_t bytes = 0;
  for (const auto& t : tensors)
    if (t.defined() && seen.insert(t.storage().unsafeGetStorageImpl()).second)
      bytes += static_cast<std::int64_t>(t.storage().nbytes());
  return bytes;
}

TRAINKIT_INLINE StorageShape TrainerCore::shape_of(bool master_weights, bool autocast_copies) const {
  StorageShape shape;
  shape.master_weights = master_weights;
  shape.autocast_copies = autocast_copies;
  const UpdateRule& rule = *rule_;
  shape.optimizer_values = rule.state_is_flat() ? static_cast<std::int64_t>(rule.flat_states().size()) : -1;
  shape.accumulates = window_length() != 1;
  shape.unit_prefetch = options_.unit_prefetch();
  shape.reshard_after_forward = options_.reshard_after_forward();
  shape.overlap_reduction = options_.overlap_reduction();
  return shape;
}

TRAINKIT_INLINE void TrainerCore::set_schedule(std::shared_ptr<Schedule> schedule) {
  TORCH_CHECK(schedule != nullptr, "set_schedule: the schedule is null");
  schedule_ = std::move(schedule);
  schedule_changed();
}

TRAINKIT_INLINE bool TrainerCore::on_epoch_end(std::int64_t epoch, double metric) {
  const bool changed = schedule_->on_epoch_end(epoch, metric);
  if (changed) schedule_changed();
  return changed;
}

TRAINKIT_INLINE void TrainerCore::write_meta(torch::serialize::OutputArchive& archive) const {
  write_value(archive, "meta.trainer", type_name());
  write_value(archive, "meta.version", std::string(TRAINKIT_VERSION_STRING));
  write_value(archive, "meta.optimizer", rule_->name());
  write_value(archive, "meta.config", options_.config_json());
}

TRAINKIT_INLINE void TrainerCore::write_buffers(torch::serialize::OutputArchive& archive) const {
  torch::NoGradGuard no_grad;
  for (const auto& b : module_->named_buffers(true)) write_tensor(archive, "model.buffer." + b.key(), b.value());
}

TRAINKIT_INLINE void TrainerCore::write_counters(torch::serialize::OutputArchive& archive) const {
  write_tensor(archive, "counters.applied", applied_);
  write_tensor(archive, "counters.skipped", skipped_);
  write_value(archive, "counters.windows", windows_);
}

TRAINKIT_INLINE void TrainerCore::write_schedule_and_generators(torch::serialize::OutputArchive& archive) const {
  write_value(archive, "schedule.state", schedule_->state());
  save_rng_states(archive, device_);
}

TRAINKIT_INLINE void TrainerCore::read_buffers(torch::serialize::InputArchive& archive) {
  torch::NoGradGuard no_grad;
  for (const auto& b : module_->named_buffers(true)) read_into(archive, "model.buffer." + b.key(), b.value());
}

TRAINKIT_INLINE void TrainerCore::read_counters(torch::serialize::InputArchive& archive) {
  read_into(archive, "counters.applied", applied_);
  read_into(archive, "counters.skipped", skipped_);
  windows_ = read_value(archive, "counters.windows").toInt();
}

TRAINKIT_INLINE void TrainerCore::read_window_loss(torch::serialize::InputArchive& archive) {
  // A new tensor (the last report may hold the old one), of the record's shape: one value, or
  // one per loss term.
  window_loss_ = read_tensor(archive, "window.loss").to(device_, torch::kFloat, /*non_blocking=*/false, /*copy=*/true);
}

TRAINKIT_INLINE void TrainerCore::write_terms(torch::serialize::OutputArchive& archive) const {
  write_tensor(archive, "window.term_items", torch::tensor(terms_.items, torch::kLong));
  write_tensor(archive, "window.term_weights", terms_.weights);
  write_value(archive, "window.term_micro_batches", terms_.micro_batches);
}

TRAINKIT_INLINE void TrainerCore::read_terms(torch::serialize::InputArchive& archive) {
  // The weights as the window began them (its counts over the ranks that ran it); the items
  // are the main rank's, which only this rank's reported loss reads.
  torch::Tensor saved;
  if (!try_read_tensor(archive, "window.term_items", saved)) return;
  const auto items = saved.to(torch::kLong).contiguous();
  terms_.items.assign(items.data_ptr<std::int64_t>(), items.data_ptr<std::int64_t>() + items.numel());
  terms_.weights = read_tensor(archive, "window.term_weights").to(device_, torch::kFloat);
  terms_.micro_batches = read_value(archive, "window.term_micro_batches").toInt();
  if (terms_.items.empty() || terms_.weights.numel() != items.numel() || window_loss_.numel() != items.numel())
    throw std::runtime_error("the open window's loss-term records do not agree (" + std::to_string(items.numel()) +
                             " counts, " + std::to_string(terms_.weights.numel()) + " weights, a window loss of " +
                             std::to_string(window_loss_.numel()) + " values)");
  std::vector<double> local;
  for (const auto n : terms_.items) local.push_back(1.0 / static_cast<double>(std::max<std::int64_t>(n, 1)));
  terms_.local_weights = device_values(local, torch::kFloat, device_);
}

TRAINKIT_INLINE void TrainerCore::count_terms(const std::vector<std::int64_t>& items) {
  TORCH_CHECK(!items.empty(), "begin_window: no loss terms (give each term's item count in the window)");
  std::vector<double> counts, local;
  for (size_t t = 0; t < items.size(); ++t) {
    TORCH_CHECK(items[t] >= 0, "begin_window: term ", t, " has ", items[t], " items; counts must be >= 0");
    counts.push_back(static_cast<double>(items[t]));
    local.push_back(1.0 / static_cast<double>(std::max<std::int64_t>(items[t], 1)));
  }
  // Every rank's counts, summed on the device (float64: exact to 2^53 items). A term with no
  // item on any rank has only zero sums: any finite weight leaves it out. A window with no item
  // of any term on any rank gets NaN weights: its gradient is non-finite and the step skipped, as
  // the single count's divisor of 0 skips it (on the device: no host read of the totals).
  auto total = device_values(counts, torch::kDouble, device_);
  replicas_->sum_counts(total);
  const auto none = total.sum().eq(0.0);
  terms_.weights = at::where(none, std::numeric_limits<double>::quiet_NaN(), total.clamp_min(1.0).reciprocal())
                       .to(torch::kFloat);
  terms_.local_weights = device_values(local, torch::kFloat, device_);
  terms_.items = items;
}

TRAINKIT_INLINE torch::Tensor device_values(const std::vector<double>& values, at::ScalarType dtype, torch::Device device) {
  // From pinned memory without waiting on a GPU: a copy from pageable memory would wait for
  // the device (a host sync per window).
  const auto host = torch::tensor(values, torch::kDouble).to(dtype);
  return device.is_cuda() ? host.pin_memory().to(device, /*non_blocking=*/true) : host.to(device);
}

TRAINKIT_INLINE void TrainerCore::read_schedule_and_generators(torch::serialize::InputArchive& archive) {
  schedule_->load_state(read_value(archive, "schedule.state").toStringRef());
  schedule_changed();
  load_rng_states(archive, device_);
}

TRAINKIT_INLINE void TrainerCore::check_checkpoint(torch::serialize::InputArchive& archive,
                                                   const std::string& source) const {
  const auto what = [&](const std::string& s) { return "checkpoint '" + source + "': " + s; };
  c10::IValue type;
  if (!archive.try_read("meta.trainer", type))
    throw std::runtime_error(what("not a trainkit checkpoint (no meta.trainer record)"));
  if (type.toStringRef() != type_name())
    throw std::runtime_error(what("written by " + type.toStringRef() + ", this trainer is " + type_name() +
                                  "; resume with the same configuration"));
  c10::IValue optimizer;
  if (archive.try_read("meta.optimizer", optimizer) && optimizer.toStringRef() != rule_->name())
    throw std::runtime_error(what("written with the optimizer " + optimizer.toStringRef() + ", this trainer's is " +
                                  rule_->name() + "; resume with the checkpoint's optimizer (TRAIN.OPTIMIZER), or "
                                  "start a new run (tk::load_weights takes its weights alone)"));
  // Every parameter and buffer of the model is in the archive with its shape.
  auto check = [&](const std::string& prefix, const std::string& key, const torch::Tensor& target) {
    const auto saved = tensor_shape(archive, prefix + key);
    if (!saved)
      throw std::runtime_error(what("has no " + prefix.substr(6, prefix.size() - 7) + " '" + key +
                                    "' that the model has"));
    if (c10::IntArrayRef(*saved) != target.sizes())
      throw std::runtime_error(what("'" + key + "' has shape " + shape_string(*saved) + ", the model's is " +
                                    shape_string(target.sizes())));
  };
  for (const auto& p : module_->named_parameters(true)) check("model.param.", p.key(), p.value());
  for (const auto& b : module_->named_buffers(true)) check("model.buffer.", b.key(), b.value());
}

TRAINKIT_INLINE void TrainerCore::refuse_optimizer_state(torch::serialize::InputArchive& archive,
                                                         const std::string& prefix, const std::exception& e) const {
  c10::IValue written;
  const std::string by = archive.try_read("meta.optimizer", written) ? written.toStringRef()
                                                                     : std::string("an unknown optimizer");
  throw std::runtime_error(prefix + "its optimizer state was written by " + by + ", this trainer's optimizer is " +
                           rule_->name() + ", whose state it does not hold (" + first_line_of(e) +
                           "); resume with the checkpoint's optimizer (TRAIN.OPTIMIZER), or start a new run");
}

TRAINKIT_INLINE void TrainerCore::optimizer_phase_out_of_memory(const std::exception& e) const {
  throw std::runtime_error("out of memory in the optimizer phase of optimizer step " + std::to_string(windows_ + 1) +
                           " (after the window's forward and backward passes); the step may be half applied, "
                           "so training stops here: resume from the last checkpoint with a smaller micro-batch "
                           "or TRAIN.MEMORY_BUDGET. " + first_line_of(e));
}

TRAINKIT_INLINE void TrainerCore::check_loss(const torch::Tensor& loss) const {
  TORCH_CHECK(loss.defined(), "micro_step: the closure returned an undefined tensor");
  if (terms_.active() && (loss.dim() > 1 || loss.numel() != static_cast<std::int64_t>(terms_.items.size())))
    throw std::invalid_argument(
        "micro_step: the window's loss is " + std::to_string(terms_.items.size()) + " terms (begin_window), so the "
        "closure must return their sums, one value per term (torch::stack({...})); got a tensor of shape " +
        shape_string(loss.sizes()));
  if (!terms_.active() && loss.numel() != 1)
    throw std::invalid_argument(
        "micro_step: the closure must return a scalar loss (one element), got a tensor of "
        "shape " + shape_string(loss.sizes()) + "; reduce it with .mean() or .sum(), or give a loss of several "
        "terms their counts with begin_window");
  if (!loss.requires_grad())
    throw std::invalid_argument(
        "micro_step: the loss does not require grad (it was computed under NoGradGuard, from "
        "detached tensors, or from parameters with requires_grad=false)");
}

TRAINKIT_INLINE const torch::Tensor& TrainerCore::constant(double value) {
  if (!constant_.defined() || constant_value_ != value) {
    constant_ = torch::full({}, value, torch::dtype(torch::kFloat).device(device_));
    constant_value_ = value;
  }
  return constant_;
}

TRAINKIT_INLINE void TrainerCore::build_lr_table(std::int64_t size) {
  std::vector<double> values(static_cast<size_t>(size));
  const double base = rule_->base_lr();
  for (std::int64_t i = 0; i < size; ++i) values[i] = base * schedule_->factor(i);
  // CPU kernels read a double LR; CUDA's fused kernels read fp32. Converted on the host and
  // copied from pinned memory without waiting: a rebuild (every doubling of the step count,
  // or a schedule change) costs no host sync.
  const auto dtype = device_.is_cpu() ? torch::kDouble : torch::kFloat;
  const auto host = torch::tensor(values, torch::kDouble).to(dtype);
  lr_table_ = device_.is_cuda() ? host.pin_memory().to(device_, /*non_blocking=*/true) : host.to(device_);
}

}  // namespace trainkit::detail
