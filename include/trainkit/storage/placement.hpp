#pragma once
/// Where a storage puts the trainable parameters: one flat layout (detail::FlatLayout), every
/// parameter 64-byte aligned, grouped by (LR multiplier, weight decay) in order of first
/// appearance (the model's order inside a group), so that each group is one contiguous slice
/// and the optimizer makes one fused call per group. With units named
/// (TrainerOptions::units, for ZeRO stage 3) each unit's parameters lie back to back. Both
/// storages place their parameters through it; a sharding mode (mode.hpp) cuts the result for
/// the ranks (detail::Partition) and may lay the offsets out again (place_offsets).
#include <trainkit/detail/inline.hpp>
#include <trainkit/detail/flat_layout.hpp>
#include <trainkit/detail/partition.hpp>
#include <trainkit/step/optim.hpp>
#include <trainkit/step/options.hpp>
#include <trainkit/storage/held_bytes.hpp>

#include <torch/nn/module.h>
#include <torch/types.h>

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace trainkit::detail {

/// A trainable parameter and where the storage puts it.
struct PlacedParameter {
  std::string name;
  torch::Tensor param;
  double lr_mult = 1.0;
  bool decay = true;
  std::int64_t offset = 0;  ///< in the flat buffers
  std::int64_t order = 0;   ///< its place among the model's trainable parameters
  std::int64_t unit = 0;    ///< its unit of stage 3 (0: the root unit, what no unit holds)
};

class Placement {
 public:
  Placement() = default;
  /// The trainable parameters of `model` on `device`, grouped and placed, each 64-byte aligned
  /// for elements of `element_size` bytes; `any_floating_point`: any floating dtype is taken
  /// (master weights), otherwise fp32 only. `by_units` (sharded units configured): each
  /// parameter's unit resolved from TrainerOptions::units (a path that names no module, one
  /// unit inside another, or a path given twice throws) and the units laid out one after another.
  Placement(torch::nn::Module& model, const TrainerOptions& options, torch::Device device, std::int64_t element_size,
            bool any_floating_point, bool by_units);

  const FlatLayout& layout() const { return layout_; }
  /// Elements per 64-byte unit of the narrowest dtype viewing the buffers.
  std::int64_t align() const { return align_; }
  const std::vector<PlacedParameter>& parameters() const { return placed_; }
  std::vector<PlacedParameter>& parameters() { return placed_; }
  const std::vector<ParamGroup>& groups() const { return groups_; }
  /// Each group's elements in the flat layout.
  const std::vector<Range>& group_ranges() const { return ranges_; }
  /// The units named (unit_paths()[0] is the root unit, "").
  const std::vector<std::pair<std::string, const torch::nn::Module*>>& unit_paths() const { return unit_paths_; }
  /// The model as predict_held (held_bytes.hpp) sees it: the trainable parameters, by unit when
  /// units are named, and `model`'s others (frozen).
  ModelSize model_size(torch::nn::Module& model) const;

  /// Throws when no parameter is in a named unit (stage 3 would keep every one whole).
  void require_units() const;
  /// The offsets again, in unit order, each unit starting at a multiple of `multiple` elements.
  void place_offsets(std::int64_t multiple);
  /// Each unit's range of the flat layout, in unit order (a bucket each at stage 3);
  /// `multiple`: place_offsets()'s.
  std::vector<Range> unit_ranges(std::int64_t multiple) const;

  /// `numel` elements of fp32 on `device`, the layout's gaps zero (before parameters are copied in).
  torch::Tensor allocate_flat(std::int64_t numel, torch::Device device) const;
  /// The view of `e` in `flat`, the parameter's current values copied in.
  static torch::Tensor copy_in(const PlacedParameter& e, const torch::Tensor& flat);

  /// One group per run of parameters with the same (LR multiplier, decay): slices of `params`
  /// and of `grads` (undefined: bound in each optimizer phase); the state at the group's
  /// offset. `params` undefined: the groups' params undefined too (their place alone).
  void make_groups(const torch::Tensor& params, const torch::Tensor& grads);
  /// The groups' gradients as slices of `grads` (the whole flat gradient), or none.
  void bind_gradients(const torch::Tensor& grads);
  /// The groups' parameters and gradients forgotten (their place in the layout stays).
  void unbind_groups();
  /// The overflow diagnosis's view (trainer/nonfinite_watch.hpp) of `flat`, a whole buffer in
  /// the flat layout (nothing when undefined): each parameter's part of it, and its place among
  /// the model's trainable parameters.
  void whole_parts(const torch::Tensor& flat, std::vector<torch::Tensor>& parts, std::vector<std::int64_t>& owners) const {
    if (!flat.defined()) return;
    for (const auto& e : placed_) {
      parts.push_back(flat.narrow(0, e.offset, e.param.numel()));
      owners.push_back(e.order);
    }
  }
  /// The groups restricted to the flat elements `range`: their parameters in `params` and
  /// their gradients in `grads` (both `range`'s elements, in any buffer), their state from
  /// `state_begin` on; a group outside the range has undefined params. The chunks of the
  /// master-weights phase and a rank's slices are updated through these.
  std::vector<ParamGroup> chunk_groups(Range range, const torch::Tensor& params, const torch::Tensor& grads,
                                       std::int64_t state_begin) const;
  /// chunk_groups over this rank's slice of bucket b of `partition`: parameters from `params`
  /// (global layout, or local when `params_local`), gradients and state in the local layout.
  std::vector<ParamGroup> slice_groups(const Partition& partition, std::int64_t b, const torch::Tensor& params,
                                       bool params_local, const torch::Tensor& local_grads) const;

 private:
  void resolve_units(torch::nn::Module& model, const std::vector<std::string>& paths);

  FlatLayout layout_;
  std::int64_t align_ = 16;
  std::vector<PlacedParameter> placed_;
  std::vector<ParamGroup> groups_;
  std::vector<Range> ranges_;  // each group's elements in the flat layout
  std::vector<std::pair<std::string, const torch::nn::Module*>> unit_paths_;
};

}  // namespace trainkit::detail

#ifndef TRAINKIT_COMPILED_LIB
#include <trainkit/storage/placement-inl.hpp>
#endif
