#pragma once
/// The definitions of trainkit/parallel/data_parallel.hpp (header-only: included by it; compiled mode
/// with TRAINKIT_COMPILED_PARALLEL: by src/trainkit.cpp alone). See docs/design/compiled-mode.md.
#include <trainkit/parallel/data_parallel.hpp>

namespace trainkit {

TRAINKIT_PARALLEL_INLINE DataParallel::DataParallel(ProcessGroup group, std::int64_t bucket_bytes)
    : group_(std::move(group)), bucket_bytes_(bucket_bytes) {
  if (bucket_bytes_ < 1)
    throw std::invalid_argument("trainkit::DataParallel: bucket_bytes must be >= 1, got " +
                                std::to_string(bucket_bytes_));
}

TRAINKIT_PARALLEL_INLINE DataParallel& DataParallel::shard_at_world_size_one(bool on) {
  shard_alone_ = on;
  return *this;
}

TRAINKIT_PARALLEL_INLINE std::int64_t DataParallel::buckets(std::int64_t numel, std::int64_t element_size) const {
  const std::int64_t per = std::max<std::int64_t>(1, bucket_bytes_ / element_size);
  return numel == 0 ? 0 : (numel + per - 1) / per;
}

TRAINKIT_PARALLEL_INLINE void DataParallel::attach(torch::nn::Module& model, const torch::Tensor& flat_params,
                                          const torch::Tensor& rewritten) {
  check_device(flat_params, "the parameters");
  torch::NoGradGuard no_grad;
  group_.broadcast(flat_params, "broadcast of the parameters from rank 0 at start");
  // Everything else the model holds (frozen parameters, buffers, and any parameter that is
  // not a view of the flat storage or of what the caller rewrites from it), one broadcast
  // per dtype.
  std::map<c10::ScalarType, std::vector<torch::Tensor>> rest;
  for (const auto& p : model.parameters(true))
    if (!p.is_alias_of(flat_params) && !(rewritten.defined() && p.is_alias_of(rewritten)))
      rest[p.scalar_type()].push_back(p);
  for (const auto& b : model.buffers(true))
    if (b.defined()) rest[b.scalar_type()].push_back(b);
  for (auto& [dtype, tensors] : rest) {
    std::vector<torch::Tensor> flat;
    for (const auto& t : tensors) {
      check_device(t, "a parameter or buffer");
      flat.push_back(t.reshape({-1}));
    }
    auto packed = torch::cat(flat);
    group_.broadcast(packed, "broadcast of the model's " + std::string(c10::toString(dtype)) +
                                 " parameters and buffers from rank 0 at start");
    std::int64_t offset = 0;
    for (auto& t : tensors) {
      t.copy_(packed.narrow(0, offset, t.numel()).view(t.sizes()));
      offset += t.numel();
    }
  }
}

TRAINKIT_PARALLEL_INLINE std::unique_ptr<Reduction> DataParallel::start_reduction(torch::Tensor& flat_grad, torch::Tensor local,
                                                                         const detail::Partition& partition,
                                                                         const WindowWeights& window, bool closes) {
  if (local.defined()) check_partition(partition, flat_grad);
  GradientBuckets buckets;
  buckets.input = [flat = flat_grad, partition](std::int64_t b) {
    const auto bucket = partition.bucket(b);
    return flat.narrow(0, bucket.begin, std::min(bucket.length, flat.numel() - bucket.begin));
  };
  return std::make_unique<BucketReduction>(*this, std::move(buckets), flat_grad.element_size(), std::move(local),
                                           partition, window, closes);
}

TRAINKIT_PARALLEL_INLINE std::unique_ptr<Reduction> DataParallel::start_unit_reduction(GradientBuckets buckets,
                                                                              torch::Tensor local,
                                                                              const detail::Partition& partition,
                                                                              const WindowWeights& window,
                                                                              bool closes) {
  if (partition.world_size() != world_size() || partition.rank() != rank() ||
      local.numel() != partition.local_total())
    throw std::logic_error("trainkit::DataParallel: a unit reduction for rank " + std::to_string(partition.rank()) +
                           " of " + std::to_string(partition.world_size()) + " into " + std::to_string(local.numel()) +
                           " local elements, for rank " + std::to_string(rank()) + " of " + std::to_string(world_size()));
  auto reduction = std::make_unique<BucketReduction>(*this, std::move(buckets), /*element_size=*/4, std::move(local),
                                                     partition, window, closes);
  reduction->limit_in_flight(2);  // (each in flight holds a unit's gradient: a flush launches them all at once)
  return reduction;
}

TRAINKIT_PARALLEL_INLINE torch::Tensor DataParallel::global_norm(const torch::Tensor& local) {
  // The slices' squared norms summed: the norm of norms, as the chunked master-weights phase
  // takes it (within rounding of the whole gradient's norm; non-finite on every rank when
  // any slice is).
  auto squares = at::linalg_vector_norm(local, 2).square().reshape({1});
  group_.all_reduce(squares, "all-reduce of the gradient's squared norm (optimizer phase " + std::to_string(windows_) + ")");
  return squares.sqrt().reshape({});
}

TRAINKIT_PARALLEL_INLINE void DataParallel::sum(torch::Tensor& values) {
  group_.all_reduce(values, "all-reduce of the fp32-kept parameters (optimizer phase " + std::to_string(windows_) + ")");
}

TRAINKIT_PARALLEL_INLINE void DataParallel::all_gather(torch::Tensor& flat, const detail::Partition& partition) {
  check_partition(partition, flat);
  // NCCL gathers in place: a rank's slice is its part of the output bucket (slice(b) starts
  // at rank x length / world), which ncclAllGather takes as its input without a copy. Other
  // backends may not alias input and output: the slice is sent from a copy. Gloo's
  // all-gather also receives into a copy of the bucket: at most two buckets in flight there.
  const std::string backend = group_.backend()->getBackendName();
  const bool in_place = backend == "nccl";
  const size_t in_flight = backend == "gloo" ? 2 : static_cast<size_t>(-1);
  const auto count = partition.buckets();
  std::vector<torch::Tensor> sent(static_cast<size_t>(count));
  std::vector<c10::intrusive_ptr<c10d::Work>> works(static_cast<size_t>(count));
  const std::string step = " (optimizer phase " + std::to_string(windows_) + " of this process)";
  const auto wait = [&](std::int64_t b) {
    group_.wait(works[static_cast<size_t>(b)], "all-gather of parameter bucket " + std::to_string(b + 1) + "/" +
                                                   std::to_string(count) + step);
    sent[static_cast<size_t>(b)] = torch::Tensor();
  };
  for (std::int64_t b = 0; b < count; ++b) {
    if (static_cast<size_t>(b) >= in_flight) wait(b - static_cast<std::int64_t>(in_flight));
    const auto bucket = partition.bucket(b), slice = partition.slice(b);
    try {
      const auto mine = flat.narrow(0, slice.begin, slice.length);
      sent[static_cast<size_t>(b)] = in_place ? mine : mine.clone();
      auto out = flat.narrow(0, bucket.begin, bucket.length);
      works[static_cast<size_t>(b)] = group_.backend()->_allgather_base(out, sent[static_cast<size_t>(b)]);
    } catch (const std::exception& e) {
      group_.fail("starting the all-gather of the updated parameters" + step, detail::message_of(e));
    }
  }
  for (auto b = std::max<std::int64_t>(0, count - static_cast<std::int64_t>(std::min<size_t>(in_flight, count))); b < count; ++b)
    wait(b);
}

TRAINKIT_PARALLEL_INLINE void DataParallel::gather_bucket(const torch::Tensor& mine, const torch::Tensor& bucket,
                                                 const std::string& what) {
  start_gather_bucket(mine, bucket, what)();
}

TRAINKIT_PARALLEL_INLINE std::function<void()> DataParallel::start_gather_bucket(const torch::Tensor& mine, const torch::Tensor& bucket, const std::string& what) {
  if (bucket.numel() != mine.numel() * world_size())
    throw std::logic_error("trainkit::DataParallel: " + what + ": a bucket of " + std::to_string(bucket.numel()) +
                           " elements from slices of " + std::to_string(mine.numel()) + " over " +
                           std::to_string(world_size()) + " ranks");
  at::Tensor in = mine, out = bucket;  // (a slice of the local buffer, never aliasing the bucket)
  c10::intrusive_ptr<c10d::Work> work;
  try {
    work = group_.backend()->_allgather_base(out, in);
  } catch (const std::exception& e) {
    group_.fail("starting the " + what, detail::message_of(e));
  }
  return [this, work, what] { group_.wait(work, what); };
}

TRAINKIT_PARALLEL_INLINE torch::Tensor DataParallel::gather_to_main(const torch::Tensor& local,
                                                           const detail::Partition& partition) {
  const bool main = is_main();
  torch::Tensor out = main ? torch::zeros({partition.total()}, local.options().device(torch::kCPU)) : torch::Tensor();
  // One bucket at a time: the main rank holds one bucket on the device, not the state.
  for (std::int64_t b = 0; b < partition.buckets(); ++b) {
    const auto bucket = partition.bucket(b);
    const auto n = bucket.length / world_size();
    std::vector<at::Tensor> inputs{local.narrow(0, partition.local(b), n)};
    std::vector<std::vector<at::Tensor>> outputs;
    torch::Tensor received;
    if (main) {
      received = torch::empty({bucket.length}, local.options());
      outputs.emplace_back();
      for (int r = 0; r < world_size(); ++r) outputs.back().push_back(received.narrow(0, r * n, n));
    }
    c10d::GatherOptions o;
    o.rootRank = 0;
    const std::string what = "gathering checkpoint bucket " + std::to_string(b + 1) + "/" +
                             std::to_string(partition.buckets()) + " on rank 0";
    c10::intrusive_ptr<c10d::Work> work;
    try {
      work = group_.backend()->gather(outputs, inputs, o);
    } catch (const std::exception& e) {
      group_.fail(what, detail::message_of(e));
    }
    group_.wait(work, what);
    if (main) out.narrow(0, bucket.begin, bucket.length).copy_(received);
  }
  return out;
}

TRAINKIT_PARALLEL_INLINE void DataParallel::check_same_state(const std::vector<torch::Tensor>& state, const std::string& what) {
  std::vector<torch::Tensor> parts;
  // In float64, a chunk at a time: the transient is at most 16 Mi doubles (128 MiB), not 8
  // (and 8 more for the absolute values) bytes per element of the whole state.
  constexpr std::int64_t chunk = std::int64_t{1} << 24;
  for (const auto& t : state) {
    const auto flat = t.detach().reshape({-1});
    torch::Tensor sum = torch::zeros({}, flat.options().dtype(torch::kDouble)), abs_sum = sum.clone();
    for (std::int64_t at = 0; at < flat.numel(); at += chunk) {
      const auto d = flat.narrow(0, at, std::min(chunk, flat.numel() - at)).to(torch::kDouble, false, /*copy=*/true);
      sum.add_(d.sum());
      abs_sum.add_(d.abs_().sum());
    }
    // On the group's device before the cat: the state mixes device tensors (parameters,
    // counters) with host ones (the window position).
    parts.push_back(sum.reshape({1}).to(group_.device()));
    parts.push_back(abs_sum.reshape({1}).to(group_.device()));
  }
  const auto f = torch::cat(parts);
  auto both = torch::cat({f, -f});
  group_.all_reduce(both, "comparing the loaded state across ranks", c10d::ReduceOp::MAX);
  both = both.cpu();
  const auto k = f.numel();
  for (std::int64_t i = 0; i < k; ++i) {
    const double hi = both[i].item<double>(), lo = -both[k + i].item<double>();
    if (hi != lo) {
      std::ostringstream msg;
      msg << what << ": state item " << i / 2 << " differs between the " << world_size()
          << " ranks (this rank: " << f[i].item<double>() << ", min " << lo << ", max " << hi
          << "); every rank must load the same checkpoint file";
      throw DistributedError(msg.str());
    }
  }
}

TRAINKIT_PARALLEL_INLINE void DataParallel::all_reduce(std::vector<double>& values, Reduce op) {
  // (In a stage-3 evaluation by unit, the ranks still forwarding are joined first: a task's
  // sum of its metrics after its forwards meets the same sum on every rank.)
  join_all();
  group_.all_reduce(values, op, "combining " + std::to_string(values.size()) + " values over the ranks");
}

TRAINKIT_PARALLEL_INLINE void DataParallel::sum_counts(torch::Tensor& counts) {
  check_device(counts, "the loss terms' item counts");
  group_.all_reduce(counts, "all-reduce of the window's item count per loss term (optimizer phase " +
                                std::to_string(windows_ + 1) + " of this process)");
}

TRAINKIT_PARALLEL_INLINE DataParallel::BucketReduction::BucketReduction(DataParallel& owner, GradientBuckets buckets,
                                                               std::int64_t element_size, torch::Tensor local,
                                                               detail::Partition partition,
                                                               const WindowWeights& window, bool closes)
    : owner_(owner), buckets_(std::move(buckets)), local_(std::move(local)), partition_(std::move(partition)), launched_(static_cast<size_t>(partition_.buckets()), false) {
  if (closes) ++owner_.windows_;
  // Gloo's reduce-scatter is an all-reduce of a copy of its input: a bucket in flight holds
  // one more bucket of memory, so at most two are in flight there (NCCL's is in place).
  if (local_.defined() && owner_.group_.backend()->getBackendName() == "gloo") max_in_flight_ = 2;
  step_ = " (optimizer phase " + std::to_string(owner_.windows_ + (closes ? 0 : 1)) + " of this process)";
  const auto& group = owner_.group_;
  const auto scalar = torch::dtype(torch::kFloat).device(group.device());
  // A half gradient (master weights, TrainerOptions::reduce_precision) is summed as the
  // mean, each rank's part weighted first: a sum of W loss-scaled fp16 gradients, or one
  // weighted by its item count, would overflow where the mean does not. With item counts
  // the weight is items / (the ranks' total), so the total is all-reduced first (a device
  // scalar: the gradient's collectives wait for it on the device, not the host).
  // Loss terms (Trainer::begin_window): each rank's gradient is its share of the window's
  // mean over every rank already; the sum over the ranks is that mean.
  if (window.normalized) {
    TORCH_CHECK(window.items < 0 && window.rescale == 1.0,
                "trainkit::DataParallel: a window of loss terms has neither item count nor rescale");
    factor_ = {1.0, {}};
    return;
  }
  if (element_size < 4) {
    TORCH_CHECK(closes, "trainkit::DataParallel: a half gradient is reduced once per window");
    if (window.items >= 0) {
      auto total = torch::full({1}, static_cast<float>(window.items), scalar);
      group.all_reduce(total, "all-reduce of the window's item count" + step_);
      weight_ = (window.rescale * static_cast<double>(window.items)) / total;  // total 0: non-finite, skipped
    } else {
      weight_ = torch::full({1}, 1.0 / owner_.world_size(), scalar);
    }
    factor_ = {window.items >= 0 ? 1.0 : window.rescale, {}};
    return;
  }
  // With item counts the ranks' windows hold different numbers of items: send each rank's
  // sum over its items, and divide by the total over all ranks (exact global mean). The total
  // stays on the device (the trainer folds it into the optimizer's divisor): no host sync.
  // NCCL multiplies each rank's part by its weight inside the reduction (PREMUL_SUM); other
  // backends take one pass over each bucket first.
  if (window.items >= 0) {
    const double weight = window.rescale * static_cast<double>(window.items);
    if (group.backend()->getBackendName() == "nccl") op_ = c10d::makeNCCLPreMulSum(weight);
    else premultiplier_ = weight;
    if (closes) items_ = torch::full({1}, static_cast<float>(window.items), scalar);
  }
  // Item counts are exact in float up to 2^24 per window.
  factor_ = items_.defined() ? GradientFactor{1.0, items_.reshape({})}
                             : GradientFactor{window.rescale / static_cast<double>(owner_.world_size()), {}};
}

TRAINKIT_PARALLEL_INLINE DataParallel::BucketReduction::~BucketReduction() {
  // Never left with collectives in flight (an exception between launch and finish).
  for (auto& work : works_)
    if (work) try { work->wait(); } catch (...) {}
}

TRAINKIT_PARALLEL_INLINE void DataParallel::BucketReduction::launch(std::int64_t b) {
  if (launched_[static_cast<size_t>(b)]) return;
  launched_[static_cast<size_t>(b)] = true;
  // The collectives already complete are taken first (no wait): a stage-3 unit's gradient
  // is released as soon as its reduce-scatter is done, not when the window's last is.
  while (waited_ < works_.size() && works_[waited_] && works_[waited_]->isCompleted()) wait_next();
  while (works_.size() - waited_ >= max_in_flight_) wait_next();
  const auto bucket = partition_.bucket(b);
  auto in = buckets_.input(b);
  if (weight_.defined()) in.mul_(weight_);  // (in fp32, rounded once to the half dtype)
  else if (premultiplier_ != 1.0) in.mul_(premultiplier_);
  const std::string what = std::string(local_.defined() ? "reduce-scatter" : "all-reduce") + " of gradient bucket " +
                           std::to_string(b + 1) + "/" + std::to_string(partition_.buckets()) + step_;
  try {
    if (local_.defined()) {
      auto out = local_.narrow(0, partition_.local(b), bucket.length / owner_.world_size());
      c10d::ReduceScatterOptions o;
      o.reduceOp = op_;
      works_.push_back(owner_.group_.backend()->_reduce_scatter_base(out, in, o));
    } else {
      works_.push_back(owner_.group_.start_all_reduce(in, op_));
    }
  } catch (const std::exception& e) {
    owner_.group_.fail("starting the " + what, detail::message_of(e));
  }
  names_.push_back(what);
  bucket_of_.push_back(b);
}

TRAINKIT_PARALLEL_INLINE GradientFactor DataParallel::BucketReduction::finish() {
  for (std::int64_t b = partition_.buckets() - 1; b >= 0; --b) launch(b);
  if (items_.defined()) {
    works_.push_back(owner_.group_.start_all_reduce(items_));
    names_.push_back("all-reduce of the window's item count" + step_);
    bucket_of_.push_back(-1);
  }
  while (waited_ < works_.size()) wait_next();
  return factor_;
}

TRAINKIT_PARALLEL_INLINE void DataParallel::BucketReduction::wait_next() {
  auto work = std::move(works_[waited_]);
  owner_.group_.wait(work, names_[waited_]);
  if (buckets_.done && bucket_of_[waited_] >= 0) buckets_.done(bucket_of_[waited_]);
  ++waited_;
}

TRAINKIT_PARALLEL_INLINE void DataParallel::check_partition(const detail::Partition& partition,
                                                   const torch::Tensor& flat) const {
  if (partition.world_size() != world_size() || partition.rank() != rank() || flat.numel() != partition.total())
    throw std::logic_error("trainkit::DataParallel: a partition of rank " + std::to_string(partition.rank()) + " of " +
                           std::to_string(partition.world_size()) + " over " + std::to_string(partition.total()) +
                           " elements, for rank " + std::to_string(rank()) + " of " + std::to_string(world_size()) +
                           " and a buffer of " + std::to_string(flat.numel()));
}

TRAINKIT_PARALLEL_INLINE void DataParallel::check_device(const torch::Tensor& t, const std::string& what) const {
  if (t.device() != group_.device())
    throw std::invalid_argument("trainkit::DataParallel: " + what + " are on " + t.device().str() +
                                ", the process group communicates on " + group_.device().str() +
                                "; create the group for the model's device");
}

}  // namespace trainkit
