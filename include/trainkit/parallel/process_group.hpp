#pragma once
/// A process group on PyTorch's c10d, formed and diagnosed: Gloo for CPU tensors, NCCL for CUDA
/// ones. Data parallelism over it is tk::DataParallel (<trainkit/parallel/data_parallel.hpp>).
///
///   auto group = tk::ProcessGroup::create(tk::DistributedOptions().timeout_seconds(600), device);
///   group.rank(), group.world_size(), group.all_reduce(values, Reduce::sum, "what")
///
/// Where the ranks come from (DistributedOptions::rendezvous, `environment` by default):
///   torchrun   RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT. With
///              TORCHELASTIC_USE_AGENT_STORE=True (torchrun's default) the agent hosts the
///              TCPStore and every rank connects as a client; otherwise rank 0 hosts it.
///   slurm      SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID; the address from the options, else
///              MASTER_ADDR / MASTER_PORT; rank 0 hosts the store.
///   options    rank, world_size, local_rank, master_addr, master_port as given.
///   environment: torchrun's variables when RANK and WORLD_SIZE are set, else Slurm's when
///              SLURM_PROCID and SLURM_NTASKS are, else the options (by default one process).
/// One process (world size 1) runs the same code over an in-memory store.
///
/// Failures: every collective runs under the group's timeout (Gloo's own timeout; NCCL's
/// watchdog). A collective that fails throws tk::DistributedError on the surviving ranks,
/// naming what was being done and the ranks that did not answer a short roll call through the
/// store (the dead or hung ones), or saying that the store's host itself is gone. A heartbeat
/// through the store (DistributedOptions::heartbeat_seconds, 15 s by default) names a rank
/// that died or hangs within that time, on stderr; with NCCL, whose wait() does not fail on a
/// dead peer, it also aborts the communicator so that the survivors stop then, not at the
/// timeout. A rank that leaves with an error (an exception that unwinds its group, or
/// ProcessGroup::leave_with_error) says so through the heartbeat: its peers stop within a beat,
/// naming it and the error, where they would otherwise wait in a collective it never joins.
///
/// Build: PyTorch's wheel ships c10d's headers but not Gloo's, which ProcessGroupGloo.hpp
/// includes; any Gloo headers do (only declarations are used, the code is LibTorch's):
/// Debian's libgloo-dev, or third_party/gloo of a PyTorch source tree on the include path.
/// NCCL is used where LibTorch was built with it (USE_C10D_NCCL, defined by its CMake
/// package) and nccl.h is found.
#if !__has_include(<gloo/algorithm.h>)
#error "trainkit/parallel/process_group.hpp needs Gloo's headers (PyTorch's wheel does not ship them): install Debian's libgloo-dev, or put a PyTorch source tree's third_party/gloo on the include path"
#endif
#if !defined(USE_C10D_GLOO)
#error "trainkit/parallel/process_group.hpp: this LibTorch was built without Gloo (USE_C10D_GLOO is not defined by its CMake package); link the target `torch` from a distributed build"
#endif

#include <trainkit/detail/inline.hpp>
#include <trainkit/parallel/heartbeat.hpp>
#include <trainkit/step/replicas.hpp>

#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#if defined(USE_C10D_NCCL) && __has_include(<nccl.h>)
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>
#define TRAINKIT_HAVE_NCCL 1
#else
#define TRAINKIT_HAVE_NCCL 0
#endif

#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <torch/arg.h>
#include <torch/nn/module.h>
#include <torch/types.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <map>
#include <iostream>
#include <memory>
#include <mutex>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>
#include <vector>

namespace trainkit {

/// A collective or the rendezvous failed: a rank died or hangs, or the ranks disagree.
class DistributedError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

/// Where the ranks and the store's address come from (see the file comment).
enum class Rendezvous { environment, torchrun, slurm, options };

/// How to form the process group. Fluent setters; checked by validate().
struct DistributedOptions {
  TORCH_ARG(Rendezvous, rendezvous) = Rendezvous::environment;
  /// Rendezvous::options (and the default of `environment` without launcher variables).
  TORCH_ARG(int, rank) = 0;
  TORCH_ARG(int, world_size) = 1;
  TORCH_ARG(int, local_rank) = 0;
  /// The store's host and port; empty / 0: MASTER_ADDR / MASTER_PORT, else 127.0.0.1:29500
  /// (store_host(), store_port()).
  TORCH_ARG(std::string, master_addr) = "";
  TORCH_ARG(int, master_port) = 0;
  /// Seconds before a collective, the rendezvous or a store operation gives up (torch's
  /// default is 30 minutes).
  TORCH_ARG(double, timeout_seconds) = 1800.0;
  /// "" (by device: Gloo for the CPU, NCCL for CUDA), "gloo" or "nccl".
  TORCH_ARG(std::string, backend) = "";
  /// Seconds without a heartbeat (a thread per rank beats through the store) after which a
  /// rank counts as dead or hung: every other rank says which, and with NCCL aborts its
  /// communicator so that it stops at once rather than at the timeout. 0, or not below
  /// timeout_seconds: no heartbeat.
  TORCH_ARG(double, heartbeat_seconds) = 15.0;

 public:
  void validate() const;
  /// Where the store is: master_addr, else MASTER_ADDR, else 127.0.0.1 (and the port alike, 29500).
  std::string store_host() const;
  int store_port() const;
};

namespace detail {

const char* env(const char* name);

int env_int(const char* name, int fallback);

/// An exception's message without LibTorch's backtrace (c10::Error::what() appends one).
std::string message_of(const std::exception& e);

/// Seconds as a person writes them: "8", "0.5", "1800".
std::string seconds_text(double seconds);

std::string ranks_string(const std::vector<int>& ranks);

}  // namespace detail


/// Who this process is in the group, and how that was found out.
struct RankInfo {
  int rank = 0, world_size = 1, local_rank = 0;
  std::string launcher;  ///< "torchrun", "slurm", "options" or "single process"
  std::string store;     ///< "host:port (hosted by ...)", or "in memory"
};

/// A c10d process group: a store and one backend (Gloo or NCCL), with the rank's identity and a
/// timeout. A cheap handle: copies share the group.
class ProcessGroup {
 public:
  /// Forms the group from the environment or the options (see the file comment) for tensors
  /// on `device`: Gloo for the CPU, NCCL for CUDA. Blocks until every rank has joined or the
  /// timeout has passed.
  static ProcessGroup create(const DistributedOptions& options = {}, torch::Device device = torch::kCPU);

  /// Starts this rank's heartbeat (parallel/heartbeat.hpp; create() does, by
  /// DistributedOptions::heartbeat_seconds): a rank silent for `silence` is named on stderr
  /// and in the errors of later collectives, and NCCL's communicator is aborted.
  /// A store hosted by torchrun's agent that stops answering means the agent is gone (killed),
  /// while the ranks and their own connections live on: the ranks then stop by themselves
  /// (store_gone(): tk::fit stops at its next agreement, writing a checkpoint, as for SIGTERM)
  /// and NCCL's communicator is left alone for that.
  void start_heartbeat(std::chrono::milliseconds silence);

  /// Whether the group's store stopped answering the heartbeat (its host is gone: torchrun's
  /// agent killed, or rank 0). The ranks' own connections may still work: a training loop
  /// should stop at its next point where the ranks agree (tk::fit does, writing a checkpoint).
  bool store_gone() const { return state_->heartbeat && state_->heartbeat->store_gone(); }

  /// Tells the other ranks that this one leaves with an error (`reason`, its first line is
  /// sent): each says so on stderr, naming this rank, within a heartbeat period, and with NCCL
  /// aborts its communicator, so that ranks blocked in a collective this one will never join
  /// stop then, not at the timeout. The group does this by itself when it is destroyed while an
  /// exception unwinds the stack (an error that leaves main through it); call it where a rank
  /// gives up without unwinding. Without a heartbeat (world size 1, heartbeat_seconds 0) it
  /// does nothing.
  void leave_with_error(const std::string& reason);

  /// This group with `backend` in place of its own (a wrapper around it: one that counts the
  /// collectives): the same store, identity, timeout and device, and the same heartbeat (its
  /// store_gone() and the errors' "heartbeat:" part), which leaves when both groups are gone.
  ProcessGroup over(c10::intrusive_ptr<c10d::Backend> backend) const;

  /// From parts: a store, a backend built over it (e.g. a wrapper around another group's
  /// backend; over() keeps the heartbeat too), the identity and timeout.
  ProcessGroup(c10::intrusive_ptr<c10d::Store> store, c10::intrusive_ptr<c10d::Backend> backend, RankInfo info,
               std::chrono::milliseconds timeout, torch::Device device);

  /// Which rank this process would be, from the environment or the options, without joining.
  static RankInfo resolve(const DistributedOptions& options);

  int rank() const { return state_->info.rank; }
  int world_size() const { return state_->info.world_size; }
  int local_rank() const { return state_->info.local_rank; }
  bool is_main() const { return rank() == 0; }
  const RankInfo& info() const { return state_->info; }
  std::chrono::milliseconds timeout() const { return state_->timeout; }
  /// Where collectives run: the CPU (Gloo) or this rank's GPU (NCCL).
  torch::Device device() const { return state_->device; }
  const c10::intrusive_ptr<c10d::Backend>& backend() const { return state_->backend; }
  const c10::intrusive_ptr<c10d::Store>& store() const { return state_->store; }

  /// Starts an all-reduce of `tensor` (contiguous, on device()), in place.
  c10::intrusive_ptr<c10d::Work> start_all_reduce(const torch::Tensor& tensor,
                                                  c10d::ReduceOp op = c10d::ReduceOp::SUM) const;
  /// Waits for `work`; on failure throws DistributedError naming `what` and the silent ranks.
  void wait(const c10::intrusive_ptr<c10d::Work>& work, const std::string& what) const;
  void all_reduce(const torch::Tensor& tensor, const std::string& what,
                  c10d::ReduceOp op = c10d::ReduceOp::SUM) const;
  /// Rank `root`'s `tensor` (contiguous, on device()) to every rank, in place.
  void broadcast(const torch::Tensor& tensor, const std::string& what, int root = 0) const;
  /// A few host scalars combined over the ranks, in place: one collective and one copy back
  /// (a mean is the sum divided on the host). Every rank calls it alike.
  void all_reduce(std::vector<double>& values, Reduce op, const std::string& what) const;

  /// Memory that a collective of this group which failed may still write (a unit's gather
  /// whose wait threw: on NCCL its kernel can run on until the communicator is aborted), kept,
  /// never reused, until this group's state goes, after its backend.
  void keep_after_failure(c10::DataPtr memory, std::int64_t bytes) const {
    const std::lock_guard<std::mutex> lock(state_->kept.mutex);
    state_->kept.memory.push_back(std::move(memory));
    state_->kept.bytes += bytes;
  }
  std::int64_t kept_after_failure() const {
    const std::lock_guard<std::mutex> lock(state_->kept.mutex);
    return state_->kept.bytes;
  }

  /// Throws DistributedError for a failed `what`: rank and peers, and which ranks do not answer
  /// a roll call through the store within a few seconds (they died or hang).
  [[noreturn]] void fail(const std::string& what, const std::string& error) const;

 private:
  // Memory that a failed collective may still write (keep_after_failure).
  struct Kept {
    std::mutex mutex;
    std::vector<c10::DataPtr> memory;
    std::int64_t bytes = 0;
  };
  struct State {
    Kept kept;  // first: freed after the backend is released (its communicator torn down with its last reference)
    c10::intrusive_ptr<c10d::Store> store;
    c10::intrusive_ptr<c10d::Backend> backend;
    RankInfo info;
    std::chrono::milliseconds timeout;
    torch::Device device;
    std::shared_ptr<detail::Heartbeat> heartbeat;  // last: stopped before the rest goes (shared by over())
  };
  std::shared_ptr<State> state_;
};

}  // namespace trainkit

#if !defined(TRAINKIT_COMPILED_LIB) || !defined(TRAINKIT_COMPILED_PARALLEL)
#include <trainkit/parallel/process_group-inl.hpp>
#endif
