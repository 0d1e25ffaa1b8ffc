#pragma once
/// Where a configured run trains: its device (GPUS and the launcher's LOCAL_RANK) and, when the
/// launcher started more than one process (torchrun, srun), its data-parallel process group.
///
///   tk::Launch launch = tk::Launch::from_config(config);    // resolves ranks, device, group
///   for (const auto& note : launch.notes()) if (launch.is_main()) std::cerr << note << "\n";
///   const tk::RunPlan plan = tk::RunPlan::from(config, launch);        // its world size, one seed on every rank
///   model->to(launch.device());                               // before the trainer is built
///   auto trainer = tk::make_trainer(plan, model);
///   launch.attach(*trainer);                                  // DataParallel when world > 1
///   task.batch = [&](epoch, index) { return my_batch(sampler.batch(epoch, index)).to(launch.device()); };
///
/// GPUS (docs/config-reference.md) against the launch:
///   ''          the CPU when this machine has no CUDA device (said once, in notes()), else the
///               local rank's GPU (cuda:LOCAL_RANK).
///   '0,1,2,3'   one device per process on this node: local rank i trains on cuda:GPUS[i]. The
///               list's length must equal the processes per node (torchrun --nproc-per-node;
///               1 without a launcher), every id must exist, and ids must not repeat; a machine
///               without CUDA refuses any id. Each is a ConfigError naming GPUS.
/// The world size is the launcher's (RANK/WORLD_SIZE, or Slurm's); the LR is scaled by it
/// (make_trainer's world_size). Collectives run on Gloo for the CPU and NCCL for CUDA, under
/// DIST_TIMEOUT seconds (a dead or hung rank makes the others fail within it).
#include <trainkit/trainer/any_trainer.hpp>
#include <trainkit/config/config.hpp>
#include <trainkit/parallel/data_parallel.hpp>
#include <trainkit/run/plan.hpp>

#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <torch/cuda.h>
#include <torch/types.h>

#include <chrono>
#include <future>
#include <cstdint>
#include <cstdlib>
#include <iostream>
#include <memory>
#include <optional>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <vector>

namespace trainkit {

/// Where one process trains, and what the user should be told about the choice.
struct DeviceChoice {
  torch::Device device = torch::kCPU;
  std::string note;  ///< empty, or a line to print once (e.g. "training on the CPU")
};

/// Processes on this node: torchrun's LOCAL_WORLD_SIZE, Slurm's SLURM_NTASKS_PER_NODE (its
/// leading number), else the world size (one node).
inline int local_world_size(const RankInfo& info) {
  if (info.launcher == "torchrun" && detail::env("LOCAL_WORLD_SIZE")) return detail::env_int("LOCAL_WORLD_SIZE", info.world_size);
  if (info.launcher == "slurm") {
    if (const char* v = detail::env("SLURM_NTASKS_PER_NODE")) {
      const long n = std::strtol(v, nullptr, 10);
      if (n > 0) return static_cast<int>(n);
    }
  }
  return info.world_size;
}

/// The device of local rank `local_rank` of `local_world` processes on a node with
/// `cuda_devices` CUDA devices, from GPUS (see the file comment). Pure: tested without a GPU.
inline DeviceChoice choose_device(const std::string& gpus, int local_rank, int local_world, std::int64_t cuda_devices) {
  const auto listed = detail::device_list(gpus);
  if (!listed) throw ConfigError("GPUS", "expected device numbers separated by commas such as '0,1,2,3', got '" + gpus + "'");
  const std::vector<int>& ids = *listed;
  const std::string processes = std::to_string(local_world) + (local_world == 1 ? " process" : " processes");
  if (ids.empty()) {
    if (cuda_devices == 0)
      return {torch::kCPU, "GPUS is empty and this machine has no CUDA device: training on the CPU" +
                               std::string(local_world > 1 ? " (Gloo between the ranks)" : "")};
    if (local_rank >= cuda_devices)
      throw ConfigError("GPUS", "is empty, so local rank " + std::to_string(local_rank) + " would train on cuda:" +
                                    std::to_string(local_rank) + ", but this machine has " + std::to_string(cuda_devices) +
                                    " CUDA device(s); launch at most " + std::to_string(cuda_devices) + " processes per node");
    return {torch::Device(torch::kCUDA, static_cast<c10::DeviceIndex>(local_rank)), ""};
  }
  if (cuda_devices == 0)
    throw ConfigError("GPUS", "lists CUDA device(s) '" + gpus + "', but this machine has no CUDA device (torch::cuda::is_available() "
                                                                "is false); set GPUS: '' to train on the CPU");
  if (static_cast<int>(ids.size()) != local_world)
    throw ConfigError("GPUS", "lists " + std::to_string(ids.size()) + " device(s) ('" + gpus + "'), but this launch runs " +
                                  processes + " on this node: one process per device, so launch with `torchrun --nproc-per-node " +
                                  std::to_string(ids.size()) + " ...`" +
                                  (local_world > 1 ? " or list " + std::to_string(local_world) + " devices" : std::string()));
  std::set<int> seen;
  for (int id : ids) {
    if (id >= cuda_devices)
      throw ConfigError("GPUS", "names cuda:" + std::to_string(id) + " ('" + gpus + "'), but this machine has " +
                                    std::to_string(cuda_devices) + " CUDA device(s), cuda:0 to cuda:" + std::to_string(cuda_devices - 1));
    if (!seen.insert(id).second)
      throw ConfigError("GPUS", "names cuda:" + std::to_string(id) + " twice ('" + gpus + "'); each process needs its own device");
  }
  return {torch::Device(torch::kCUDA, static_cast<c10::DeviceIndex>(ids[static_cast<std::size_t>(local_rank)])), ""};
}

namespace detail {

/// `join()`, or DistributedError(`message`) when it has not returned after `seconds`. c10d's
/// store client waits without a deadline for an answer from a port that accepts connections
/// but is not a store, and nothing can interrupt that wait: the join runs on a thread of its
/// own, which is left behind (detached, blocked in the socket) when the deadline passes, so the
/// caller gets an error it can report instead of a process that hangs. The library never ends
/// the process itself.
template <class Join>
auto within(double seconds, const std::string& message, Join&& join) -> decltype(join()) {
  using Result = decltype(join());
  auto done = std::make_shared<std::promise<Result>>();
  std::future<Result> result = done->get_future();
  std::thread([done, join = std::forward<Join>(join)]() mutable {
    try {
      done->set_value(join());
    } catch (...) {
      done->set_exception(std::current_exception());
    }
  }).detach();
  if (result.wait_for(std::chrono::duration<double>(seconds)) != std::future_status::ready)
    throw DistributedError(message);
  return result.get();
}

}  // namespace detail

/// This process's place in the run: rank, device and (world size > 1) the process group.
class Launch {
 public:
  /// From a validated configuration and the launcher's environment; joins the process group
  /// when there is more than one process (blocks until every rank has joined, or DIST_TIMEOUT).
  static Launch from_config(const Config& config) {
    const double timeout = config.tree()["DIST_TIMEOUT"].get<double>();
    const RankInfo info = ProcessGroup::resolve(DistributedOptions().timeout_seconds(timeout));
    const int local_world = local_world_size(info);
    if (info.local_rank < 0 || info.local_rank >= local_world)
      throw DistributedError("trainkit: " + info.launcher + " gives local rank " + std::to_string(info.local_rank) + " of " +
                             std::to_string(local_world) + " processes on this node");
    const std::int64_t cuda = torch::cuda::is_available() ? static_cast<std::int64_t>(torch::cuda::device_count()) : 0;
    const DeviceChoice choice = choose_device(config.tree()["GPUS"].get<std::string>(), info.local_rank, local_world, cuda);
    Launch l;
    l.info_ = info;
    l.device_ = choice.device;
    if (!choice.note.empty()) l.notes_.push_back(choice.note);
    if (l.device_.is_cuda()) {
      // kCUDA without an index (and NCCL's communicator) then mean this rank's GPU.
      c10::impl::getDeviceGuardImpl(c10::kCUDA)->setDevice(l.device_);
    }
    if (info.world_size > 1) {
      const DistributedOptions where;
      const std::string store = where.store_host() + ":" + std::to_string(where.store_port());
      const double heartbeat = config.tree()["DIST_HEARTBEAT"].get<double>();
      if (heartbeat > 0 && heartbeat >= timeout)
        l.notes_.push_back("DIST_HEARTBEAT " + detail::seconds_text(heartbeat) + " s is not below DIST_TIMEOUT " +
                           detail::seconds_text(timeout) + " s: no heartbeat (a silent rank is named at the timeout)");
      const auto options = DistributedOptions().timeout_seconds(timeout).heartbeat_seconds(heartbeat);
      const double bound = 2 * timeout + 10;
      l.group_ = detail::within(bound,
                                "trainkit: rank " + std::to_string(info.rank) + " of " + std::to_string(info.world_size) +
                                    ": joining the process group at " + store + " took more than " + detail::seconds_text(bound) +
                                    " s (DIST_TIMEOUT " + detail::seconds_text(timeout) + "): something answers on that port "
                                    "but no store does (another program holds MASTER_PORT?); choose another port",
                                [options, device = l.device_] { return ProcessGroup::create(options, device); });
      l.replicas_ = std::make_shared<DataParallel>(*l.group_);
      l.notes_.push_back("data parallel: " + std::to_string(info.world_size) + " processes (" + info.launcher + ", " +
                         l.group_->backend()->getBackendName() + ", store " + l.group_->info().store + "), rank " +
                         std::to_string(info.rank) + " on " + l.device_.str());
    }
    return l;
  }

  /// One process on `device` (tests, programs that place themselves).
  static Launch single(torch::Device device = torch::kCPU) {
    Launch l;
    l.device_ = device;
    return l;
  }

  torch::Device device() const { return device_; }
  int rank() const { return info_.rank; }
  int world_size() const { return info_.world_size; }
  bool is_main() const { return info_.rank == 0; }
  const RankInfo& info() const { return info_; }
  /// The group when world_size() > 1.
  const std::optional<ProcessGroup>& group() const { return group_; }
  /// The ranks as Replicas (DataParallel over the group, or SingleProcess): all_reduce() of a
  /// few host values (counts, peaks) for the application; the trainer's after attach().
  Replicas& replicas() const { return *replicas_; }
  /// What to tell the user once (the main rank prints them).
  const std::vector<std::string>& notes() const { return notes_; }

  /// Makes `trainer` data-parallel over the group (rank 0's weights to every rank); nothing
  /// with one process. Call after the model is on device() and before training or load().
  void attach(AnyTrainer& trainer) const {
    if (group_) trainer.set_replicas(replicas_);
  }

  /// Rank 0's `value` on every rank (a seed drawn on one rank).
  std::int64_t agree(std::int64_t value) const {
    if (!group_) return value;
    auto t = torch::full({1}, value, torch::dtype(torch::kLong).device(group_->device()));
    group_->broadcast(t, "agreeing on a value of rank 0");
    return t.cpu().item<std::int64_t>();
  }

 private:
  RankInfo info_{0, 1, 0, "single process", "in memory"};
  torch::Device device_ = torch::kCPU;
  std::optional<ProcessGroup> group_;
  std::shared_ptr<Replicas> replicas_ = std::make_shared<SingleProcess>();
  std::vector<std::string> notes_;
};

inline RunPlan RunPlan::from(const Config& config, const Launch& launch) {
  std::optional<std::int64_t> seed;
  if (launch.world_size() > 1) seed = launch.agree(static_cast<std::int64_t>(std::random_device{}() & 0x7fffffff));
  return RunPlan::from(config, launch.world_size(), seed);
}

}  // namespace trainkit
