#pragma once
/// Data-parallel training on PyTorch's c10d: Gloo for CPU tensors, NCCL for CUDA ones.
///
///   auto group = tk::ProcessGroup::create(tk::DistributedOptions().timeout_seconds(600), device);
///   Trainer trainer(model, tk::AdamW{1e-4, 1e-4}, options);
///   trainer.set_replicas(std::make_shared<tk::DataParallel>(group));   // rank 0's weights to all
///   tk::DistributedSampler sampler(size, batch, group.rank(), group.world_size(), seed);
///   ... micro_step on sampler.batch(epoch, i) ...; log and save where group.is_main()
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
/// Communication: the gradient is summed once per window (phase 5, docs/design/optimizer-phase.md) by a bucketed
/// all-reduce of the trainer's flat gradient storage, `bucket_bytes` per collective, started
/// bucket by bucket during the window's last backward as the gradients become ready
/// (TrainerOptions::overlap_reduction), or all at its end; the division by the world size is
/// folded into the factor the trainer already applies (no extra pass). Nothing is sent inside
/// a window. Sharded (TrainerOptions::sharding): a reduce-scatter of the same buckets, the
/// slices' squared norms in one all-reduce, an all-gather of the updated parameters.
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
#error "trainkit/distributed.hpp needs Gloo's headers (PyTorch's wheel does not ship them): install Debian's libgloo-dev, or put a PyTorch source tree's third_party/gloo on the include path"
#endif
#if !defined(USE_C10D_GLOO)
#error "trainkit/distributed.hpp: this LibTorch was built without Gloo (USE_C10D_GLOO is not defined by its CMake package); link the target `torch` from a distributed build"
#endif

#include <trainkit/detail/heartbeat.hpp>
#include <trainkit/replicas.hpp>

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

  /// Starts this rank's heartbeat (detail/heartbeat.hpp; create() does, by
  /// DistributedOptions::heartbeat_seconds): a rank silent for `silence` is named on stderr
  /// and in the errors of later collectives, and NCCL's communicator is aborted.
  void start_heartbeat(std::chrono::milliseconds silence) {
    const bool nccl = state_->backend->getBackendName() == "nccl";
    const std::string who = "trainkit: rank " + std::to_string(rank()) + " of " + std::to_string(world_size());
    const std::string then = nccl ? "; aborting the NCCL communicator so that this rank stops now"
                                  : "; this rank stops when its collective fails or times out (" +
                                        detail::seconds_text(state_->timeout.count() / 1000.0) + " s)";
    state_->heartbeat.reset();
    state_->heartbeat = std::make_unique<detail::Heartbeat>(
        state_->store, rank(), world_size(), silence, [backend = state_->backend, who, then, nccl](const std::string& m) {
          std::cerr << who << ": " << m << then << std::endl;
          if (nccl) backend->abort();  // pending and later collectives fail: fail() says why
        });
  }

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

  /// From parts: a store, a backend built over it (e.g. a wrapper around another group's
  /// backend), the identity and timeout.
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
    std::unique_ptr<detail::Heartbeat> heartbeat;  // last: stopped before the rest goes
  };
  std::shared_ptr<State> state_;
};

/// Replicas over a ProcessGroup (replicas.hpp): rank 0's weights at attach, the gradient summed
/// by a bucketed all-reduce once per window, the same state checked after load.
class DataParallel final : public Replicas {
 public:
  /// DDP's default bucket: 25 MiB.
  static constexpr std::int64_t kDefaultBucketBytes = 25 * 1024 * 1024;

  explicit DataParallel(ProcessGroup group, std::int64_t bucket_bytes = kDefaultBucketBytes)
      : group_(std::move(group)), bucket_bytes_(bucket_bytes) {
    if (bucket_bytes_ < 1)
      throw std::invalid_argument("trainkit::DataParallel: bucket_bytes must be >= 1, got " +
                                  std::to_string(bucket_bytes_));
  }

  /// At world size 1, cut the trainer's buffers as a sharded run does (TrainerOptions::sharding:
  /// one slice of every bucket, which is the whole bucket) and install the overlap's hooks:
  /// the reduce-scatters (PREMUL_SUM with item counts on NCCL), all-gathers, gathers to rank 0,
  /// released gradients and hook-launched buckets of sharding then all run, each on one rank,
  /// with the results of one process. For checking that code on a single device (the GPU check,
  /// benchmarks/gpu/nccl_startup.cpp); it costs the collectives' time. No effect with more ranks.
  DataParallel& shard_at_world_size_one(bool on) {
    shard_alone_ = on;
    return *this;
  }
  bool shards_alone() const override { return shard_alone_ && world_size() == 1; }

  int rank() const override { return group_.rank(); }
  int world_size() const override { return group_.world_size(); }
  const ProcessGroup& group() const { return group_; }
  std::int64_t bucket_bytes() const override { return bucket_bytes_; }
  /// All-reduce calls per window for a gradient of `numel` elements of `element_size` bytes.
  std::int64_t buckets(std::int64_t numel, std::int64_t element_size = 4) const {
    const std::int64_t per = std::max<std::int64_t>(1, bucket_bytes_ / element_size);
    return numel == 0 ? 0 : (numel + per - 1) / per;
  }
  /// Optimizer phases this replica has reduced.
  std::int64_t windows() const { return windows_; }

  void attach(torch::nn::Module& model, const torch::Tensor& flat_params,
              const torch::Tensor& rewritten = torch::Tensor()) override {
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

  GradientFactor reduce_gradients(torch::Tensor& flat_grad, const WindowWeights& window) override {
    const auto element = static_cast<std::int64_t>(flat_grad.element_size());
    const detail::Partition buckets(flat_grad.numel(), std::max<std::int64_t>(1, bucket_bytes_ / element), 64 / element,
                                    world_size(), rank(), /*sharded=*/false);
    return start_reduction(flat_grad, {}, buckets, window, /*closes=*/true)->finish();
  }
  std::unique_ptr<Reduction> start_reduction(torch::Tensor& flat_grad, torch::Tensor local, const detail::Partition& partition,
                                             const WindowWeights& window, bool closes) override {
    if (local.defined()) check_partition(partition, flat_grad);
    return std::make_unique<BucketReduction>(*this, flat_grad, std::move(local), partition, window, closes);
  }
  torch::Tensor global_norm(const torch::Tensor& local) override {
    // The slices' squared norms summed: the norm of norms, as the chunked master-weights phase
    // takes it (within rounding of the whole gradient's norm; non-finite on every rank when
    // any slice is).
    auto squares = at::linalg_vector_norm(local, 2).square().reshape({1});
    group_.all_reduce(squares, "all-reduce of the gradient's squared norm (optimizer phase " + std::to_string(windows_) + ")");
    return squares.sqrt().reshape({});
  }
  void sum(torch::Tensor& values) override {
    group_.all_reduce(values, "all-reduce of the fp32-kept parameters (optimizer phase " + std::to_string(windows_) + ")");
  }
  void all_gather(torch::Tensor& flat, const detail::Partition& partition) override {
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
  torch::Tensor gather_to_main(const torch::Tensor& local, const detail::Partition& partition) override {
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
  void check_same_state(const std::vector<torch::Tensor>& state, const std::string& what) override {
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

  void all_reduce(std::vector<double>& values, Reduce op) override {
    group_.all_reduce(values, op, "combining " + std::to_string(values.size()) + " values over the ranks");
  }
  void sum_counts(torch::Tensor& counts) override {
    check_device(counts, "the loss terms' item counts");
    group_.all_reduce(counts, "all-reduce of the window's item count per loss term (optimizer phase " +
                                  std::to_string(windows_ + 1) + " of this process)");
  }

 private:
  // Phase 5 bucket by bucket (Replicas::start_reduction): the weighting at the start, each
  // bucket's collective at launch(), the item count and the waits at finish().
  class BucketReduction final : public Reduction {
   public:
    BucketReduction(DataParallel& owner, torch::Tensor& flat, torch::Tensor local, detail::Partition partition,
                    const WindowWeights& window, bool closes)
        : owner_(owner), flat_(flat), local_(std::move(local)), partition_(std::move(partition)),
          launched_(static_cast<size_t>(partition_.buckets()), false) {
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
      if (flat.element_size() < 4) {
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
    ~BucketReduction() override {
      // Never left with collectives in flight (an exception between launch and finish).
      for (auto& work : works_)
        if (work) try { work->wait(); } catch (...) {}
    }

    void launch(std::int64_t b) override {
      if (launched_[static_cast<size_t>(b)]) return;
      launched_[static_cast<size_t>(b)] = true;
      while (works_.size() - waited_ >= max_in_flight_) wait_next();
      const auto bucket = partition_.bucket(b);
      auto in = flat_.narrow(0, bucket.begin, std::min(bucket.length, flat_.numel() - bucket.begin));
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
    }
    GradientFactor finish() override {
      for (std::int64_t b = partition_.buckets() - 1; b >= 0; --b) launch(b);
      if (items_.defined()) {
        works_.push_back(owner_.group_.start_all_reduce(items_));
        names_.push_back("all-reduce of the window's item count" + step_);
      }
      while (waited_ < works_.size()) wait_next();
      return factor_;
    }

   private:
    DataParallel& owner_;
    torch::Tensor flat_, local_;
    detail::Partition partition_;
    std::vector<bool> launched_;
    std::string step_;
    c10d::ReduceOp op_ = c10d::ReduceOp::SUM;
    double premultiplier_ = 1.0;
    torch::Tensor weight_, items_;
    GradientFactor factor_;
    std::vector<c10::intrusive_ptr<c10d::Work>> works_;
    std::vector<std::string> names_;
    size_t waited_ = 0, max_in_flight_ = static_cast<size_t>(-1);

    void wait_next() {
      auto work = std::move(works_[waited_]);
      owner_.group_.wait(work, names_[waited_]);
      ++waited_;
    }
  };

  void check_partition(const detail::Partition& partition, const torch::Tensor& flat) const {
    if (partition.world_size() != world_size() || partition.rank() != rank() || flat.numel() != partition.total())
      throw std::logic_error("trainkit::DataParallel: a partition of rank " + std::to_string(partition.rank()) + " of " +
                             std::to_string(partition.world_size()) + " over " + std::to_string(partition.total()) +
                             " elements, for rank " + std::to_string(rank()) + " of " + std::to_string(world_size()) +
                             " and a buffer of " + std::to_string(flat.numel()));
  }

  void check_device(const torch::Tensor& t, const std::string& what) const {
    if (t.device() != group_.device())
      throw std::invalid_argument("trainkit::DataParallel: " + what + " are on " + t.device().str() +
                                  ", the process group communicates on " + group_.device().str() +
                                  "; create the group for the model's device");
  }

  ProcessGroup group_;
  std::int64_t bucket_bytes_;
  std::int64_t windows_ = 0;
  bool shard_alone_ = false;
};

}  // namespace trainkit
