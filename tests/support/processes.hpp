#pragma once
// Tests that start programs as processes (ranks of a data-parallel run, a driver to kill):
// spawn with its own launcher environment and output files, wait with a deadline, read back.
// posix_spawn, not fork: no LibTorch thread pool is ever forked.
#include <doctest/doctest.h>

#include <c10/core/Allocator.h>

#include <chrono>
#include <cstdlib>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <dlfcn.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

extern char** environ;

namespace trainkit_testing::processes {

// The directory of this test binary.
inline std::string here() {
  char buf[4096];
  const auto n = ::readlink("/proc/self/exe", buf, sizeof(buf) - 1);
  REQUIRE(n > 0);
  std::string self(buf, static_cast<size_t>(n));
  return self.substr(0, self.rfind('/'));
}

// torchrun of the torch wheel that this binary's LibTorch comes from (.../site-packages/torch/
// lib/libtorch_cpu.so -> .../bin/torchrun), or $TRAINKIT_TORCHRUN.
inline std::string torchrun() {
  if (const char* t = std::getenv("TRAINKIT_TORCHRUN")) return t;
  Dl_info info{};
  if (::dladdr(reinterpret_cast<void*>(&c10::GetAllocator), &info) == 0 || !info.dli_fname) return "";
  std::string lib = info.dli_fname;  // <venv>/lib/pythonX.Y/site-packages/torch/lib/libc10.so
  for (int up = 0; up < 6; ++up) lib = lib.substr(0, lib.rfind('/'));
  return lib + "/bin/torchrun";
}

inline int free_port() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  REQUIRE(fd >= 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  REQUIRE(::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0);
  socklen_t len = sizeof(addr);
  REQUIRE(::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) == 0);
  ::close(fd);
  return ntohs(addr.sin_port);
}

// A child process with its own environment (the launcher variables replaced) and its output
// in files.
struct Child {
  pid_t pid = -1;
  std::string out, err;
};

inline Child spawn(const std::vector<std::string>& argv, const std::map<std::string, std::string>& vars,
            const std::string& log) {
  std::vector<std::string> env_strings;
  static const char* const launcher[] = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                         "MASTER_PORT", "SLURM_PROCID", "SLURM_NTASKS",
                                         "TORCHELASTIC_USE_AGENT_STORE", "LOCAL_WORLD_SIZE",
                                         "SLURM_LOCALID", "SLURM_NTASKS_PER_NODE"};
  for (char** e = environ; *e; ++e) {
    const std::string s = *e;
    bool drop = false;
    for (const char* name : launcher) drop |= s.rfind(std::string(name) + "=", 0) == 0;
    if (!drop) env_strings.push_back(s);
  }
  for (const auto& [k, v] : vars) env_strings.push_back(k + "=" + v);
  std::vector<char*> envp, args;
  for (auto& s : env_strings) envp.push_back(s.data());
  envp.push_back(nullptr);
  std::vector<std::string> argv_copy = argv;
  for (auto& s : argv_copy) args.push_back(s.data());
  args.push_back(nullptr);
  Child c;
  c.out = log + ".out";
  c.err = log + ".err";
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_addopen(&actions, 1, c.out.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  posix_spawn_file_actions_addopen(&actions, 2, c.err.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  const int rc = ::posix_spawn(&c.pid, args[0], &actions, nullptr, args.data(), envp.data());
  posix_spawn_file_actions_destroy(&actions);
  REQUIRE_MESSAGE(rc == 0, "could not start " << argv[0]);
  return c;
}

inline std::string slurp(const std::string& path) {
  std::ifstream f(path);
  std::stringstream s;
  s << f.rdbuf();
  return s.str();
}

// The exit status, or -1 if it has not exited within `seconds` (it is then killed).
inline int wait_exit(const Child& c, double seconds) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
  int status = 0;
  while (std::chrono::steady_clock::now() < deadline) {
    if (::waitpid(c.pid, &status, WNOHANG) == c.pid)
      return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  ::kill(c.pid, SIGKILL);
  ::waitpid(c.pid, &status, 0);
  return -1;
}

inline void expect_success(const Child& c, int status) {
  INFO("stderr of " << c.err << ":\n" << slurp(c.err));
  REQUIRE(status == 0);
}

}  // namespace trainkit_testing::processes
