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
  void validate() const {
    auto fail = [](const std::string& what) {
      throw std::invalid_argument("trainkit::DistributedOptions: " + what);
    };
    if (world_size_ < 1) fail("world_size must be >= 1, got " + std::to_string(world_size_));
    if (rank_ < 0 || rank_ >= world_size_)
      fail("rank must be in [0, world_size), got " + std::to_string(rank_) + " of " +
           std::to_string(world_size_));
    if (master_port_ < 0 || master_port_ > 65535)
      fail("master_port must be in [0, 65535], got " + std::to_string(master_port_));
    if (!(timeout_seconds_ > 0) || !std::isfinite(timeout_seconds_))
      fail("timeout_seconds must be finite and > 0, got " + std::to_string(timeout_seconds_));
    if (!(heartbeat_seconds_ >= 0) || !std::isfinite(heartbeat_seconds_))
      fail("heartbeat_seconds must be finite and >= 0 (0: off), got " + std::to_string(heartbeat_seconds_));
    if (!backend_.empty() && backend_ != "gloo" && backend_ != "nccl")
      fail("backend must be \"\", \"gloo\" or \"nccl\", got \"" + backend_ + "\"");
  }
  /// Where the store is: master_addr, else MASTER_ADDR, else 127.0.0.1 (and the port alike, 29500).
  std::string store_host() const;
  int store_port() const;
};

namespace detail {

inline const char* env(const char* name) {
  const char* v = std::getenv(name);
  return v != nullptr && *v != '\0' ? v : nullptr;
}

inline int env_int(const char* name, int fallback) {
  const char* v = env(name);
  if (v == nullptr) return fallback;
  char* end = nullptr;
  const long value = std::strtol(v, &end, 10);
  if (end == v || *end != '\0')
    throw DistributedError(std::string("trainkit: environment variable ") + name +
                           " must be an integer, got \"" + v + "\"");
  return static_cast<int>(value);
}

/// An exception's message without LibTorch's backtrace (c10::Error::what() appends one).
inline std::string message_of(const std::exception& e) {
  if (const auto* c10_error = dynamic_cast<const c10::Error*>(&e)) return c10_error->what_without_backtrace();
  return e.what();
}

/// Seconds as a person writes them: "8", "0.5", "1800".
inline std::string seconds_text(double seconds) {
  std::ostringstream s;
  s << seconds;
  return s.str();
}

inline std::string ranks_string(const std::vector<int>& ranks) {
  std::string s;
  for (size_t i = 0; i < ranks.size(); ++i) s += (i ? ", " : "") + std::to_string(ranks[i]);
  return s;
}

}  // namespace detail

inline std::string DistributedOptions::store_host() const {
  if (!master_addr_.empty()) return master_addr_;
  const char* env = detail::env("MASTER_ADDR");
  return env ? env : "127.0.0.1";
}
inline int DistributedOptions::store_port() const {
  return master_port_ != 0 ? master_port_ : detail::env_int("MASTER_PORT", 29500);
}

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
  static ProcessGroup create(const DistributedOptions& options = {},
                             torch::Device device = torch::kCPU) {
    options.validate();
    const RankInfo info = resolve(options);
    const auto timeout = std::chrono::milliseconds(
        static_cast<std::int64_t>(std::llround(options.timeout_seconds() * 1000.0)));
    c10::intrusive_ptr<c10d::Store> store;
    std::string store_text = "in memory";
    if (info.world_size == 1 && info.launcher == "single process") {
      store = c10::make_intrusive<c10d::HashStore>();
    } else {
      const std::string host = options.store_host();
      const int port = options.store_port();
      const char* agent = detail::env("TORCHELASTIC_USE_AGENT_STORE");
      const bool agent_store = info.launcher == "torchrun" && agent != nullptr &&
                               (std::string(agent) == "True" || std::string(agent) == "1");
      c10d::TCPStoreOptions so;
      so.port = static_cast<std::uint16_t>(port);
      so.isServer = !agent_store && info.rank == 0;
      so.numWorkers = agent_store ? std::nullopt : std::optional<std::size_t>(info.world_size);
      so.waitWorkers = !agent_store;
      so.timeout = timeout;
      store_text = host + ":" + std::to_string(port) +
                   (agent_store ? " (hosted by torchrun's agent)" : " (hosted by rank 0)");
      c10::intrusive_ptr<c10d::Store> tcp;
      try {
        tcp = c10::make_intrusive<c10d::TCPStore>(host, so);
      } catch (const std::exception& e) {
        throw DistributedError("trainkit: rank " + std::to_string(info.rank) + " of " +
                               std::to_string(info.world_size) + " (" + info.launcher +
                               ") could not join the store at " + store_text + " within " +
                               detail::seconds_text(options.timeout_seconds()) + " s: " + detail::message_of(e));
      }
      // Keys of one launch attempt never meet those of another (torchrun restarts).
      const std::string prefix =
          "trainkit/attempt_" + std::to_string(detail::env_int("TORCHELASTIC_RESTART_COUNT", 0));
      store = c10::make_intrusive<c10d::PrefixStore>(prefix, tcp);
    }
    store->setTimeout(timeout);
    RankInfo full = info;
    full.store = store_text;

    const bool cuda = device.is_cuda();
    // "cuda" alone means this rank's GPU (LOCAL_RANK), where torchrun's convention puts it.
    if (cuda && !device.has_index())
      device = torch::Device(torch::kCUDA, static_cast<c10::DeviceIndex>(info.local_rank));
    // This rank's GPU becomes the current device: kCUDA without an index, and the NCCL
    // communicator, then mean it (not GPU 0 on every rank).
    if (cuda) c10::impl::getDeviceGuardImpl(c10::kCUDA)->setDevice(device);
    const std::string backend = !options.backend().empty() ? options.backend() : cuda ? "nccl" : "gloo";
    if (backend == "nccl" && !cuda)
      throw std::invalid_argument("trainkit::ProcessGroup: NCCL needs a CUDA device, got " +
                                  device.str() + "; use Gloo for CPU tensors");
    if (backend == "gloo" && cuda)
      throw std::invalid_argument("trainkit::ProcessGroup: this group runs its collectives on " +
                                  device.str() + "; Gloo here is for CPU tensors, use NCCL");
    c10::intrusive_ptr<c10d::Backend> pg;
    try {
      if (backend == "gloo") {
        auto gloo = c10d::ProcessGroupGloo::Options::create_default(timeout);
        if (const char* ifname = detail::env("GLOO_SOCKET_IFNAME")) {
          gloo->devices.clear();
          std::stringstream names(ifname);
          for (std::string name; std::getline(names, name, ',');)
            gloo->devices.push_back(c10d::ProcessGroupGloo::createDeviceForInterface(name));
        }
        pg = c10::make_intrusive<c10d::ProcessGroupGloo>(store, full.rank, full.world_size, gloo);
      } else {
#if TRAINKIT_HAVE_NCCL
        auto nccl = c10d::ProcessGroupNCCL::Options::create();
        nccl->timeout = timeout;
        auto group = c10::make_intrusive<c10d::ProcessGroupNCCL>(store, full.rank, full.world_size, nccl);
        // Bound to this rank's GPU and connected now (inside the rendezvous' timeout), not
        // lazily inside the first optimizer step.
        group->setBoundDeviceId(device);
        group->eagerConnectSingleDevice(device);
        pg = group;
#else
        throw std::invalid_argument(
            "trainkit::ProcessGroup: this build has no NCCL (LibTorch without USE_C10D_NCCL, or "
            "no nccl.h); CUDA tensors cannot be all-reduced");
#endif
      }
    } catch (const std::invalid_argument&) {
      throw;
    } catch (const std::exception& e) {
      throw DistributedError("trainkit: rank " + std::to_string(full.rank) + " of " +
                             std::to_string(full.world_size) + " could not create the " + backend +
                             " process group: " + detail::message_of(e));
    }
    ProcessGroup group(store, pg, full, timeout, cuda ? device : torch::Device(torch::kCPU));
    if (full.world_size > 1 && options.heartbeat_seconds() > 0 && options.heartbeat_seconds() < options.timeout_seconds())
      group.start_heartbeat(std::chrono::milliseconds(std::llround(options.heartbeat_seconds() * 1000.0)));
    return group;
  }

  /// Starts this rank's heartbeat (parallel/heartbeat.hpp; create() does, by
  /// DistributedOptions::heartbeat_seconds): a rank silent for `silence` is named on stderr
  /// and in the errors of later collectives, and NCCL's communicator is aborted.
  /// A store hosted by torchrun's agent that stops answering means the agent is gone (killed),
  /// while the ranks and their own connections live on: the ranks then stop by themselves
  /// (store_gone(): tk::fit stops at its next agreement, writing a checkpoint, as for SIGTERM)
  /// and NCCL's communicator is left alone for that.
  void start_heartbeat(std::chrono::milliseconds silence) {
    const bool nccl = state_->backend->getBackendName() == "nccl";
    const bool agent_store = state_->info.store.find("torchrun's agent") != std::string::npos;
    const std::string who = "trainkit: rank " + std::to_string(rank()) + " of " + std::to_string(world_size());
    const std::string then = nccl ? "; aborting the NCCL communicator so that this rank stops now"
                                  : "; this rank stops when its collective fails or times out (" +
                                        detail::seconds_text(state_->timeout.count() / 1000.0) + " s)";
    const std::string launcher_gone =
        "; the launcher is gone, the ranks are not: tk::fit stops at the ranks' next agreement (within about " +
        detail::seconds_text(Replicas::agreement_seconds) + " s), writing a checkpoint, as for SIGTERM (ProcessGroup::store_gone())";
    state_->heartbeat.reset();
    state_->heartbeat = std::make_shared<detail::Heartbeat>(
        state_->store, rank(), world_size(), silence,
        [backend = state_->backend, who, then, launcher_gone, nccl, agent_store](const std::string& m) {
          if (agent_store && m.rfind(detail::Heartbeat::kStoreGone, 0) == 0) {
            std::cerr << who << ": " << m << launcher_gone << std::endl;
            return;
          }
          std::cerr << who << ": " << m << then << std::endl;
          if (nccl) backend->abort();  // pending and later collectives fail: fail() says why
        });
  }

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
  void leave_with_error(const std::string& reason) {
    if (state_->heartbeat) state_->heartbeat->leave_with_error(reason);
  }

  /// This group with `backend` in place of its own (a wrapper around it: one that counts the
  /// collectives): the same store, identity, timeout and device, and the same heartbeat (its
  /// store_gone() and the errors' "heartbeat:" part), which leaves when both groups are gone.
  ProcessGroup over(c10::intrusive_ptr<c10d::Backend> backend) const {
    ProcessGroup g(state_->store, std::move(backend), state_->info, state_->timeout, state_->device);
    g.state_->heartbeat = state_->heartbeat;
    return g;
  }

  /// From parts: a store, a backend built over it (e.g. a wrapper around another group's
  /// backend; over() keeps the heartbeat too), the identity and timeout.
  ProcessGroup(c10::intrusive_ptr<c10d::Store> store, c10::intrusive_ptr<c10d::Backend> backend,
               RankInfo info, std::chrono::milliseconds timeout, torch::Device device)
      : state_(std::make_shared<State>(
            State{std::move(store), std::move(backend), std::move(info), timeout, device, nullptr})) {
    TORCH_CHECK(state_->backend->getRank() == state_->info.rank &&
                    state_->backend->getSize() == state_->info.world_size,
                "ProcessGroup: the backend is rank ", state_->backend->getRank(), " of ",
                state_->backend->getSize(), ", the info says ", state_->info.rank, " of ",
                state_->info.world_size);
  }

  /// Which rank this process would be, from the environment or the options, without joining.
  static RankInfo resolve(const DistributedOptions& options) {
    RankInfo info;
    const bool torchrun = detail::env("RANK") && detail::env("WORLD_SIZE");
    const bool slurm = detail::env("SLURM_PROCID") && detail::env("SLURM_NTASKS");
    Rendezvous how = options.rendezvous();
    if (how == Rendezvous::environment)
      how = torchrun ? Rendezvous::torchrun : slurm ? Rendezvous::slurm : Rendezvous::options;
    switch (how) {
      case Rendezvous::torchrun:
        if (!torchrun)
          throw DistributedError("trainkit: Rendezvous::torchrun, but RANK and WORLD_SIZE are not "
                                 "set; launch with torchrun, or use Rendezvous::environment");
        info = {detail::env_int("RANK", 0), detail::env_int("WORLD_SIZE", 1),
                detail::env_int("LOCAL_RANK", 0), "torchrun", ""};
        break;
      case Rendezvous::slurm:
        if (!slurm)
          throw DistributedError("trainkit: Rendezvous::slurm, but SLURM_PROCID and SLURM_NTASKS "
                                 "are not set; launch with srun, or use Rendezvous::environment");
        info = {detail::env_int("SLURM_PROCID", 0), detail::env_int("SLURM_NTASKS", 1),
                detail::env_int("SLURM_LOCALID", 0), "slurm", ""};
        break;
      case Rendezvous::options:
      case Rendezvous::environment:
        info = {options.rank(), options.world_size(), options.local_rank(),
                options.world_size() == 1 && options.rendezvous() == Rendezvous::environment
                    ? "single process"
                    : "options",
                ""};
        break;
    }
    if (info.world_size < 1 || info.rank < 0 || info.rank >= info.world_size)
      throw DistributedError("trainkit: " + info.launcher + " gives rank " +
                             std::to_string(info.rank) + " of world size " +
                             std::to_string(info.world_size) + "; need 0 <= rank < world size");
    return info;
  }

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
                                                  c10d::ReduceOp op = c10d::ReduceOp::SUM) const {
    std::vector<torch::Tensor> tensors{tensor};
    c10d::AllreduceOptions o;
    o.reduceOp = op;
    return state_->backend->allreduce(tensors, o);
  }
  /// Waits for `work`; on failure throws DistributedError naming `what` and the silent ranks.
  void wait(const c10::intrusive_ptr<c10d::Work>& work, const std::string& what) const {
    try {
      work->wait();
    } catch (const std::exception& e) {
      fail(what, detail::message_of(e));
    }
  }
  void all_reduce(const torch::Tensor& tensor, const std::string& what,
                  c10d::ReduceOp op = c10d::ReduceOp::SUM) const {
    c10::intrusive_ptr<c10d::Work> work;
    try {
      work = start_all_reduce(tensor, op);
    } catch (const std::exception& e) {
      fail(what, detail::message_of(e));
    }
    wait(work, what);
  }
  /// Rank `root`'s `tensor` (contiguous, on device()) to every rank, in place.
  void broadcast(const torch::Tensor& tensor, const std::string& what, int root = 0) const {
    std::vector<torch::Tensor> tensors{tensor};
    c10d::BroadcastOptions o;
    o.rootRank = root;
    c10::intrusive_ptr<c10d::Work> work;
    try {
      work = state_->backend->broadcast(tensors, o);
    } catch (const std::exception& e) {
      fail(what, detail::message_of(e));
    }
    wait(work, what);
  }
  /// A few host scalars combined over the ranks, in place: one collective and one copy back
  /// (a mean is the sum divided on the host). Every rank calls it alike.
  void all_reduce(std::vector<double>& values, Reduce op, const std::string& what) const {
    if (values.empty()) return;
    // One host sync: the copy back, which returning host values needs. The copy there is
    // from pinned memory and does not wait (the caching host allocator keeps the buffer alive
    // until the copy has run).
    auto t = torch::tensor(values, torch::kDouble);
    t = device().is_cuda() ? t.pin_memory().to(device(), /*non_blocking=*/true) : t;
    all_reduce(t, what, op == Reduce::max ? c10d::ReduceOp::MAX : c10d::ReduceOp::SUM);
    const auto host = t.cpu();
    const double* v = host.data_ptr<double>();
    for (size_t i = 0; i < values.size(); ++i)
      values[i] = op == Reduce::mean ? v[i] / static_cast<double>(world_size()) : v[i];
  }

  /// Throws DistributedError for a failed `what`: rank and peers, and which ranks do not answer
  /// a roll call through the store within a few seconds (they died or hang).
  [[noreturn]] void fail(const std::string& what, const std::string& error) const {
    std::ostringstream msg;
    msg << "trainkit: rank " << rank() << " of " << world_size() << ": " << what << " failed";
    // Short against the timeout: a dead peer is usually seen at once (connection reset), and
    // the survivors should stop well within the timeout.
    const auto grace = std::min<std::chrono::milliseconds>(state_->timeout / 4, std::chrono::seconds(3));
    try {
      auto& store = *state_->store;
      store.set("failed/" + std::to_string(rank()), std::vector<std::uint8_t>{1});
      std::vector<int> silent;
      for (int r = 0; r < world_size(); ++r)
        if (r != rank()) silent.push_back(r);
      const auto deadline = std::chrono::steady_clock::now() + grace;
      while (!silent.empty()) {
        std::vector<int> still;
        for (int r : silent)
          if (!store.check({"failed/" + std::to_string(r)})) still.push_back(r);
        silent.swap(still);
        if (silent.empty() || std::chrono::steady_clock::now() >= deadline) break;
        std::this_thread::sleep_for(std::chrono::milliseconds(50));
      }
      if (silent.empty())
        msg << "; every other rank failed too";
      else
        msg << "; rank" << (silent.size() > 1 ? "s " : " ") << detail::ranks_string(silent)
            << (silent.size() > 1 ? " do" : " does") << " not answer (within "
            << grace.count() / 1000.0 << " s): died or hangs";
    } catch (const std::exception& e) {
      msg << "; the store at " << state_->info.store << " does not answer either (" << detail::message_of(e)
          << "): its host is gone";
    }
    if (state_->heartbeat)
      if (const auto heard = state_->heartbeat->failure(); !heard.empty()) msg << "; heartbeat: " << heard;
    msg << " (timeout " << state_->timeout.count() / 1000.0 << " s). " << state_->backend->getBackendName()
        << " said: " << error;
    throw DistributedError(msg.str());
  }

 private:
  struct State {
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
