#pragma once
/// The definitions of trainkit/storage/storage.hpp (header-only: included by it; compiled mode:
/// by src/trainkit.cpp alone). See docs/design/compiled-mode.md.
#include <trainkit/storage/storage.hpp>

#include <algorithm>
#include <unordered_set>

namespace trainkit {
namespace detail {

TRAINKIT_INLINE Readiness::Readiness(const std::vector<Range>& parameters, const std::vector<std::int64_t>& order,
                                     std::vector<std::string> names, const Partition& partition)
    : names_(std::move(names)), initial_(static_cast<size_t>(partition.buckets()), 0) {
  // Each bucket's expected completion: the earliest model place among its parameters (the
  // backward reaches it last). A bucket of padding alone is complete at once.
  std::vector<std::int64_t> completes(initial_.size(), std::numeric_limits<std::int64_t>::max());
  for (size_t i = 0; i < parameters.size(); ++i) {
    const auto& p = parameters[i];
    std::int64_t first = 0;
    while (first + 1 < partition.buckets() && partition.bucket(first + 1).begin <= p.begin) ++first;
    std::int64_t last = first;
    while (last + 1 < partition.buckets() && partition.bucket(last + 1).begin < p.end()) ++last;
    spans_.push_back({first, last});
    elements_.push_back(p.length);
    total_elements_ += p.length;
    for (auto b = first; b <= last; ++b) {
      ++initial_[static_cast<size_t>(b)];
      completes[static_cast<size_t>(b)] = std::min(completes[static_cast<size_t>(b)], order[i]);
    }
  }
  // Latest place first; among equals (a parameter over several buckets) the higher bucket first.
  for (std::int64_t b = partition.buckets() - 1; b >= 0; --b) order_.push_back(b);
  std::stable_sort(order_.begin(), order_.end(), [&](std::int64_t a, std::int64_t b) {
    return completes[static_cast<size_t>(a)] > completes[static_cast<size_t>(b)];
  });
}

TRAINKIT_INLINE void Readiness::arm(Reduction& reduction) {
  waiting_ = initial_;
  fired_.assign(spans_.size(), false);
  pending_elements_ = total_elements_;
  next_ = 0;
  reduction_ = &reduction;
}

TRAINKIT_INLINE void Readiness::launch_rest() {
  if (!reduction_) return;
  for (; next_ < static_cast<std::int64_t>(order_.size()); ++next_) {
    reduction_->launch(order_[static_cast<size_t>(next_)]);
    ++launches_;  // (the backward has ended: nothing left to hide behind)
  }
}

TRAINKIT_INLINE void Readiness::ready(size_t i) {
  if (!reduction_) return;
  const auto [first, last] = spans_[i];
  if (fired_[i]) {
    // A second accumulation in one backward: the reentrant backward of tk::recompute for a
    // parameter used inside and outside its region. Harmless until the bucket has left.
    bool sent = false;  // a bucket of it has left
    for (std::int64_t k = 0; k < next_ && !sent; ++k) sent = order_[static_cast<size_t>(k)] >= first && order_[static_cast<size_t>(k)] <= last;
    if (sent)
      throw std::runtime_error("trainkit: parameter '" + names_[i] + "' received a second gradient in one backward "
                               "after its bucket's reduction had started (a parameter used both inside and outside "
                               "tk::recompute?); set TrainerOptions::overlap_reduction(false) (TRAIN.OVERLAP_REDUCTION: false)");
    return;
  }
  fired_[i] = true;
  pending_elements_ -= elements_[i];
  for (auto b = first; b <= last; ++b) --waiting_[static_cast<size_t>(b)];
  while (next_ < static_cast<std::int64_t>(order_.size()) && waiting_[static_cast<size_t>(order_[static_cast<size_t>(next_)])] == 0) {
    reduction_->launch(order_[static_cast<size_t>(next_++)]);
    if (pending_elements_ > 0) ++overlapped_;  // (launched by the last gradient: nothing left to overlap)
    ++launches_;
    left_sum_ += total_elements_ > 0 ? static_cast<double>(pending_elements_) / static_cast<double>(total_elements_) : 0.0;
  }
}

TRAINKIT_INLINE void ReadyHook::operator()(const torch::autograd::Variable& param) {
  if (auto u = units_.lock()) u->ready(index_, param);  // (first: its unit's bucket may launch next)
  if (auto r = readiness_.lock()) r->ready(index_);
}

TRAINKIT_INLINE void FlatParameters::check() const {
  for (const auto& v : views_)
    if (v.param.storage().unsafeGetStorageImpl() != v.param_storage)
      throw std::logic_error(
          "Trainer: parameter '" + v.name + "' no longer lives in the trainer's storage: its data were replaced "
          "after the trainer was built (torch::load(model, file), param.set_data(...), model->to(...)), so the "
          "optimizer would update a copy the model does not read and the loss would never change. Load weights "
          "or move the model before building the trainer, or use trainer.load(path) or tk::load_weights(model, "
          "path), which copy into the parameters");
  for (const auto& v : views_)
    if (v.grad_storage != nullptr &&  // (stage 3: the .grad exist only inside a backward)
        (!v.param.grad().defined() || v.param.grad().storage().unsafeGetStorageImpl() != v.grad_storage))
      throw std::logic_error(
          "Trainer: the .grad of parameter '" + v.name +
          "' was replaced or reset (model->zero_grad() or an optimizer's zero_grad()?); the "
          "trainer owns gradients and zeroes them itself after each optimizer step");
}

TRAINKIT_INLINE void FlatParameters::place(torch::nn::Module& model, const TrainerOptions& options,
                                           torch::Device device, std::int64_t element_size, bool any_floating_point) {
  std::vector<bool> no_decay_used(options.no_decay().size(), false);
  std::vector<PlacedParameter> placed;
  for (const auto& p : model.named_parameters(true)) {
    if (!p.value().requires_grad()) continue;
    const auto& t = p.value();
    TORCH_CHECK(t.device() == device, "Trainer: parameter '", p.key(), "' is on ", t.device(),
                ", the others on ", device, "; move the whole model to one device first");
    if (any_floating_point) {
      TORCH_CHECK(t.is_floating_point(), "Trainer: parameter '", p.key(), "' is ", t.scalar_type(),
                  "; master weights need floating-point parameters");
    } else {
      TORCH_CHECK(t.scalar_type() == torch::kFloat, "Trainer: parameter '", p.key(), "' is ", t.scalar_type(),
                  "; trainkit keeps parameters in fp32 (mixed precision comes from the precision policy)");
    }
    PlacedParameter e{p.key(), t};
    e.order = static_cast<std::int64_t>(placed.size());
    for (const auto& [substring, m] : options.lr_mult())
      if (p.key().find(substring) != std::string::npos) {
        e.lr_mult = m;
        break;
      }
    for (size_t k = 0; k < options.no_decay().size(); ++k)
      if (p.key().find(options.no_decay()[k]) != std::string::npos) e.decay = false, no_decay_used[k] = true;
    placed.push_back(std::move(e));
  }
  placed_ = std::move(placed);
  if (options.sharding() == Sharding::parameters) resolve_units(model, options.units());
  for (size_t k = 0; k < no_decay_used.size(); ++k)
    TORCH_CHECK(no_decay_used[k], "Trainer: no_decay (TRAIN.NO_DECAY) '", options.no_decay()[k],
                "' is in no trainable parameter's name (they look like '",
                placed_.empty() ? std::string() : placed_.front().name, "')");
  // By unit (stage 3; otherwise every parameter is in unit 0), then by group.
  using Key = std::pair<double, bool>;
  std::vector<Key> order;
  for (const auto& e : placed_)
    if (std::find(order.begin(), order.end(), Key{e.lr_mult, e.decay}) == order.end()) order.push_back({e.lr_mult, e.decay});
  const auto rank = [&](const PlacedParameter& e) { return std::find(order.begin(), order.end(), Key{e.lr_mult, e.decay}); };
  std::stable_sort(placed_.begin(), placed_.end(), [&](const PlacedParameter& a, const PlacedParameter& b) {
    return a.unit != b.unit ? a.unit < b.unit : rank(a) < rank(b);
  });
  align_ = aligned_elements(element_size);
  place_offsets(align_);
  partition_ = Partition(layout_.padded(), std::max<std::int64_t>(1, layout_.padded()), align_, 1, 0, false);
}

TRAINKIT_INLINE Partition FlatParameters::partition_for(const Replicas& replicas, Sharding sharding,
                                                        std::int64_t element_size) const {
  if (!replicas.communicates())
    return Partition(layout_.padded(), std::max<std::int64_t>(1, layout_.padded()), align_, 1, 0, false);
  return Partition(layout_.padded(), std::max<std::int64_t>(1, replicas.bucket_bytes() / element_size), align_,
                   replicas.world_size(), replicas.rank(), sharding != Sharding::none);
}

TRAINKIT_INLINE void FlatParameters::resolve_units(torch::nn::Module& model, const std::vector<std::string>& paths) {
  const auto modules = model.named_modules("", /*include_self=*/false);
  const auto example = [&] {
    std::string out;
    for (const auto& m : modules) {
      if (out.size() > 60) return out + ", ...";
      out += (out.empty() ? "'" : ", '") + m.key() + "'";
    }
    return out.empty() ? std::string("none") : out;
  }();
  unit_paths_ = {{"", nullptr}};
  const auto add = [&](const std::string& path, const torch::nn::Module* module, const std::string& given) {
    for (const auto& [other, m] : unit_paths_) {
      if (other.empty()) continue;
      if (other == path)
        throw std::invalid_argument("trainkit::TrainerOptions::units: '" + given + "' names unit '" + path + "' again");
      const auto inside = [](const std::string& a, const std::string& b) { return a.rfind(b + ".", 0) == 0; };
      if (inside(path, other) || inside(other, path))
        throw std::invalid_argument("trainkit::TrainerOptions::units: unit '" + path + "' (from '" + given +
                                    "') and unit '" + other + "' are one inside the other; a parameter belongs to "
                                    "one unit: name the outer one or the inner ones");
    }
    unit_paths_.push_back({path, module});
  };
  for (const auto& given : paths) {
    const bool children = given.size() >= 2 && given.compare(given.size() - 2, 2, ".*") == 0;
    const std::string path = children ? given.substr(0, given.size() - 2) : given;
    const auto* found = modules.find(path);
    if (!found)
      throw std::invalid_argument("trainkit::TrainerOptions::units: '" + given + "' names no module of the model" +
                                  (children ? " (the part before \".*\")" : std::string()) + "; its modules are named " +
                                  example);
    if (!children) {
      add(path, found->get(), given);
      continue;
    }
    const auto kids = (*found)->named_children();
    if (kids.is_empty())
      throw std::invalid_argument("trainkit::TrainerOptions::units: '" + given + "': module '" + path +
                                  "' has no children");
    for (const auto& c : kids) add(path + "." + c.key(), c.value().get(), given);
  }
  for (auto& e : placed_)
    for (size_t u = 1; u < unit_paths_.size(); ++u)
      if (e.name.rfind(unit_paths_[u].first + ".", 0) == 0) e.unit = static_cast<std::int64_t>(u);
  // A unit whose trainable parameters hold no element has nothing to gather: its parameters
  // are the root unit's.
  std::vector<std::int64_t> elements(unit_paths_.size(), 0);
  for (const auto& e : placed_) elements[static_cast<size_t>(e.unit)] += e.param.numel();
  for (auto& e : placed_)
    if (elements[static_cast<size_t>(e.unit)] == 0) e.unit = 0;
}

TRAINKIT_INLINE void FlatParameters::place_offsets(std::int64_t multiple) {
  layout_ = FlatLayout(align_);
  for (size_t i = 0; i < placed_.size(); ++i) {
    if (i > 0 && placed_[i].unit != placed_[i - 1].unit) layout_.pad_to(multiple);
    placed_[i].offset = layout_.add(placed_[i].param.numel());
  }
}

TRAINKIT_INLINE std::vector<Range> FlatParameters::unit_ranges(std::int64_t multiple) const {
  std::vector<Range> out;
  for (size_t i = 0; i < placed_.size(); ++i)
    if (i == 0 || placed_[i].unit != placed_[i - 1].unit) {
      if (!out.empty()) out.back().length = placed_[i].offset - out.back().begin;
      out.push_back({placed_[i].offset, 0});
    }
  if (!out.empty()) out.back().length = (layout_.padded() + multiple - 1) / multiple * multiple - out.back().begin;
  return out;
}

TRAINKIT_INLINE void FlatParameters::install_hooks(bool overlap) {
  std::vector<Range> ranges;
  std::vector<std::int64_t> order;
  std::vector<std::string> names;
  for (const auto& e : placed_) {
    ranges.push_back({e.offset, e.param.numel()});
    order.push_back(e.order);
    names.push_back(e.name);
  }
  if (overlap) readiness_ = std::make_shared<Readiness>(ranges, order, std::move(names), partition_);
  for (size_t i = 0; i < placed_.size(); ++i)
    torch::autograd::impl::set_post_acc_grad_hooks(placed_[i].param, std::make_unique<ReadyHook>(readiness_, units_, i));
}

TRAINKIT_INLINE torch::Tensor FlatParameters::allocate_flat(std::int64_t numel, torch::Device device) const {
  auto flat = torch::empty({numel}, torch::dtype(torch::kFloat).device(device));
  layout_.zero_gaps(flat);
  return flat;
}

TRAINKIT_INLINE torch::Tensor FlatParameters::copy_in(const PlacedParameter& e, const torch::Tensor& flat) {
  torch::NoGradGuard no_grad;
  auto view = flat.narrow(0, e.offset, e.param.numel()).view(e.param.sizes());
  view.copy_(e.param);
  return view;
}

TRAINKIT_INLINE void FlatParameters::release_cached(torch::Device device) {
  if (!device.is_cpu()) c10::getDeviceAllocator(device.type())->emptyCache();
}

TRAINKIT_INLINE void FlatParameters::make_groups(const torch::Tensor& grads, bool bind_params) {
  groups_.clear();
  ranges_.clear();
  std::int64_t begin = 0;
  for (size_t i = 0; i < placed_.size(); ++i) {
    const auto& e = placed_[i];
    if (i == 0 || placed_[i - 1].lr_mult != e.lr_mult || placed_[i - 1].decay != e.decay) begin = e.offset;
    const bool ends = i + 1 == placed_.size() || placed_[i + 1].lr_mult != e.lr_mult || placed_[i + 1].decay != e.decay;
    if (!ends) continue;
    const auto end = e.offset + e.param.numel();
    groups_.push_back({bind_params ? params_.narrow(0, begin, end - begin) : torch::Tensor(),
                       grads.defined() ? grads.narrow(0, begin, end - begin) : torch::Tensor(), e.lr_mult, e.decay,
                       layout_.slice(begin, end), /*state_offset=*/begin});
    ranges_.push_back({begin, end - begin});
  }
}

TRAINKIT_INLINE void FlatParameters::record_view(const PlacedParameter& e) {
  views_.push_back({e.param, e.param.grad().defined() ? e.param.grad().storage().unsafeGetStorageImpl() : nullptr,
                    e.param.storage().unsafeGetStorageImpl(), e.name});
}

TRAINKIT_INLINE void FlatParameters::bind_gradients(const torch::Tensor& grads) {
  for (size_t g = 0; g < groups_.size(); ++g)
    groups_[g].grads = grads.defined() ? grads.narrow(0, ranges_[g].begin, ranges_[g].length) : torch::Tensor();
}

TRAINKIT_INLINE std::vector<ParamGroup> FlatParameters::chunk_groups(Range range, const torch::Tensor& params,
                                                                     const torch::Tensor& grads,
                                                                     std::int64_t state_begin) const {
  std::vector<ParamGroup> out(groups_.size());
  for (size_t g = 0; g < groups_.size(); ++g) {
    const auto lo = std::max(range.begin, ranges_[g].begin), hi = std::min(range.end(), ranges_[g].end());
    if (lo >= hi) continue;
    out[g].params = params.narrow(0, lo - range.begin, hi - lo);
    out[g].grads = grads.narrow(0, lo - range.begin, hi - lo);
    out[g].lr_mult = groups_[g].lr_mult;
    out[g].decay = groups_[g].decay;
    out[g].state_offset = state_begin + (lo - range.begin);
  }
  return out;
}

TRAINKIT_INLINE std::vector<ParamGroup> FlatParameters::slice_groups(std::int64_t b, const torch::Tensor& params,
                                                                     bool params_local,
                                                                     const torch::Tensor& local_grads) const {
  const Range s = partition_.slice(b);
  const auto at = partition_.local(b);
  return chunk_groups(s, params.narrow(0, params_local ? at : s.begin, s.length), local_grads.narrow(0, at, s.length), at);
}

TRAINKIT_INLINE void FlatParameters::write_by_name(torch::serialize::OutputArchive& archive, const std::string& prefix,
                                                   const torch::Tensor& global) const {
  for (const auto& e : placed_)
    write_tensor(archive, prefix + e.name, global.narrow(0, e.offset, e.param.numel()).view(e.param.sizes()));
}

TRAINKIT_INLINE void FlatParameters::write_local_by_name(torch::serialize::OutputArchive& archive,
                                                         const std::string& prefix, const torch::Tensor& local) const {
  if (const auto* set = ShardedWrites::of(archive); set != nullptr && partition_.sharded()) {
    for (const auto& e : placed_) {
      for_each_piece(e, [&](std::int64_t at, std::int64_t from, std::int64_t n) {
        write_piece(prefix + e.name, e.param.sizes(), from, local.narrow(0, at, n));
      });
      if (e.param.numel() == 0 && set->main()) write_piece(prefix + e.name, e.param.sizes(), 0, local.narrow(0, 0, 0));
    }
    return;
  }
  const auto global = global_of(local);
  if (global.defined()) write_by_name(archive, prefix, global);
}

TRAINKIT_INLINE void FlatParameters::read_by_name(torch::serialize::InputArchive& archive, const std::string& prefix,
                                                  const torch::Tensor& local) const {
  for (const auto& e : placed_) {
    const auto shape = tensor_shape(archive, prefix + e.name);
    if (!shape) throw missing_record(prefix + e.name);
    if (c10::IntArrayRef(*shape) != e.param.sizes())
      throw std::runtime_error("checkpoint record '" + prefix + e.name + "' has shape " + shape_string(*shape) +
                               ", this run needs " + shape_string(e.param.sizes()));
  }
  torch::NoGradGuard no_grad;
  if (const auto* set = ShardReads::of(archive)) {
    // Only this rank's pieces, read from the set's files.
    for (const auto& e : placed_)
      for_each_piece(e, [&](std::int64_t at, std::int64_t from, std::int64_t n) {
        set->read_range(prefix + e.name, from, n, local.narrow(0, at, n));
      });
    return;
  }
  for (const auto& e : placed_) {
    const auto saved = read_tensor(archive, prefix + e.name).reshape({-1});
    for_each_piece(e, [&](std::int64_t at, std::int64_t from, std::int64_t n) {
      local.narrow(0, at, n).copy_(saved.narrow(0, from, n));
    });
  }
}

TRAINKIT_INLINE torch::Tensor FlatParameters::global_of(const torch::Tensor& local) const {
  if (!partition_.sharded()) return local;
  return replicas_->gather_to_main(local, partition_);
}

TRAINKIT_INLINE void FlatParameters::save_state(torch::serialize::OutputArchive& archive,
                                                const UpdateRule& rule) const {
  for (const auto* s : rule.flat_states()) write_local_by_name(archive, "optim." + s->kind() + ".", s->flat());
}

TRAINKIT_INLINE void FlatParameters::load_state(torch::serialize::InputArchive& archive, UpdateRule& rule) const {
  for (auto* s : rule.flat_states()) {
    const std::string prefix = "optim." + s->kind() + ".";
    if (!placed_.empty() && !tensor_shape(archive, prefix + placed_.front().name) &&
        tensor_shape(archive, prefix + "0") && !partition_.sharded()) {
      for (size_t g = 0; g < groups_.size(); ++g)
        groups_[g].layout.read_into(archive, prefix + std::to_string(g),
                                    s->flat().narrow(0, ranges_[g].begin, ranges_[g].length));
      continue;
    }
    read_by_name(archive, prefix, s->flat());
  }
}

TRAINKIT_INLINE void FlatParameters::save_reduced_window(torch::serialize::OutputArchive& archive,
                                                         bool snapshot) const {
  TORCH_CHECK(summed_, "Sharding::gradients: an open window without a reduced micro-batch");
  if (snapshot) {
    write_tensor(archive, "snapshot.window_local", local_grad_);
    return;
  }
  write_local_by_name(archive, "window.gradient_reduced.", local_grad_);
}

TRAINKIT_INLINE bool FlatParameters::load_reduced_window(torch::serialize::InputArchive& archive, bool snapshot,
                                                         bool shards_gradients) {
  if (snapshot && shards_gradients) {
    local_grad_ = read_tensor(archive, "snapshot.window_local").to(params_.device());
    summed_ = true;
    return true;
  }
  const bool reduced = !placed_.empty() && tensor_shape(archive, "window.gradient_reduced." + placed_.front().name);
  if (reduced != shards_gradients)
    throw std::runtime_error(std::string("it was written inside a window (PARTIAL_WINDOW: span) ") +
                             (reduced ? "with gradients sharded (TRAIN.ZERO_STAGE: 2), and this run does not shard them"
                                      : "without sharded gradients, and this run shards them (TRAIN.ZERO_STAGE: 2)") +
                             "; resume with the checkpoint's TRAIN.ZERO_STAGE, or from a checkpoint at a window's end");
  if (!reduced) return false;
  local_grad_ = torch::zeros({partition_.local_total()}, params_.options());
  read_by_name(archive, "window.gradient_reduced.", local_grad_);
  summed_ = true;
  return true;
}

TRAINKIT_INLINE FlatParameters::~FlatParameters() {
  if (!units_) return;
  UnitRegistry::get().remove(units_.get());
  units_->close();
}

TRAINKIT_INLINE void FlatParameters::require_units() const {
  if (std::none_of(placed_.begin(), placed_.end(), [](const PlacedParameter& e) { return e.unit != 0; }))
    throw std::invalid_argument("set_replicas: ZeRO stage 3 (Sharding::parameters, TRAIN.ZERO_STAGE: 3) with no "
                                "units (TrainerOptions::units, TRAIN.UNITS): every parameter would be kept whole, as "
                                "stage 2 keeps them; name the model's units (its layers), or use stage 2");
}

TRAINKIT_INLINE void FlatParameters::shard_into_units(at::ScalarType unit_dtype,
                                                      const std::function<torch::Tensor(size_t)>& values,
                                                      const std::vector<bool>& skip, std::int64_t prefetch,
                                                      bool reshard, torch::Device device) {
  // Each unit one bucket, cut in as many aligned slices as there are ranks.
  const std::int64_t multiple = align_ * replicas_->world_size();
  place_offsets(multiple);
  partition_ = Partition(unit_ranges(multiple), replicas_->world_size(), replicas_->rank());
  // Unit by unit: an fp32 buffer filled from the parameters' values, this rank's slice of it
  // kept, the unit's own buffer (that one, or its cast) what the parameters become views of,
  // released but the root unit's: the whole model is held once plus one unit, never twice.
  torch::NoGradGuard no_grad;
  const auto fp32 = torch::dtype(torch::kFloat).device(device);
  std::vector<ShardedUnits::Unit> units;
  std::vector<std::int64_t> member_of(placed_.size(), 0), at(placed_.size(), 0);
  auto local = torch::zeros({partition_.local_total()}, fp32);
  torch::Tensor filling;  // the open unit's fp32 values
  const auto finish = [&](ShardedUnits::Unit& u) {
    const auto bucket = partition_.bucket(u.bucket), s = partition_.slice(u.bucket);
    local.narrow(0, partition_.local(u.bucket), s.length).copy_(filling.narrow(0, s.begin - bucket.begin, s.length));
    if (unit_dtype != at::kFloat) u.buffer.copy_(filling);
    filling = torch::Tensor();
    if (!u.whole) release_storage(u.buffer);
  };
  for (size_t i = 0; i < placed_.size(); ++i) {
    auto& e = placed_[i];
    if (i == 0 || e.unit != placed_[i - 1].unit) {
      if (!units.empty()) finish(units.back());
      const auto b = static_cast<std::int64_t>(units.size());
      const auto& [name, module] = unit_paths_.at(static_cast<size_t>(e.unit));
      filling = torch::zeros({partition_.bucket(b).length}, fp32);
      auto buffer = unit_dtype == at::kFloat ? filling : torch::empty_like(filling, filling.options().dtype(unit_dtype));
      units.push_back({name, module, b, buffer, 0, e.unit == 0});
    }
    auto& u = units.back();
    const auto begin = partition_.bucket(u.bucket).begin;
    const auto n = e.param.numel();
    filling.narrow(0, e.offset - begin, n).copy_(values(i));
    if (skip.empty() || !skip[i]) e.param.set_data(u.buffer.narrow(0, e.offset - begin, n).view(e.param.sizes()));
    ++u.members;
    member_of[i] = u.bucket;
    at[i] = e.offset - begin;
  }
  if (!units.empty()) finish(units.back());
  params_ = local;  // (the construction's flat buffer goes)
  unit_slices_ = unit_dtype == at::kFloat ? params_ : params_.to(unit_dtype);
  make_groups(torch::Tensor(), /*bind_params=*/false);  // metadata only: the update reads this rank's slices
  views_.clear();
  for (const auto& e : placed_) record_view(e);
  std::vector<torch::Tensor> trainable;
  for (const auto& e : placed_) trainable.push_back(e.param);
  units_ = std::make_shared<ShardedUnits>(std::move(units), std::move(trainable), std::move(member_of), std::move(at),
                                          *replicas_, partition_, unit_slices_, prefetch, reshard);
  release_cached(device);
  UnitRegistry::get().add(units_);
}

TRAINKIT_INLINE void FlatParameters::begin_unit_backward(const BackwardDone& done) {
  if (units_->held())
    throw std::logic_error("trainkit: a micro-step while every unit is held gathered (hold_parameters(true)); "
                           "call hold_parameters(false) on every rank first");
  // (Every backward's unit gradients, a micro-batch's or a piece's, are reduce-scattered as the
  // backward leaves each unit: no rank holds every unit's gradient from one backward to the next.)
  if (overlap_)
    reduction_ = replicas_->start_unit_reduction(unit_gradients(), reduction_target(), partition_, done.window, done.closes);
  units_->arm(reduction_.get());
}

TRAINKIT_INLINE void FlatParameters::end_unit_backward(const BackwardDone& done) {
  units_->release_all();  // (the units whose parameters got no gradient)
  if (!done.closes) finish_reduction(*replicas_, done.window, /*closes=*/false);
}

TRAINKIT_INLINE void FlatParameters::drop_backward() {
  drop_reduction();
  if (!units_) return;
  units_->release_all();
  units_->drop_gradients();
}

TRAINKIT_INLINE const torch::Tensor& FlatParameters::root_unit() const {
  for (const auto& u : units_->units())
    if (u.whole) return u.buffer;
  return no_state_;
}

TRAINKIT_INLINE GradientBuckets FlatParameters::unit_gradients() const {
  GradientBuckets buckets;
  buckets.input = [units = units_.get()](std::int64_t b) { return units->gradient(b); };
  buckets.done = [units = units_.get()](std::int64_t b) { units->gradient_done(b); };
  return buckets;
}

TRAINKIT_INLINE torch::Tensor FlatParameters::reduction_target() {
  if (!sharded()) return {};
  torch::Tensor& target = summed_ ? scratch_ : local_grad_;
  if (!target.defined()) target = torch::empty({partition_.local_total()}, params_.options());
  return target;
}

TRAINKIT_INLINE GradientFactor FlatParameters::finish_reduction(Replicas& replicas, const WindowWeights& window,
                                                                bool closes, torch::Tensor* flat) {
  GradientFactor factor;
  if (reduction_) {
    if (readiness_) {
      readiness_->launch_rest();  // (parameters that got no gradient), in the launch order
      readiness_->disarm();
    }
    if (units_) units_->disarm();  // (finish() launches the units the backward did not, last first)
    factor = reduction_->finish();
    reduction_.reset();
  } else if (units_) {
    factor = replicas.start_unit_reduction(unit_gradients(), reduction_target(), partition_, window, closes)->finish();
  } else {
    TORCH_CHECK(flat != nullptr, "finish_reduction: no gradient to reduce");
    factor = replicas.reduce_buckets(*flat, reduction_target(), partition_, window, closes);
  }
  if (sharded()) {
    if (summed_) local_grad_.add_(scratch_);
    summed_ = true;
  }
  return factor;
}

TRAINKIT_INLINE void FlatParameters::drop_reduction() {
  if (!reduction_) return;
  const auto launched = readiness_ ? readiness_->launched() : units_ ? units_->launched() : 0;
  if (readiness_) readiness_->disarm();
  if (units_) units_->disarm();
  if (launched == 0) {
    reduction_.reset();  // nothing sent
    return;
  }
  throw std::runtime_error(
      "trainkit: the window was dropped (an out-of-memory error in its backward?) after " + std::to_string(launched) +
      " bucket(s) of its gradient reduction had started on this rank, overlapped with the backward: the other ranks "
      "cannot replay it with this one, so training stops here. Resume from the last checkpoint with a smaller "
      "micro-batch or TRAIN.MEMORY_BUDGET, or set TRAIN.OVERLAP_REDUCTION: false "
      "(TrainerOptions::overlap_reduction) to reduce after the backward, where such a window can be replayed");
}

}  // namespace detail
}  // namespace trainkit
namespace trainkit {

TRAINKIT_INLINE void FlatStorage::validate(const TrainerOptions& options, const std::string& trainer) {
  if (options.reduce_precision() == ReducePrecision::half)
    throw std::invalid_argument(
        "trainkit::TrainerOptions: reduce_precision half needs master weights (PrecisionPolicy<MasterWeights<T>>): "
        "without them the gradient is fp32, and " + trainer + " all-reduces it as it is");
}

TRAINKIT_INLINE FlatStorage::FlatStorage(torch::nn::Module& model, const TrainerOptions& options, torch::Device device,
                                         at::ScalarType dtype)
    : sharding_(options.sharding()),
      unit_prefetch_(options.unit_prefetch()),
      reshard_after_forward_(options.reshard_after_forward()),
      device_(device) {
  TORCH_CHECK(dtype == at::kFloat, "FlatStorage holds fp32 parameters, not ", dtype);
  overlap_ = options.overlap_reduction();
  place(model, options, device, /*element_size=*/4, /*any_floating_point=*/false);
  allocate(layout_.padded());
}

TRAINKIT_INLINE bool FlatStorage::attach(Replicas& replicas, torch::nn::Module& model) {
  if (units_)
    throw std::logic_error("set_replicas: the parameters are sharded over the ranks already (ZeRO stage 3); attach "
                           "the replicas once");
  replicas_ = &replicas;
  if (sharding_ == Sharding::parameters && replicas.communicates()) {
    attach_units(replicas, model);
  } else {
    partition_ = partition_for(replicas, sharding_, /*element_size=*/4);
    if (partition_.total() != params_.numel()) allocate(partition_.total());
    replicas.attach(model, params_);
  }
  local_grad_ = torch::Tensor();
  summed_ = false;
  if (shards_gradients()) detail::release_storage(grad_);
  readiness_.reset();
  // (Stage 3 launches its units' reductions at the backward's gathers, not from the hooks.)
  if ((overlap_ && replicas.communicates()) || units_) install_hooks(overlap_ && replicas.communicates() && !units_);
  return sharded();
}

TRAINKIT_INLINE void FlatStorage::attach_units(Replicas& replicas, torch::nn::Module& model) {
  require_units();
  // The whole gradient goes first (stage 3 holds one per unit, and only as needed); every rank
  // takes rank 0's values in the construction's layout (one broadcast).
  for (auto& e : placed_) e.param.mutable_grad() = torch::Tensor();
  for (auto& g : groups_) g.grads = torch::Tensor();
  views_.clear();
  grad_ = torch::empty({0}, params_.options());
  replicas.attach(model, params_);
  // Each parameter's values are its own view of the construction's flat buffer until moved.
  shard_into_units(at::kFloat, [&](size_t i) { return placed_[i].param.reshape({-1}); }, {}, unit_prefetch_,
                   reshard_after_forward_, device_);
}

TRAINKIT_INLINE ModelSize detail::FlatParameters::model_size(torch::nn::Module& model) const {
  ModelSize size;
  std::vector<std::int64_t> units(unit_paths_.size() + 1, 0);
  std::unordered_set<const c10::TensorImpl*> trained;
  for (const auto& e : placed_) {
    const auto n = e.param.numel();
    size.trained += n;
    units.at(static_cast<size_t>(e.unit)) += n;
    trained.insert(e.param.unsafeGetTensorImpl());
  }
  size.root = units[0];
  for (size_t u = 1; u < units.size(); ++u) size.largest_unit = std::max(size.largest_unit, units[u]);
  for (const auto& p : model.parameters())
    if (!trained.count(p.unsafeGetTensorImpl())) size.frozen += p.numel();
  return size;
}

TRAINKIT_INLINE void FlatStorage::backward_begins(const detail::BackwardDone& done) {
  if (units_) {
    begin_unit_backward(done);
    return;
  }
  allocate_gradient();
  if (readiness_ && done.micro_batch_ends && (done.closes || shards_gradients())) {
    reduction_ = replicas_->start_reduction(grad_, reduction_target(), partition_, done.window, done.closes);
    readiness_->arm(*reduction_);
  }
}

TRAINKIT_INLINE void FlatStorage::backward_done(const detail::BackwardDone& done) {
  if (units_) return end_unit_backward(done);
  if (done.closes || !done.micro_batch_ends || !shards_gradients()) return;
  finish_reduction(*replicas_, done.window, /*closes=*/false, &grad_);
  detail::release_storage(grad_);
}

TRAINKIT_INLINE GradientFactor FlatStorage::reduce(Replicas& replicas, const WindowWeights& window) {
  // (A window flushed at an epoch's end after a reduced micro-batch has no gradient left:
  // zeros stand for it, and the reduction still brings the window's item total.)
  if (!units_) allocate_gradient();
  const GradientFactor factor = finish_reduction(replicas, window, /*closes=*/true, &grad_);
  if (shards_gradients()) detail::release_storage(grad_);
  return factor;
}

TRAINKIT_INLINE torch::Tensor FlatStorage::norm() const {
  return sharded() ? replicas_->global_norm(local_grad_) : at::linalg_vector_norm(grad_, 2);
}

TRAINKIT_INLINE void FlatStorage::discard_micro_batch() {
  drop_backward();
  if (!detail::is_released(grad_)) detail::release_storage(grad_);
}

TRAINKIT_INLINE void FlatStorage::zero() {
  drop_backward();  // (after a failed forward or backward too)
  summed_ = false;
  if (!sharded()) {
    if (grad_.defined()) grad_.zero_();  // (none yet: stage 3 before its first backward)
    return;
  }
  if (shards_gradients()) {
    if (!detail::is_released(grad_)) detail::release_storage(grad_);
  } else {
    grad_.zero_();
  }
  local_grad_ = scratch_ = torch::Tensor();  // the reduced slices live from a reduction to the update
}

TRAINKIT_INLINE void FlatStorage::save(torch::serialize::OutputArchive& archive, torch::nn::Module& module,
                                       const detail::UpdateRule& rule) const {
  save_parameters(archive, module);
  save_state(archive, rule);
}

TRAINKIT_INLINE void FlatStorage::load(torch::serialize::InputArchive& archive, torch::nn::Module& module,
                                       detail::UpdateRule& rule) {
  load_parameters(archive, module);
  load_state(archive, rule);
}

TRAINKIT_INLINE void FlatStorage::snapshot(torch::serialize::OutputArchive& archive, torch::nn::Module& module,
                                           const detail::UpdateRule& rule) const {
  if (units_) {  // this rank's slices and the root unit as they are: no collective
    write_frozen(archive, module);
    detail::write_tensor(archive, "snapshot.params_local", params_);
    detail::write_tensor(archive, "snapshot.root", replicated_state());
  } else {
    save_parameters(archive, module);
  }
  for (const auto* s : rule.flat_states()) detail::write_tensor(archive, "snapshot." + s->kind(), s->flat());
}

TRAINKIT_INLINE void FlatStorage::restore(torch::serialize::InputArchive& archive, torch::nn::Module& module,
                                          detail::UpdateRule& rule) {
  if (units_) {
    units_->settle_all();
    read_frozen(archive, module);
    detail::read_into(archive, "snapshot.params_local", params_);
    detail::read_into(archive, "snapshot.root", replicated_state());
    units_->release_all();
  } else {
    load_parameters(archive, module);
  }
  for (auto* s : rule.flat_states()) detail::read_into(archive, "snapshot." + s->kind(), s->flat());
}

TRAINKIT_INLINE void FlatStorage::save_window(torch::serialize::OutputArchive& archive, bool snapshot) const {
  if (shards_gradients()) save_reduced_window(archive, snapshot);
  else layout_.write(archive, "window.gradient", grad_);
}

TRAINKIT_INLINE void FlatStorage::load_window(torch::serialize::InputArchive& archive, bool snapshot) {
  if (load_reduced_window(archive, snapshot, shards_gradients())) return;
  allocate_gradient();
  layout_.read_into(archive, "window.gradient", grad_);
}

TRAINKIT_INLINE void FlatStorage::save_parameters(torch::serialize::OutputArchive& archive,
                                                  torch::nn::Module& module) const {
  if (units_) {
    // Stage 3: the trainable parameters from every rank's slices (a set: each rank its own
    // pieces; one file: gathered to the main rank, a collective), the frozen ones as they are.
    write_local_by_name(archive, "model.param.", params_);
    write_frozen(archive, module);
    return;
  }
  if (const auto* set = detail::ShardedWrites::of(archive); set != nullptr && sharded()) {
    // Every rank holds the parameters; each writes the parts its slices cover (a set's files
    // then split the model over the ranks), the main rank the frozen ones (and the empty ones,
    // which no slice covers).
    for (const auto& e : placed_) {
      for_each_piece(e, [&](std::int64_t, std::int64_t from, std::int64_t n) {
        detail::write_piece("model.param." + e.name, e.param.sizes(), from, params_.narrow(0, e.offset + from, n));
      });
      if (e.param.numel() == 0 && set->main()) detail::write_piece("model.param." + e.name, e.param.sizes(), 0, e.param);
    }
    write_frozen(archive, module);
    return;
  }
  for (const auto& p : module.named_parameters(true)) detail::write_tensor(archive, "model.param." + p.key(), p.value());
}

TRAINKIT_INLINE void FlatStorage::write_frozen(torch::serialize::OutputArchive& archive, torch::nn::Module& module) const {
  for (const auto& p : module.named_parameters(true))
    if (!p.value().requires_grad()) detail::write_tensor(archive, "model.param." + p.key(), p.value());
}

TRAINKIT_INLINE void FlatStorage::read_frozen(torch::serialize::InputArchive& archive, torch::nn::Module& module) {
  torch::NoGradGuard no_grad;
  for (const auto& p : module.named_parameters(true))
    if (!p.value().requires_grad()) detail::read_into(archive, "model.param." + p.key(), p.value());
}

TRAINKIT_INLINE void FlatStorage::load_parameters(torch::serialize::InputArchive& archive, torch::nn::Module& module) {
  if (units_) {
    // Stage 3: this rank's slices (from a set, only their byte ranges); the root unit gathered
    // from them (a collective: every rank loads).
    units_->settle_all();  // (the slices are a gather's input)
    read_by_name(archive, "model.param.", params_);
    read_frozen(archive, module);
    return;  // (the root unit is gathered in after_load(), once every rank has read its part)
  }
  torch::NoGradGuard no_grad;
  for (const auto& p : module.named_parameters(true)) detail::read_into(archive, "model.param." + p.key(), p.value());
}

TRAINKIT_INLINE void FlatStorage::allocate(std::int64_t numel) {
  // The old gradient goes first (the parameters' .grad and the groups hold views of it), so
  // that at most the parameters are held twice.
  for (auto& e : placed_) e.param.mutable_grad() = torch::Tensor();
  groups_.clear();
  views_.clear();
  grad_ = torch::Tensor();
  auto flat = allocate_flat(numel, device_);
  for (auto& e : placed_) e.param.set_data(copy_in(e, flat));  // (releases the old storage)
  params_ = flat;
  release_cached(device_);
  // Stage 3 holds a gradient per unit once attached: until then (at construction) there is no
  // flat one; allocate_gradient makes it at its first use if the replicas never shard, so that
  // construction holds the model once, not twice.
  if (sharding_ == Sharding::parameters && replicas_ == nullptr) {
    views_.clear();
    for (const auto& e : placed_) record_view(e);
    make_groups(grad_);
    return;
  }
  bind_flat_gradient(numel);
}

TRAINKIT_INLINE void FlatStorage::bind_flat_gradient(std::int64_t numel) {
  grad_ = torch::zeros({numel}, params_.options());
  views_.clear();
  for (auto& e : placed_) {
    e.param.mutable_grad() = grad_.narrow(0, e.offset, e.param.numel()).view(e.param.sizes());
    record_view(e);
  }
  make_groups(grad_);
}

TRAINKIT_INLINE void FlatStorage::allocate_gradient() {
  if (units_) return;  // (stage 3: one per unit, as needed)
  if (!grad_.defined()) bind_flat_gradient(params_.numel());  // (stage 3 in one process: its first use)
  else if (detail::is_released(grad_)) detail::allocate_released(grad_);
}

}  // namespace trainkit
