#pragma once
/// The definitions of trainkit/storage/placement.hpp (header-only: included by it; compiled mode:
/// by src/trainkit.cpp alone). See docs/design/compiled-mode.md.
#include <trainkit/storage/placement.hpp>

#include <algorithm>
#include <stdexcept>
#include <unordered_set>

namespace trainkit::detail {

TRAINKIT_INLINE Placement::Placement(torch::nn::Module& model, const TrainerOptions& options, torch::Device device,
                                     std::int64_t element_size, bool any_floating_point, bool by_units) {
  std::vector<bool> no_decay_used(options.no_decay().size(), false);
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
    e.order = static_cast<std::int64_t>(placed_.size());
    for (const auto& [substring, m] : options.lr_mult())
      if (p.key().find(substring) != std::string::npos) {
        e.lr_mult = m;
        break;
      }
    for (size_t k = 0; k < options.no_decay().size(); ++k)
      if (p.key().find(options.no_decay()[k]) != std::string::npos) e.decay = false, no_decay_used[k] = true;
    placed_.push_back(std::move(e));
  }
  // (Each unit back to back, the layout the units' gathers cut; in one process too, so that its
  // prediction sees the units.)
  if (by_units) resolve_units(model, options.units());
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
}

TRAINKIT_INLINE void Placement::resolve_units(torch::nn::Module& model, const std::vector<std::string>& paths) {
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

TRAINKIT_INLINE ModelSize Placement::model_size(torch::nn::Module& model) const {
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

TRAINKIT_INLINE void Placement::require_units() const {
  if (std::none_of(placed_.begin(), placed_.end(), [](const PlacedParameter& e) { return e.unit != 0; }))
    throw std::invalid_argument("set_replicas: ZeRO stage 3 (Sharding::parameters, TRAIN.ZERO_STAGE: 3) with no "
                                "units (TrainerOptions::units, TRAIN.UNITS): every parameter would be kept whole, as "
                                "stage 2 keeps them; name the model's units (its layers), or use stage 2");
}

TRAINKIT_INLINE void Placement::place_offsets(std::int64_t multiple) {
  layout_ = FlatLayout(align_);
  for (size_t i = 0; i < placed_.size(); ++i) {
    if (i > 0 && placed_[i].unit != placed_[i - 1].unit) layout_.pad_to(multiple);
    placed_[i].offset = layout_.add(placed_[i].param.numel());
  }
}

TRAINKIT_INLINE std::vector<Range> Placement::unit_ranges(std::int64_t multiple) const {
  std::vector<Range> out;
  for (size_t i = 0; i < placed_.size(); ++i)
    if (i == 0 || placed_[i].unit != placed_[i - 1].unit) {
      if (!out.empty()) out.back().length = placed_[i].offset - out.back().begin;
      out.push_back({placed_[i].offset, 0});
    }
  if (!out.empty()) out.back().length = (layout_.padded() + multiple - 1) / multiple * multiple - out.back().begin;
  return out;
}

TRAINKIT_INLINE torch::Tensor Placement::allocate_flat(std::int64_t numel, torch::Device device) const {
  auto flat = torch::empty({numel}, torch::dtype(torch::kFloat).device(device));
  layout_.zero_gaps(flat);
  return flat;
}

TRAINKIT_INLINE torch::Tensor Placement::copy_in(const PlacedParameter& e, const torch::Tensor& flat) {
  torch::NoGradGuard no_grad;
  auto view = flat.narrow(0, e.offset, e.param.numel()).view(e.param.sizes());
  view.copy_(e.param);
  return view;
}

TRAINKIT_INLINE void Placement::make_groups(const torch::Tensor& params, const torch::Tensor& grads) {
  groups_.clear();
  ranges_.clear();
  std::int64_t begin = 0;
  for (size_t i = 0; i < placed_.size(); ++i) {
    const auto& e = placed_[i];
    if (i == 0 || placed_[i - 1].lr_mult != e.lr_mult || placed_[i - 1].decay != e.decay) begin = e.offset;
    const bool ends = i + 1 == placed_.size() || placed_[i + 1].lr_mult != e.lr_mult || placed_[i + 1].decay != e.decay;
    if (!ends) continue;
    const auto end = e.offset + e.param.numel();
    groups_.push_back({params.defined() ? params.narrow(0, begin, end - begin) : torch::Tensor(),
                       grads.defined() ? grads.narrow(0, begin, end - begin) : torch::Tensor(), e.lr_mult, e.decay,
                       layout_.slice(begin, end), /*state_offset=*/begin});
    ranges_.push_back({begin, end - begin});
  }
}

TRAINKIT_INLINE void Placement::bind_gradients(const torch::Tensor& grads) {
  for (size_t g = 0; g < groups_.size(); ++g)
    groups_[g].grads = grads.defined() ? grads.narrow(0, ranges_[g].begin, ranges_[g].length) : torch::Tensor();
}

TRAINKIT_INLINE void Placement::unbind_groups() {
  for (auto& g : groups_) g.params = g.grads = torch::Tensor();
}

TRAINKIT_INLINE std::vector<ParamGroup> Placement::chunk_groups(Range range, const torch::Tensor& params,
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

TRAINKIT_INLINE std::vector<ParamGroup> Placement::slice_groups(const Partition& partition, std::int64_t b,
                                                                const torch::Tensor& params, bool params_local,
                                                                const torch::Tensor& local_grads) const {
  const Range s = partition.slice(b);
  const auto at = partition.local(b);
  return chunk_groups(s, params.narrow(0, params_local ? at : s.begin, s.length), local_grads.narrow(0, at, s.length), at);
}

}  // namespace trainkit::detail
