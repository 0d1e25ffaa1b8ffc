// One job per output directory: DirectoryLock refuses a second holder, naming the directory and
// the holder's pid, and is released when its holder goes; tk::fit takes it; the temporary files
// of a live process are never deleted, those of a dead one are.
#include "../support/helpers.hpp"

#include <trainkit/fit/checkpoint.hpp>
#include <trainkit/fit/fit.hpp>

#include <fstream>
#include <string>

#include <sys/wait.h>
#include <unistd.h>

namespace test_directory_lock {  // this file's names, apart from those of the files it shares a unity batch with

using testing::TempDir;

namespace {

void write_bytes(const std::string& path, const std::string& bytes) {
  std::ofstream(path, std::ios::binary) << bytes;
}

// The pid of a process that has exited and been reaped.
pid_t dead_pid() {
  const pid_t child = ::fork();
  if (child == 0) ::_exit(0);
  int status = 0;
  ::waitpid(child, &status, 0);
  return child;
}

}  // namespace

TEST_CASE("a locked output directory refuses a second holder, naming it and the holder's pid") {
  TempDir dir;
  {
    tk::DirectoryLock first(dir.path);
    const std::string expected = "the output directory '" + dir.path + "' is in use by another training job (pid " +
                                 std::to_string(::getpid()) + ", lock file '" + dir.path + "/.trainkit.lock')";
    CHECK_THROWS_WITH_AS(tk::DirectoryLock(dir.path), doctest::Contains(expected.c_str()), tk::CheckpointError);
  }
  CHECK_NOTHROW(tk::DirectoryLock(dir.path));  // released with its holder
}

TEST_CASE("tk::fit refuses a directory another job holds, and writes nothing there") {
  TempDir dir;
  auto model = testing::make_mlp(1);
  tk::Trainer<> trainer(model, tk::SGD{0.1});
  const auto data = testing::regression(16);
  tk::Task<int> task;
  task.batches_per_epoch = [](std::int64_t) { return std::int64_t{2}; };
  task.batch = [](std::int64_t, std::int64_t index) { return static_cast<int>(index); };
  task.loss = [&](const int& i, tk::Metrics&) {
    return torch::mse_loss(model(data.x.narrow(0, 8 * i, 8)), data.y.narrow(0, 8 * i, 8));
  };
  const auto options = tk::FitOptions().output_path(dir.path).end_epoch(1).progress(false).handle_signals(false);
  {
    tk::DirectoryLock other_job(dir.path);
    CHECK_THROWS_WITH_AS(tk::fit(trainer, task, options), doctest::Contains("is in use by another training job"),
                         tk::CheckpointError);
    CHECK_FALSE(testing::file_exists(dir / "model-0000.ckpt"));
    CHECK(trainer.windows() == 0);
  }
  const tk::FitResult r = tk::fit(trainer, task, options);
  CHECK(r.checkpoints == std::vector<std::string>{dir / "model-0000.ckpt"});
}

TEST_CASE("only the temporary files of dead processes are removed") {
  TempDir dir;
  const std::string live = dir / ("model-0001.ckpt.tmp." + std::to_string(::getppid()));
  const std::string dead = dir / ("model-0001.ckpt.tmp." + std::to_string(dead_pid()));
  write_bytes(live, "another job is writing this");
  write_bytes(dead, "left by a killed process");
  tk::CheckpointManager(dir.path).prune();
  CHECK(testing::file_exists(live));
  CHECK_FALSE(testing::file_exists(dead));
}

}  // namespace test_directory_lock
