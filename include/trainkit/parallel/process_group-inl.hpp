#pragma once
/// The definitions of trainkit/parallel/process_group.hpp (header-only: included by it; compiled mode
/// with TRAINKIT_COMPILED_PARALLEL: by src/trainkit.cpp alone). See docs/design/compiled-mode.md.
#include <trainkit/parallel/process_group.hpp>

namespace trainkit {

TRAINKIT_PARALLEL_INLINE void DistributedOptions::validate() const {
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

}  // namespace trainkit
namespace trainkit {
namespace detail {

TRAINKIT_PARALLEL_INLINE const char* env(const char* name) {
  const char* v = std::getenv(name);
  return v != nullptr && *v != '\0' ? v : nullptr;
}

TRAINKIT_PARALLEL_INLINE int env_int(const char* name, int fallback) {
  const char* v = env(name);
  if (v == nullptr) return fallback;
  char* end = nullptr;
  const long value = std::strtol(v, &end, 10);
  if (end == v || *end != '\0')
    throw DistributedError(std::string("trainkit: environment variable ") + name +
                           " must be an integer, got \"" + v + "\"");
  return static_cast<int>(value);
}

TRAINKIT_PARALLEL_INLINE std::string message_of(const std::exception& e) {
  if (const auto* c10_error = dynamic_cast<const c10::Error*>(&e)) return c10_error->what_without_backtrace();
  return e.what();
}

TRAINKIT_PARALLEL_INLINE std::string seconds_text(double seconds) {
  std::ostringstream s;
  s << seconds;
  return s.str();
}

TRAINKIT_PARALLEL_INLINE std::string ranks_string(const std::vector<int>& ranks) {
  std::string s;
  for (size_t i = 0; i < ranks.size(); ++i) s += (i ? ", " : "") + std::to_string(ranks[i]);
  return s;
}

}  // namespace detail
}  // namespace trainkit
namespace trainkit {

TRAINKIT_PARALLEL_INLINE std::string DistributedOptions:: store_host() const {
  if (!master_addr_.empty()) return master_addr_;
  const char* env = detail::env("MASTER_ADDR");
  return env ? env : "127.0.0.1";
}

TRAINKIT_PARALLEL_INLINE int DistributedOptions:: store_port() const {
  return master_port_ != 0 ? master_port_ : detail::env_int("MASTER_PORT", 29500);
}

TRAINKIT_PARALLEL_INLINE ProcessGroup ProcessGroup::create(const DistributedOptions& options, torch::Device device) {
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

TRAINKIT_PARALLEL_INLINE void ProcessGroup::start_heartbeat(std::chrono::milliseconds silence) {
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

TRAINKIT_PARALLEL_INLINE void ProcessGroup::leave_with_error(const std::string& reason) {
  if (state_->heartbeat) state_->heartbeat->leave_with_error(reason);
}

TRAINKIT_PARALLEL_INLINE ProcessGroup ProcessGroup::over(c10::intrusive_ptr<c10d::Backend> backend) const {
  ProcessGroup g(state_->store, std::move(backend), state_->info, state_->timeout, state_->device);
  g.state_->heartbeat = state_->heartbeat;
  return g;
}

TRAINKIT_PARALLEL_INLINE ProcessGroup::ProcessGroup(c10::intrusive_ptr<c10d::Store> store,
                                           c10::intrusive_ptr<c10d::Backend> backend, RankInfo info,
                                           std::chrono::milliseconds timeout, torch::Device device)
    : state_(new State{{}, std::move(store), std::move(backend), std::move(info), timeout, device, nullptr}) {
  TORCH_CHECK(state_->backend->getRank() == state_->info.rank &&
                  state_->backend->getSize() == state_->info.world_size,
              "ProcessGroup: the backend is rank ", state_->backend->getRank(), " of ",
              state_->backend->getSize(), ", the info says ", state_->info.rank, " of ",
              state_->info.world_size);
}

TRAINKIT_PARALLEL_INLINE RankInfo ProcessGroup::resolve(const DistributedOptions& options) {
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

TRAINKIT_PARALLEL_INLINE c10::intrusive_ptr<c10d::Work> ProcessGroup::start_all_reduce(const torch::Tensor& tensor,
                                                                              c10d::ReduceOp op) const {
  std::vector<torch::Tensor> tensors{tensor};
  c10d::AllreduceOptions o;
  o.reduceOp = op;
  return state_->backend->allreduce(tensors, o);
}

TRAINKIT_PARALLEL_INLINE void ProcessGroup::wait(const c10::intrusive_ptr<c10d::Work>& work, const std::string& what) const {
  try {
    work->wait();
  } catch (const std::exception& e) {
    fail(what, detail::message_of(e));
  }
}

TRAINKIT_PARALLEL_INLINE void ProcessGroup::all_reduce(const torch::Tensor& tensor, const std::string& what,
                                              c10d::ReduceOp op) const {
  c10::intrusive_ptr<c10d::Work> work;
  try {
    work = start_all_reduce(tensor, op);
  } catch (const std::exception& e) {
    fail(what, detail::message_of(e));
  }
  wait(work, what);
}

TRAINKIT_PARALLEL_INLINE void ProcessGroup::broadcast(const torch::Tensor& tensor, const std::string& what, int root) const {
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

TRAINKIT_PARALLEL_INLINE void ProcessGroup::all_reduce(std::vector<double>& values, Reduce op, const std::string& what) const {
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

[[noreturn]] TRAINKIT_PARALLEL_INLINE void ProcessGroup::fail(const std::string& what, const std::string& error) const {
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

}  // namespace trainkit
