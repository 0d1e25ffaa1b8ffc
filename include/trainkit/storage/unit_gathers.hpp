#pragma once
/// ZeRO stage 3's gathers (the mode ShardedUnits, sharded_units.hpp, holds them): where each
/// unit's parameters exist whole. Both storages use them: FlatStorage with fp32 units,
/// MasterStorage with half ones gathered from half copies of this rank's fp32 masters.
///
/// A unit (TrainerOptions::units) is one bucket of the partition: its parameters lie back to
/// back in the flat layout, and each rank holds one slice of it in its local buffer (the
/// values the update writes, or their half copy). The model's parameters of the unit are views of the unit's own
/// buffer, whose memory exists only while gathered:
///   begin_forward()     the trainer's forward starts (the forward's order is recorded anew)
///   before_forward(u)   one all-gather of the unit's bucket into its buffer (tk::unit calls it),
///                       then the next `prefetch` units of the forward's order launched ahead
///   after_forward(u)    the buffer released (its views stay; FSDP2's reshard_after_forward):
///                       the graph's saved parameters are those views, and see the values again
///                       once the backward gathers them. Kept instead with reshard = false, and
///                       for the unit the previous forward ended with (the backward's first)
///   before_backward(u)  gathered again, when the gradient reaches one of the unit's outputs,
///                       then the next `prefetch` units of the backward's order launched ahead
///   ready(i, param)     parameter i's gradient accumulated (its post-accumulate-grad hook):
///                       added into the unit's fp32 gradient buffer (allocated, zeros, at the first
///                       of the unit's), the parameter's .grad reset; the unit's parameters
///                       released after its last parameter's
///   gradient(b)         bucket b's gradient for its reduce-scatter (zeros where no parameter
///                       of the unit got one); gradient_done(b) releases it once reduced
/// The parameters' .grad are undefined between their uses: autograd allocates each gradient
/// itself and the hook moves it into the unit's buffer, so no gradient is ever written into a
/// released buffer (a parameter used outside its unit's call gets its gradient all the same).
/// A rank thus holds, during a backward, the gradients of the units whose reduce-scatter has
/// not completed, not the whole model's.
///   release_all()       after the backward: the units whose parameters got no gradient too
///   hold()              every unit gathered until release_held() (a weights export)
///   begin_evaluation()  until end_evaluation(), each unit's call outside the step (autograd
///                       off: a validation by unit) gathers the unit and releases it after; the
///                       ranks' forwards may differ in number (see end_evaluation())
/// What no unit holds (the root unit: embeddings' neighbours, heads, norms at the top) is one
/// unit that is never released: it is gathered after every update and every load.
/// Every rank gathers in the order of its forward and backward, which the same model and
/// graph make the same on every rank (a unit called on some ranks only would hang them).
/// Prefetch: each unit's successor in the forward and in the backward is recorded as the step
/// runs (the same on every rank, as the order is); what to launch ahead is decided from what
/// every rank shares (that order, the units called or reached in this pass, the launches made),
/// never from whether this rank still holds a unit. A gather launched ahead is waited for when
/// its unit is called, and before its buffer is released, re-gathered or this rank's slices
/// (its input) are written (settle_all: the update, a load); one its pass did not use is dropped.
#include <trainkit/detail/partition.hpp>
#include <trainkit/detail/released_storage.hpp>
#include <trainkit/storage/evaluation_order.hpp>
#include <trainkit/storage/unit_schedule.hpp>
#include <trainkit/step/replicas.hpp>
#include <trainkit/storage/readiness.hpp>

#include <torch/nn/module.h>
#include <torch/types.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <exception>
#include <functional>
#include <stdexcept>
#include <string>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

namespace trainkit::detail {

class UnitGathers final : public UnitSchedule, public GradientListener, public Joinable {
 public:
  struct Unit {
    std::string name;                             ///< its module path ("" for the root unit)
    const torch::nn::Module* module = nullptr;    ///< null for the root unit
    std::int64_t bucket = 0;                      ///< its bucket of the partition
    torch::Tensor buffer;                         ///< the bucket's elements, whole when gathered
    std::int64_t members = 0;                     ///< trainable parameters in it
    bool whole = false;                           ///< the root unit: never released
    std::string label = {};                       ///< "all-gather of unit ... (b/N)", for errors
  };

  /// `units`: their buffers (gathered, or released); `params[i]`: the storage's trainable
  /// parameter i, `member_of[i]` its unit and `at[i]` its first element in that unit's buffer;
  /// `local`: this rank's slices (its buffer lives as long as the storage).
  /// `prefetch`: gathers launched ahead (TrainerOptions::unit_prefetch); `reshard`: release
  /// after the forward (TrainerOptions::reshard_after_forward).
  UnitGathers(std::vector<Unit> units, std::vector<torch::Tensor> params, std::vector<std::int64_t> member_of,
               std::vector<std::int64_t> at, Replicas& replicas, Partition partition, torch::Tensor local,
               std::int64_t prefetch = 0, bool reshard = true)
      : units_(std::move(units)), params_(std::move(params)), member_of_(std::move(member_of)), at_(std::move(at)),
        replicas_(&replicas), partition_(std::move(partition)), local_(std::move(local)), waiting_(units_.size(), 0),
        pending_(units_.size()), next_forward_(units_.size(), -1), next_backward_(units_.size(), -1),
        called_(units_.size(), false), visited_(units_.size(), false), prefetch_(prefetch), reshard_(reshard) {
    for (size_t u = 0; u < units_.size(); ++u) {
      auto& unit = units_[u];
      unit.label = "all-gather of unit " + (unit.name.empty() ? std::string("(root)") : "'" + unit.name + "'") + " (" +
                   std::to_string(unit.bucket + 1) + "/" + std::to_string(partition_.buckets()) + ")";
      if (units_[u].module) modules_[units_[u].module] = static_cast<std::int64_t>(u);
      if (!units_[u].whole && gathered(static_cast<std::int64_t>(u))) now_ += units_[u].buffer.numel();
      // (fp32 whatever the units' dtype: master weights' half gradients are summed in fp32)
      grads_.push_back(torch::empty({units_[u].buffer.numel()}, units_[u].buffer.options().dtype(torch::kFloat)));
      release_storage(grads_.back());
    }
    peak_ = now_;
  }

  std::int64_t unit_of(const torch::nn::Module& module) const override {
    const auto it = modules_.find(&module);
    return it == modules_.end() ? -1 : it->second;
  }
  /// The trainer's forward starts: the units it calls are its order, recorded anew. A gather
  /// still launched ahead (a forward that ended without its backward) is dropped.
  void begin_forward() {
    if (evaluating_)
      throw std::logic_error("trainkit: a micro-step inside an evaluation by unit (evaluate_by_unit(true)); call "
                             "evaluate_by_unit(false) on every rank first");
    drop_pending();
    called_.assign(units_.size(), false);
    kept_ = last_forward_;  // (the previous forward's last unit: its backward's first)
    last_forward_ = -1;
    backward_ = false;
  }
  void before_forward(std::int64_t u) override {
    if (evaluating_) {  // (outside the step: its buffer, announced unless followed, gathered; released after its call)
      // (reserved first: a rank out of memory there has neither announced nor followed u, and
      // joins the others)
      reserve(u);
      order_.call(u, [&](std::int64_t owed) { gather_for_others(owed); },
                  [&](std::int64_t unit, double key) { return announce(unit, key); });
      gather(u, /*again=*/true);
      ++inside_[static_cast<size_t>(u)];
      return;
    }
    gather(u);
    if (held_ || backward_) return;  // (a recomputation in the backward: not the forward's order)
    called_[static_cast<size_t>(u)] = true;
    if (last_forward_ >= 0) next_forward_[static_cast<size_t>(last_forward_)] = u;
    last_forward_ = u;
    prefetch_after(u, next_forward_, called_);
  }
  // In the backward (tk::recompute around the unit) the unit stays: its backward follows. The
  // unit the previous forward ended with stays too (FSDP2 keeps its root so): the backward
  // starts with it, and its gather there would be exposed. Every rank keeps the same one (the
  // order is shared); where the order changes, the kept unit is released by the backward.
  void after_forward(std::int64_t u) override {
    if (evaluating_) {
      if (--inside_[static_cast<size_t>(u)] == 0) release(u);  // (called inside its own call: the outer's)
      return;
    }
    if (reshard_ && !backward_ && u != kept_) release(u);
  }
  // The unit the backward reached before this one is done (a unit's backward ends before the
  // gradient leaves its inputs): its reduce-scatter starts here, before this gather. The
  // backward's gathers come in the same order on every rank, so the reduce-scatters do too,
  // interleaved with them alike, whichever parameters got a gradient on which rank.
  void before_backward(std::int64_t u) override {
    if (reduction_ != nullptr && !reached_[static_cast<size_t>(u)]) {
      if (previous_ >= 0 && !launched_[static_cast<size_t>(previous_)]) {
        launch(previous_);
        release(previous_);  // (its backward is done: a parameter that got no gradient keeps it no longer)
      }
      reached_[static_cast<size_t>(u)] = true;
      previous_ = u;
    }
    gather(u);
    if (held_ || !backward_) return;
    if (last_backward_ >= 0 && last_backward_ != u) next_backward_[static_cast<size_t>(last_backward_)] = u;
    last_backward_ = u;
    visited_[static_cast<size_t>(u)] = true;
    if (reshard_) prefetch_after(u, next_backward_, visited_);  // (kept: every unit is gathered still)
  }

  /// A backward starts: every unit's parameters' gradients are to come. `reduction`: where
  /// the units' gradients go as the backward passes them (overlap), or null (after it).
  void arm(Reduction* reduction) {
    for (size_t u = 0; u < units_.size(); ++u) waiting_[u] = units_[u].members;
    fired_.assign(member_of_.size(), false);
    reduction_ = reduction;
    launched_.assign(units_.size(), false);
    reached_.assign(units_.size(), false);
    previous_ = -1;
    drop_pending();  // (gathered ahead for a forward call that did not come)
    backward_ = true;
    visited_.assign(units_.size(), false);
    last_backward_ = -1;
  }
  /// The reduction armed by arm() is finished or dropped.
  void disarm() { reduction_ = nullptr; }
  /// Buckets launched during the armed backward.
  std::int64_t launched() const {
    return static_cast<std::int64_t>(std::count(launched_.begin(), launched_.end(), true));
  }
  /// Buckets launched during a backward, before its end, since construction.
  std::int64_t overlapped() const { return overlapped_; }
  /// Parameter i's gradient is accumulated into `param`'s .grad (the autograd engine's thread):
  /// it moves into its unit's gradient buffer.
  void ready(size_t i, const torch::Tensor& param) override {
    const auto u = member_of_[i];
    if (fired_.size() != member_of_.size())
      throw std::logic_error("trainkit: parameter of unit '" + units_[static_cast<size_t>(u)].name + "' received a "
                             "gradient from a backward outside the trainer's micro_step; with ZeRO stage 3 the "
                             "trainer takes every gradient itself");
    if (backward_ && !held_ && !visited_[static_cast<size_t>(u)] && !units_[static_cast<size_t>(u)].whole)
      throw std::logic_error(
          "trainkit: a parameter of unit '" + units_[static_cast<size_t>(u)].name + "' received a gradient, but the "
          "backward never reached the unit through tk::unit: the unit was called without it (or one of its "
          "parameters was used outside its call), so the forward read its parameters while they were released or "
          "still being gathered. " + call_through_unit());
    if (auto& g = param.mutable_grad(); g.defined() && g.numel() > 0) {
      if (reduction_ != nullptr && launched_[static_cast<size_t>(u)])
        throw std::runtime_error(
            "trainkit: a parameter of unit '" + units_[static_cast<size_t>(u)].name + "' received its gradient after "
            "the backward had reached another unit, when the unit's reduce-scatter had started (ZeRO stage 3 reduces "
            "each unit as the backward leaves it): is one of its outputs used past the next unit (a skip connection "
            "across units), the unit called more than once in a step (shared weights), or a parameter used outside "
            "its unit's tk::unit call? Set TRAIN.OVERLAP_REDUCTION: false (TrainerOptions::overlap_reduction) to "
            "reduce after the backward (every unit's gradient is then held until the backward ends)");
      torch::NoGradGuard no_grad;
      gradient(u).narrow(0, at_[i], g.numel()).view(param.sizes()).add_(g);  // (dense or sparse)
      g = torch::Tensor();
    }
    if (fired_[i]) return;  // (a second accumulation: tk::recompute's reentrant backward)
    fired_[i] = true;
    if (--waiting_[static_cast<size_t>(u)] == 0) release(u);
  }
  /// Unit b's gradient (its bucket's), allocated (zeros) at its first use: for the unit's
  /// gradients as they come, and for its reduce-scatter (zeros where none came).
  torch::Tensor gradient(std::int64_t b) {
    auto& buffer = grads_[static_cast<size_t>(b)];
    if (is_released(buffer)) {
      allocate_released(buffer);
      grad_now_ += buffer.numel();
      grad_peak_ = std::max(grad_peak_, grad_now_);
    }
    return buffer;
  }
  /// Bucket b's reduce-scatter is complete: its gradient's memory goes.
  void gradient_done(std::int64_t b) {
    auto& buffer = grads_[static_cast<size_t>(b)];
    if (is_released(buffer)) return;
    release_storage(buffer);
    grad_now_ -= buffer.numel();
  }
  /// Every unit's gradient dropped (a failed micro-batch, a dropped window), and the
  /// parameters' .grad with it.
  void drop_gradients() {
    for (std::int64_t b = 0; b < static_cast<std::int64_t>(grads_.size()); ++b) gradient_done(b);
    for (const auto& p : params_) p.mutable_grad() = torch::Tensor();
  }
  /// After a backward, or before the update: only the root unit stays gathered.
  void release_all() {
    fired_.clear();
    backward_ = false;
    std::exception_ptr failed;  // (a failed wait: every other unit is released all the same)
    for (size_t u = 0; u < units_.size(); ++u) {
      try {
        release(static_cast<std::int64_t>(u));
      } catch (...) {
        if (!failed) failed = std::current_exception();
      }
    }
    if (failed) std::rethrow_exception(failed);
  }
  /// Every gather launched ahead complete (before this rank's slices, their input, are
  /// written: the update, a load).
  void settle_all() {
    for (size_t u = 0; u < units_.size(); ++u) settle(static_cast<std::int64_t>(u));
  }
  /// The root unit gathered again from every rank's slices (after an update or a load); the
  /// others released.
  void refresh() {
    release_all();
    for (size_t u = 0; u < units_.size(); ++u)
      if (units_[u].whole || held_) {  // (held: every unit, with its new values)
        drop_buffer(static_cast<std::int64_t>(u));  // (release_all settled every gather)
        gather(static_cast<std::int64_t>(u));
      }
  }
  /// Whether the units are held gathered (hold()): a unit called outside a step needs it.
  /// Every unit gathered (one all-gather each, in unit order: every rank calls it) and kept so
  /// until release_held(): a region whose forwards differ in number between the ranks
  /// (validation over uneven shards) then makes no collective.
  void hold() {
    if (evaluating_)  // (its gathers would meet the announcements of an evaluation by unit)
      throw std::logic_error("trainkit: hold_parameters(true) inside an evaluation by unit (evaluate_by_unit(true)); "
                             "call evaluate_by_unit(false) on every rank first");
    for (size_t u = 0; u < units_.size(); ++u) gather(static_cast<std::int64_t>(u));
    held_ = true;
  }
  void release_held() {
    held_ = false;
    release_all();
  }
  bool held() const override { return held_; }
  /// An evaluation by unit: until end_evaluation(), a unit's call outside the step gathers it
  /// and releases it after its call, so that a rank holds one unit (and the root unit) at a
  /// time. Before such a gather every rank says which unit it gathers (one small all-reduce):
  /// the ranks still evaluating call the same unit, or each throws, naming both. Once per
  /// batch: the units that follow the batch's first one, in the order learnt from the first
  /// batch and agreed, are gathered unannounced (EvaluationOrder, storage/evaluation_order.hpp).
  /// No collective here.
  void begin_evaluation() {
    if (held_)
      throw std::logic_error("trainkit: an evaluation by unit while every unit is held gathered "
                             "(hold_parameters(true)); call hold_parameters(false) on every rank first");
    drop_pending();
    order_.reset();
    inside_.assign(units_.size(), 0);
    evaluation_thread_ = std::this_thread::get_id();
    evaluating_ = true;
  }
  /// The evaluation's end on this rank (a collective): join_evaluation(), then unit calls
  /// outside the step are refused again.
  void end_evaluation() {
    if (!evaluating_) return;
    struct Ends {  // (closed even when the join fails: later micro-steps are not refused)
      UnitGathers& gathers;
      ~Ends() {
        gathers.evaluating_ = false;
        // Every unit released, as every rank has it after a step: a unit this rank reserved
        // for a call whose announcement threw (UnitsDiffer), or left by any other exception,
        // would stay gathered on this rank alone, and its next gather make no collective here.
        for (std::int64_t u = 0; u < static_cast<std::int64_t>(gathers.units_.size()); ++u) {
          try {
            if (!gathers.units_[static_cast<size_t>(u)].whole) gathers.drop_buffer(u);
          } catch (const std::exception&) {  // (a device error: its next use says it)
          }
        }
      }
    } ends{*this};
    join_evaluation();
  }
  /// A rank whose forwards are done (at the evaluation's end, or before a collective of the
  /// task's own: the mode hands the gathers to its replicas as a Joinable, and all_reduce joins
  /// them first) gathers with the ranks still evaluating, unit by unit as they announce them,
  /// until every rank has come to such a point (PyTorch's Join): the ranks' shards of the
  /// validation set may hold different numbers of batches. A collective.
  /// Only on the thread that opened the evaluation (another thread's collective is not its).
  void join_evaluation() {
    if (!evaluating_ || std::this_thread::get_id() != evaluation_thread_) return;
    order_.join([&](std::int64_t u) { gather_for_others(u); },
                [&](std::int64_t u, double key) { return announce(u, key); });
  }
  void join() override { join_evaluation(); }
  bool evaluating() const override { return evaluating_; }
  /// The storage is gone: later calls (a graph outliving it) throw. A gather still in flight
  /// is waited for first (it writes into a buffer that goes with the storage).
  void close() {
    for (std::int64_t u = 0; u < static_cast<std::int64_t>(pending_.size()); ++u) {
      try {
        settle(u);
      } catch (const std::exception&) {  // (the group's failure was said where it happened)
      }
    }
    replicas_ = nullptr;
  }

  const std::vector<Unit>& units() const { return units_; }
  /// Appends every buffer of the units (their parameters, their gradients) to `out`, for
  /// Trainer::held_bytes.
  void held_tensors(std::vector<torch::Tensor>& out) const {
    for (const auto& u : units_) out.push_back(u.buffer);
    out.insert(out.end(), grads_.begin(), grads_.end());
  }
  /// All-gathers of units since construction.
  std::int64_t gathers() const { return gathers_; }
  /// The most elements gathered at once outside the root unit, since construction.
  std::int64_t peak_gathered() const { return peak_; }
  /// The most gradient elements held at once (every unit's buffer counted while allocated).
  std::int64_t peak_gradient() const { return grad_peak_; }
  /// Gathers launched ahead (prefetch), since construction; of them, in backwards.
  std::int64_t gathers_ahead() const { return ahead_; }
  std::int64_t gathers_ahead_in_backward() const { return ahead_backward_; }
  /// An evaluation by unit's announcements (each a small all-reduce and a host sync) since
  /// construction.
  std::int64_t announcements() const { return announcements_; }
  /// Seconds the host spent in gathers, waiting for them or making them (on a GPU the waits
  /// only order streams: there it is launch time), since construction.
  double gather_seconds() const { return gather_seconds_; }

 private:
  bool gathered(std::int64_t u) const { return !is_released(units_[static_cast<size_t>(u)].buffer); }

 public:
  /// The unit whose buffer `storage` is (-1: none; the root unit, never released, included).
  std::int64_t unit_of_storage(const c10::StorageImpl* storage) const {
    for (size_t u = 0; u < units_.size(); ++u)
      if (units_[u].buffer.storage().unsafeGetStorageImpl() == storage) return static_cast<std::int64_t>(u);
    return -1;
  }
  const std::string& unit_name(std::int64_t u) const { return units_[static_cast<size_t>(u)].name; }
  /// A released unit's buffer allocated (zeros) outside the schedule, and released again: what
  /// ReleasedUseGuard (storage/released_use.hpp) does around an operator that reads a released
  /// parameter, before it throws. The schedule's own counts are not touched.
  void allocate_unit_buffer(std::int64_t u) const {
    const auto& buffer = units_[static_cast<size_t>(u)].buffer;
    if (is_released(buffer)) allocate_released(buffer);
  }
  void release_unit_buffer(std::int64_t u) const {
    const auto& buffer = units_[static_cast<size_t>(u)].buffer;
    if (!is_released(buffer)) release_storage(buffer);
  }

  /// Units named for a message: "'a', 'b' and 'c'" (`last`: " and " or " or ").
  std::string units_text(const std::vector<std::int64_t>& us, const char* last) const {
    std::string text;
    for (size_t i = 0; i < us.size(); ++i)
      text += (i == 0 ? "" : i + 1 == us.size() ? last : ", ") + ("'" + unit_name(us[i]) + "'");
    return text;
  }
  /// How every message about a unit's parameters used outside its tk::unit call ends.
  static std::string call_through_unit() {
    return "Call the unit's module as `x = tk::unit(module, x)` (trainkit/trainer/unit.hpp), and use its parameters "
           "only inside that call (a weight shared with another module belongs to the same unit)";
  }

  /// What to say for a refused view of a released parameter (storage/released_use.hpp).
  friend std::string released_use(const UnitGathers& gathers, const std::string& error);

 private:
  // An evaluation by unit: this rank's next unit u (-1: its evaluation is done) said to every
  // rank, with its EvaluationOrder's `key`. Returns the unit the ranks still evaluating gather
  // (-1 when none is left) and the keys' range; throws on every rank alike when those ranks name
  // different units.
  EvaluationOrder::Agreed announce(std::int64_t u, double key) {
    if (!replicas_)
      throw std::logic_error("tk::unit: a unit evaluated after its trainer is gone; its parameters were sharded "
                             "(ZeRO stage 3) and exist no more in this process");
    // The largest unit named and, negated, the smallest: equal when every evaluating rank
    // names the same one (a rank done names none). Then the largest key and, negated, the
    // smallest (whether the ranks know the same batch).
    std::vector<double> said{static_cast<double>(u), u >= 0 ? -static_cast<double>(u) : -1e18, key, -key};
    replicas_->all_reduce_while_joining(said, Reduce::max);  // (no join inside this rank's own announcement)
    ++announcements_;
    if (said[0] < 0) return {};
    const auto first = static_cast<std::int64_t>(said[0]), second = static_cast<std::int64_t>(-said[1]);
    if (first != second) {
      const auto name = [&](std::int64_t v) { return "'" + units_[static_cast<size_t>(v)].name + "'"; };
      throw UnitsDiffer("tk::unit: in an evaluation by unit (ZeRO stage 3) the ranks called different units "
                               "at once (units " + name(second) + " and " + name(first) + "): their forwards must "
                               "call the model's units in one order; for a model whose units depend on its input, "
                               "hold every unit (AnyTrainer::hold_parameters(true)) around the evaluation instead");
    }
    return {first, -said[3], said[2]};
  }
  // Unit u gathered with the ranks that call it while this rank does not (a rank done, or the
  // rest of a batch this rank left), and released after, unless this rank is inside its call.
  void gather_for_others(std::int64_t u) {
    gather(u, /*again=*/true);
    if (inside_[static_cast<size_t>(u)] == 0) release(u);
  }
  // Unit u's buffer allocated where released (its contents undefined until gathered). An
  // evaluation by unit reserves before its announcement, so that a rank that runs out of memory
  // there has announced nothing and joins the others.
  void reserve(std::int64_t u) {
    auto& unit = units_[static_cast<size_t>(u)];
    if (gathered(u)) return;
    allocate_released(unit.buffer, /*zero=*/false);
    if (!unit.whole) now_ += unit.buffer.numel();
    peak_ = std::max(peak_, now_);
  }
  // Unit u's parameters whole: its gather launched ahead waited for, or made now. `again`: made
  // now even where gathered already (an evaluation by unit: every rank gathers each announced
  // unit alike, also a unit called inside its own call).
  void gather(std::int64_t u, bool again = false) {
    if (!again && !pending_[static_cast<size_t>(u)] && gathered(u)) return;  // (kept, held, or the root unit)
    const auto start = std::chrono::steady_clock::now();
    if (again) settle(u);
    if (!pending_[static_cast<size_t>(u)]) pending_[static_cast<size_t>(u)] = launch_gather(u);
    settle(u);
    gather_seconds_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  }
  // Unit u's all-gather started (its buffer allocated where released: a unit this rank still
  // holds is gathered into again, with the same values); returns its wait.
  std::function<void()> launch_gather(std::int64_t u) {
    auto& unit = units_[static_cast<size_t>(u)];
    if (!replicas_)
      throw std::logic_error("tk::unit: unit '" + unit.name + "' belongs to a trainer that is gone; its parameters "
                             "were sharded (ZeRO stage 3) and exist no more in this process");
    const bool allocated = !gathered(u);
    reserve(u);
    const auto b = unit.bucket;
    const auto n = partition_.bucket(b).length / partition_.world_size();
    try {
      auto wait = replicas_->start_gather_bucket(local_.narrow(0, partition_.local(b), n), unit.buffer, unit.label);
      ++gathers_;
      return wait;
    } catch (...) {
      if (allocated) drop_buffer(u);  // (never counted as gathered with nothing in it)
      throw;
    }
  }
  // The `prefetch_` units after u in `next` (the forward's or the backward's order) launched,
  // except those `done` in this pass (called or reached already) or launched already. The
  // decision reads only what every rank shares (the order, `done`, the launches), never
  // whether this rank still holds a unit, so every rank launches the same gathers. A gather
  // launched ahead that u's successors no longer name (the order changed) is dropped.
  void prefetch_after(std::int64_t u, const std::vector<std::int64_t>& next, const std::vector<bool>& done) {
    std::vector<bool>& wanted = wanted_;  // (a member: no allocation per call)
    wanted.assign(units_.size(), false);
    for (std::int64_t k = 0, v = next[static_cast<size_t>(u)]; k < prefetch_ && v >= 0 && v != u && !done[static_cast<size_t>(v)];
         ++k, v = next[static_cast<size_t>(v)]) {
      wanted[static_cast<size_t>(v)] = true;
      if (pending_[static_cast<size_t>(v)]) continue;
      pending_[static_cast<size_t>(v)] = launch_gather(v);
      ++ahead_;
      if (backward_) ++ahead_backward_;
    }
    for (size_t w = 0; w < units_.size(); ++w)
      if (pending_[w] && !wanted[w]) release(static_cast<std::int64_t>(w));
  }
  // Every gather launched ahead complete and its unit released (a pass that did not call it).
  void drop_pending() {
    for (size_t w = 0; w < units_.size(); ++w)
      if (pending_[w]) release(static_cast<std::int64_t>(w));
  }
  // Unit u's gather launched ahead, if any, complete. After a failed wait the buffer holds no
  // unit, and the collective may still write it: its memory goes to the replicas, kept until
  // the communicator is gone (Replicas::keep_after_failure), before the error goes on.
  void settle(std::int64_t u) {
    auto wait = std::exchange(pending_[static_cast<size_t>(u)], nullptr);
    if (!wait) return;
    try {
      wait();
    } catch (...) {
      const auto& unit = units_[static_cast<size_t>(u)];
      if (gathered(u)) {
        const auto bytes = unit.buffer.numel() * static_cast<std::int64_t>(unit.buffer.element_size());
        replicas_->keep_after_failure(take_storage(unit.buffer), bytes);
        if (!unit.whole) now_ -= unit.buffer.numel();
      }
      throw;
    }
  }
  void drop_buffer(std::int64_t u) {
    const auto& unit = units_[static_cast<size_t>(u)];
    if (!gathered(u)) return;
    release_storage(unit.buffer);
    if (!unit.whole) now_ -= unit.buffer.numel();
  }
  void release(std::int64_t u) {
    const auto& unit = units_[static_cast<size_t>(u)];
    settle(u);
    if (unit.whole || held_) return;
    drop_buffer(u);
  }
  void launch(std::int64_t b) {
    launched_[static_cast<size_t>(b)] = true;
    ++overlapped_;
    reduction_->launch(b);
  }

  std::vector<Unit> units_;  // (a unit is gathered while its buffer holds memory)
  std::vector<torch::Tensor> params_;
  std::vector<std::int64_t> member_of_, at_;
  Replicas* replicas_;
  Partition partition_;
  torch::Tensor local_;
  std::unordered_map<const torch::nn::Module*, std::int64_t> modules_;
  std::vector<std::int64_t> waiting_;
  std::vector<bool> fired_, launched_, reached_;
  Reduction* reduction_ = nullptr;
  std::int64_t previous_ = -1, overlapped_ = 0;
  std::vector<torch::Tensor> grads_;  // each unit's gradient, allocated from its first gradient to its reduction
  std::int64_t gathers_ = 0, now_ = 0, peak_ = 0, grad_now_ = 0, grad_peak_ = 0;
  bool held_ = false;
  // Prefetch: each unit's gather launched ahead (its wait), each unit's successor in the last
  // forward and backward (-1: none yet), the unit called last in each.
  std::vector<std::function<void()>> pending_;
  std::vector<std::int64_t> next_forward_, next_backward_;
  std::vector<bool> called_, visited_;  // units called in this forward, reached in this backward
  std::vector<bool> wanted_;            // prefetch_after's: the units its chain names
  std::int64_t prefetch_ = 0, last_forward_ = -1, last_backward_ = -1, ahead_ = 0, ahead_backward_ = 0;
  std::int64_t kept_ = -1;  // the unit after_forward keeps gathered into the backward (-1: none)
  bool reshard_ = true, backward_ = false;
  // An evaluation by unit is open (read by the replicas' all_reduce, from any thread that makes
  // one; joined only on the thread that opened it).
  std::atomic<bool> evaluating_{false};
  std::thread::id evaluation_thread_;
  EvaluationOrder order_{static_cast<std::int64_t>(units_.size())};  // (its announcements' batches)
  std::vector<std::int64_t> inside_;  // each unit's calls under way in the evaluation
  std::int64_t announcements_ = 0;
  double gather_seconds_ = 0;
};

}  // namespace trainkit::detail
