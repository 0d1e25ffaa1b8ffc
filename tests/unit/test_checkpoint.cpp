// CheckpointManager: names and order, keep-N plus the best, the newest complete one for
// AUTO_RESUME (a damaged newest one reported and skipped), refusal of another trainer or shape
// naming the file, and a full or read-only output directory: a clear error, the old
// checkpoints byte-identical.
#include "../support/helpers.hpp"

#include <trainkit/fit/fit.hpp>
#include <trainkit/io/weights.hpp>

#include <csignal>
#include <cstring>
#include <fstream>
#include <sstream>

#include <dirent.h>
#include <fcntl.h>
#include <sys/mount.h>
#include <sys/resource.h>

namespace test_checkpoint {  // this file's names, apart from those of the files it shares a unity batch with

using testing::make_mlp;
using testing::TempDir;

namespace {

using T = tk::Trainer<tk::PrecisionPolicy<tk::FP16Dynamic>, tk::AccumulationPolicy<2>,
                      tk::ClipPolicy<tk::ClipNorm>>;

std::string read_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}
void write_bytes(const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out << bytes;
}

std::vector<std::string> names_in(const std::string& dir) {
  std::vector<std::string> names;
  DIR* d = ::opendir(dir.c_str());
  REQUIRE(d != nullptr);
  while (auto* e = ::readdir(d)) {
    const std::string n = e->d_name;
    if (n != "." && n != "..") names.push_back(n);
  }
  ::closedir(d);
  std::sort(names.begin(), names.end());
  return names;
}

/// A trainer that has taken a few steps (so that its state differs from a fresh one).
struct Trained {
  testing::TinyMlp model = make_mlp(21, 8, 16, 3);
  T trainer{model, tk::AdamW{1e-2}};
  testing::Regression data = testing::regression(32);
  void steps(int n) {
    for (int i = 0; i < n; ++i)
      trainer.micro_step([&] { return torch::mse_loss(model(data.x), data.y); });
  }
};

tk::LoopState state_at(std::int64_t epoch, std::int64_t index = 0) {
  tk::LoopState s;
  s.position = {epoch, index};
  return s;
}

/// A small tmpfs mounted on a fresh directory, unmounted at scope exit; `ok` is false where
/// mount(2) is not permitted.
struct SmallTmpfs {
  TempDir dir;
  bool ok = false;
  explicit SmallTmpfs(const std::string& size) {
    ok = ::mount("tmpfs", dir.path.c_str(), "tmpfs", 0, ("size=" + size).c_str()) == 0;
  }
  bool remount_read_only() {
    return ::mount("tmpfs", dir.path.c_str(), "tmpfs", MS_REMOUNT | MS_RDONLY, nullptr) == 0;
  }
  ~SmallTmpfs() {
    if (ok) ::umount2(dir.path.c_str(), MNT_DETACH);
  }
};

/// Fills the file system of `dir` until a write fails (ENOSPC).
void fill(const std::string& dir) {
  const int fd = ::open((dir + "/filler").c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  REQUIRE(fd >= 0);
  std::vector<char> block(4096, 'x');
  while (::write(fd, block.data(), block.size()) > 0) {
  }
  while (::write(fd, block.data(), 1) > 0) {
  }
  ::close(fd);
}

}  // namespace

TEST_CASE("checkpoint names: epoch files and position files, ordered by where they resume") {
  TempDir dir;
  Trained t;
  tk::CheckpointManager m(dir.path, "vl", 10);
  CHECK(m.epoch_path(3) == dir / "vl-0003.ckpt");
  CHECK(m.position_path({2, 17}) == dir / "vl-0002-000017.ckpt");
  CHECK(m.save(t.trainer, state_at(2, 5), false) == dir / "vl-0002-000005.ckpt");
  CHECK(m.save(t.trainer, state_at(1), true) == dir / "vl-0000.ckpt");
  CHECK(m.save(t.trainer, state_at(2), true) == dir / "vl-0001.ckpt");
  write_bytes(dir / "vl-notes.ckpt", "not one of ours");
  write_bytes(dir / "other-0009.ckpt", "another prefix");
  const auto files = m.list();
  REQUIRE(files.size() == 3);
  CHECK(files[0].path == dir / "vl-0000.ckpt");
  CHECK(files[1].path == dir / "vl-0001.ckpt");
  CHECK(files[2].path == dir / "vl-0002-000005.ckpt");
  CHECK(files[1].resume_at() == tk::FitPosition{2, 0});
  CHECK(files[2].resume_at() == tk::FitPosition{2, 5});
}

TEST_CASE("the loop's state round-trips, and resume_newest loads the newest") {
  TempDir dir;
  Trained t;
  tk::CheckpointManager m(dir.path, "model", 3);
  t.steps(3);
  tk::LoopState s = state_at(4, 6);
  s.seed = 77;
  s.config_json = R"({"TRAIN":{"LR":0.1}})";
  s.best_metric = "Acc";
  s.best_value = 0.5;
  s.best_path = m.epoch_path(2);
  m.save(t.trainer, state_at(3), true);
  m.save(t.trainer, s, false);
  const auto params = testing::flat(*t.model);
  const auto scale = t.trainer.loss_scale().clone();

  Trained other;
  std::ostringstream report;
  const auto loaded = m.resume_newest(other.trainer, report);
  REQUIRE(loaded.has_value());
  CHECK(loaded->path == dir / "model-0004-000006.ckpt");
  CHECK(loaded->state.position == tk::FitPosition{4, 6});
  CHECK(loaded->state.seed == 77);
  CHECK(loaded->state.config_json == s.config_json);
  CHECK(loaded->state.best_metric == "Acc");
  CHECK(loaded->state.best_value == 0.5);
  CHECK(loaded->state.best_path == s.best_path);
  CHECK(torch::equal(testing::flat(*other.model), params));
  CHECK(torch::equal(other.trainer.loss_scale(), scale));
  CHECK(other.trainer.windows() == 1);
  CHECK(report.str().empty());

  TempDir empty;
  CHECK_FALSE(tk::CheckpointManager(empty.path).resume_newest(other.trainer).has_value());
}

TEST_CASE("retention: the newest CHECKPOINT_KEEP plus the best; stale temporary files go") {
  TempDir dir;
  Trained t;
  tk::CheckpointManager m(dir.path, "model", 2);
  write_bytes(dir / "model-0001.ckpt.tmp.999999999", "left by a killed process");
  tk::LoopState s;
  for (int epoch = 0; epoch < 6; ++epoch) {
    s.position = {epoch + 1, 0};
    if (epoch == 1) s.best_path = m.epoch_path(1);  // epoch 1 validated best
    m.save(t.trainer, s, true);
  }
  CHECK(names_in(dir.path) == std::vector<std::string>{"model-0001.ckpt", "model-0004.ckpt", "model-0005.ckpt"});
  // A new best releases the old one at the next save.
  s.position = {7, 0};
  s.best_path = m.epoch_path(6);
  m.save(t.trainer, s, true);
  CHECK(names_in(dir.path) == std::vector<std::string>{"model-0005.ckpt", "model-0006.ckpt"});
  // Resumed from an earlier one (BEGIN_EPOCH, or past a damaged newest one): the checkpoints
  // after the new one (of the timeline left) take no place of the run's own, and the new one
  // stays; they go once the run has passed them.
  s.position = {3, 0};
  s.best_path.clear();
  m.save(t.trainer, s, true);
  CHECK(names_in(dir.path) == std::vector<std::string>{"model-0002.ckpt", "model-0005.ckpt", "model-0006.ckpt"});
  for (const std::int64_t epoch : {4, 8}) {
    s.position = {epoch, 0};
    m.save(t.trainer, s, true);
  }
  CHECK(names_in(dir.path) == std::vector<std::string>{"model-0006.ckpt", "model-0007.ckpt"});
}

TEST_CASE("a damaged newest checkpoint is reported with its name and why, and the previous one used") {
  TempDir dir;
  Trained t;
  tk::CheckpointManager m(dir.path, "model", 5);
  m.save(t.trainer, state_at(1), true);
  t.steps(2);
  m.save(t.trainer, state_at(2), true);
  const auto good = testing::flat(*t.model);
  t.steps(2);
  m.save(t.trainer, state_at(3), true);
  const std::string newest = dir / "model-0002.ckpt";
  const std::string bytes = read_bytes(newest);

  struct Damage {
    const char* name;
    std::string bytes;
    const char* why;
  };
  std::string flipped = bytes;
  flipped[flipped.size() / 2] = static_cast<char>(flipped[flipped.size() / 2] ^ 0x5a);
  const std::vector<Damage> damages = {
      {"truncated", bytes.substr(0, bytes.size() * 2 / 3), "truncated"},
      {"a flipped byte", flipped, "CRC-32"},
      {"empty", "", "truncated"},
      {"not an archive", std::string(4096, 'z'), "no end-of-directory record"},
  };
  for (const auto& d : damages) {
    CAPTURE(d.name);
    write_bytes(newest, d.bytes);
    std::string why;
    CHECK_FALSE(tk::CheckpointManager::is_complete(newest, &why));
    CHECK(why.find(d.why) != std::string::npos);
    Trained other;
    std::ostringstream report;
    const auto loaded = m.resume_newest(other.trainer, report);
    REQUIRE(loaded.has_value());
    CHECK(loaded->path == dir / "model-0001.ckpt");
    CHECK(torch::equal(testing::flat(*other.model), good));
    CHECK(report.str().find("skipping checkpoint '" + newest + "'") != std::string::npos);
    CHECK(report.str().find(d.why) != std::string::npos);
    CHECK(report.str().find("trying the previous one") != std::string::npos);
  }
  // A file written by Trainer::save alone (no loop state) is not a fit checkpoint.
  t.trainer.save(newest);
  std::string why;
  CHECK_FALSE(tk::CheckpointManager::is_complete(newest, &why));
  CHECK(why.find("not written by the fit loop") != std::string::npos);
}

TEST_CASE("another trainer type or other shapes: refused with the file's name, no fallback") {
  TempDir dir;
  Trained t;
  tk::CheckpointManager m(dir.path, "model", 5);
  m.save(t.trainer, state_at(1), true);
  m.save(t.trainer, state_at(2), true);
  SUBCASE("another trainer type") {
    auto model = make_mlp(30);
    tk::Trainer<> plain(model, tk::AdamW{1e-2});
    const std::string expected = "checkpoint '" + dir / "model-0001.ckpt" + "': written by Trainer<FP16Dynamic";
    CHECK_THROWS_WITH(m.resume_newest(plain), doctest::Contains(expected.c_str()));
  }
  SUBCASE("other shapes") {
    auto wider = make_mlp(31, 8, 32, 3);
    T other(wider, tk::AdamW{1e-2});
    const std::string expected = "checkpoint '" + dir / "model-0001.ckpt" + "': 'fc1.weight' has shape [16, 8]";
    CHECK_THROWS_WITH(m.resume_newest(other), doctest::Contains(expected.c_str()));
  }
}

namespace {

// Every record of `a` is in `b`, equal (tensors, values and nested archives); returns the
// tensors compared. (Files, not bytes: a blocking save writes a view's whole storage once, a
// staged one its own copy.)
int check_same_records(torch::serialize::InputArchive& a, torch::serialize::InputArchive& b) {
  auto ka = a.keys(), kb = b.keys();
  std::sort(ka.begin(), ka.end());
  std::sort(kb.begin(), kb.end());
  CHECK(ka == kb);
  int tensors = 0;
  for (const auto& key : ka) {
    CAPTURE(key);
    torch::Tensor ta, tb;
    if (a.try_read(key, ta, /*is_buffer=*/true)) {
      REQUIRE(b.try_read(key, tb, /*is_buffer=*/true));
      CHECK(torch::equal(ta, tb));
      ++tensors;
      continue;
    }
    torch::serialize::InputArchive na, nb;
    if (a.try_read(key, na)) {
      REQUIRE(b.try_read(key, nb));
      tensors += check_same_records(na, nb);
      continue;
    }
    c10::IValue va, vb;
    REQUIRE(a.try_read(key, va));
    REQUIRE(b.try_read(key, vb));
    std::ostringstream sa, sb;
    sa << va;
    sb << vb;
    if (key != "fit.path") CHECK(sa.str() == sb.str());  // (the file's own name)
  }
  return tensors;
}

// A staged checkpoint of `trainer` written after `change` ran, against a blocking save before it:
// the same records. Returns whether the records were staged as copies.
template <class Trainer>
bool staged_equals_blocking(Trainer& trainer, const std::function<void()>& change,
                            const std::vector<tk::CallbackState>& callbacks = {}) {
  TempDir a, b;
  tk::CheckpointManager blocking(a.path, "model", 5), background(b.path, "model", 5);
  blocking.save(trainer, state_at(1), true, callbacks);
  auto staged = background.stage(trainer, state_at(1), true, callbacks);
  const bool copied = staged.copied();
  change();
  staged.write();
  torch::serialize::InputArchive ra, rb;
  ra.load_from(a / "model-0000.ckpt");
  rb.load_from(b / "model-0000.ckpt");
  CHECK(check_same_records(ra, rb) >= 8);
  return copied;
}

}  // namespace

TEST_CASE("a staged checkpoint is the state as it was staged, whatever training does before it is written") {
  SUBCASE("trainkit's optimizer, inside a window: the records are copies") {
    Trained t;
    t.steps(3);  // (Accumulate<2>: a window open, its gradient and loss in the file)
    CHECK(staged_equals_blocking(t.trainer, [&] { t.steps(3); }));
  }
  SUBCASE("a model with buffers (batch norm's running statistics)") {
    torch::manual_seed(24);
    torch::nn::Sequential model(torch::nn::Linear(8, 16), torch::nn::BatchNorm1d(16), torch::nn::Linear(16, 3));
    tk::Trainer<> trainer{model, tk::AdamW{1e-2}};
    testing::Regression data = testing::regression(32);
    const auto steps = [&](int n) {
      for (int i = 0; i < n; ++i) trainer.micro_step([&] { return torch::mse_loss(model->forward(data.x), data.y); });
    };
    steps(2);
    CHECK(staged_equals_blocking(trainer, [&] { steps(3); }));
  }
  SUBCASE("on a GPU: the copies asynchronous into pinned memory, waited for once") {
    if (!torch::cuda::is_available()) {
      MESSAGE("skipped: no CUDA device (the device copies run where one is)");
      return;
    }
    testing::TinyMlp model = make_mlp(25, 8, 16, 3);
    model->to(torch::kCUDA);
    tk::Trainer<> trainer{model, tk::AdamW{1e-2}};
    testing::Regression data = testing::regression(32);
    const auto x = data.x.cuda(), y = data.y.cuda();
    const auto steps = [&](int n) {
      for (int i = 0; i < n; ++i) trainer.micro_step([&] { return torch::mse_loss(model(x), y); });
    };
    steps(2);
    CHECK(staged_equals_blocking(trainer, [&] { steps(3); }));
  }
  SUBCASE("master weights") {
    testing::TinyMlp model = make_mlp(22, 8, 16, 3);
    tk::Trainer<tk::PrecisionPolicy<tk::MasterWeights<tk::BF16>>> trainer{model, tk::AdamW{1e-2}};
    testing::Regression data = testing::regression(32);
    const auto steps = [&](int n) {
      for (int i = 0; i < n; ++i) trainer.micro_step([&] { return torch::mse_loss(model(data.x), data.y); });
    };
    steps(2);
    CHECK(staged_equals_blocking(trainer, [&] { steps(3); }));
  }
  SUBCASE("a torch::optim optimizer, or a callback's state: serialized when staged") {
    testing::TinyMlp model = make_mlp(23, 8, 16, 3);
    tk::Trainer<> trainer{model, std::make_shared<torch::optim::Adam>(model->parameters(), torch::optim::AdamOptions(1e-2))};
    testing::Regression data = testing::regression(32);
    const auto steps = [&](int n) {
      for (int i = 0; i < n; ++i) trainer.micro_step([&] { return torch::mse_loss(model(data.x), data.y); });
    };
    steps(2);
    CHECK(!staged_equals_blocking(trainer, [&] { steps(3); }));
    Trained t;
    auto ema = torch::ones({4});
    const tk::CallbackState state{"ema", [&](torch::serialize::OutputArchive& a) { a.write("ema", ema); },
                                  [](torch::serialize::InputArchive&) {}};
    CHECK(!staged_equals_blocking(t.trainer, [&] { ema.mul_(3); }, {state}));
  }
}

TEST_CASE("a full disk: a clear error naming the file and the step; the old checkpoints stay byte-identical") {
  // Blocking, the write's error stops the loop where it writes; in the background, at the
  // first micro-batch after the thread found it (or at the run's end, which waits for it).
  bool background = false;
  SUBCASE("blocking") {}
  SUBCASE("in the background") { background = true; }
  SmallTmpfs fs("256k");
  Trained t;
  if (!fs.ok) MESSAGE("mount(2) not permitted here: the full disk is simulated with RLIMIT_FSIZE");
  TempDir fallback;
  const std::string out = fs.ok ? fs.dir.path : fallback.path;
  tk::CheckpointManager m(out, "model", 5);
  m.save(t.trainer, state_at(1), true);
  const std::string old_path = out + "/model-0000.ckpt";
  const std::string old_bytes = read_bytes(old_path);
  REQUIRE(old_bytes.size() > 1000);
  t.steps(2);

  rlimit saved{};
  ::getrlimit(RLIMIT_FSIZE, &saved);
  auto previous_xfsz = std::signal(SIGXFSZ, SIG_IGN);
  // Through the fit loop, so that the message names the step: the disk fills up during epoch 0
  // (after the loop opened its logs), before the checkpoint of epoch 0 is written.
  testing::Regression data = testing::regression(32);
  tk::Task<int> task;
  task.batches_per_epoch = [](std::int64_t) { return std::int64_t{2}; };
  task.batch = [](std::int64_t, std::int64_t i) { return static_cast<int>(i); };
  task.loss = [&](const int&, tk::Metrics&) { return torch::mse_loss(t.model(data.x), data.y); };
  tk::Callbacks callbacks;
  callbacks.batch_end = [&](tk::BatchEnd& e) {
    if (e.epoch != 0 || e.index != 1) return;
    if (fs.ok) {
      fill(out);
    } else {
      rlimit small = saved;
      small.rlim_cur = 1000;
      REQUIRE(::setrlimit(RLIMIT_FSIZE, &small) == 0);
    }
  };
  std::string message;
  try {
    tk::fit(t.trainer, task,
            tk::FitOptions().output_path(out).end_epoch(3).auto_resume(false).log_frequent(1000).progress(false)
                .background_checkpoints(background),
            callbacks);
  } catch (const tk::CheckpointError& e) {
    message = e.what();
  }
  if (!fs.ok) ::setrlimit(RLIMIT_FSIZE, &saved);
  std::signal(SIGXFSZ, previous_xfsz);
  CAPTURE(message);
  CHECK(message.find("cannot write checkpoint '" + out + "/model-0000.ckpt'") != std::string::npos);
  CHECK(message.find(fs.ok ? "No space left on device" : "File too large") != std::string::npos);
  CHECK(message.find("(disk full?)") != std::string::npos);
  if (background) {
    CHECK(message.find("at epoch ") == 0);
    CHECK(message.find(" (written in the background)") != std::string::npos);
  } else {
    CHECK(message.find("at epoch 1, micro-batch 0 (optimizer step 2)") != std::string::npos);
  }
  CHECK(read_bytes(old_path) == old_bytes);  // the failed write of the same name changed nothing
  CHECK(tk::CheckpointManager::is_complete(old_path));
  for (const auto& name : names_in(out))
    CHECK(name.find(".tmp.") == std::string::npos);  // the temporary file was removed
  // Room again: the same run writes its checkpoints.
  ::unlink((out + "/filler").c_str());
  const auto r = tk::fit(t.trainer, task, tk::FitOptions().output_path(out).end_epoch(3).auto_resume(false).progress(false));
  CHECK(r.checkpoints.size() == 3);
}

TEST_CASE("a read-only output directory: a clear error; the old checkpoints stay byte-identical") {
  Trained t;
  SmallTmpfs fs("1m");
  if (fs.ok) {
    tk::CheckpointManager m(fs.dir.path, "model", 5);
    m.save(t.trainer, state_at(1), true);
    const std::string old_path = fs.dir / "model-0000.ckpt";
    const std::string old_bytes = read_bytes(old_path);
    REQUIRE(fs.remount_read_only());
    const std::string expected = "cannot write checkpoint '" + fs.dir / "model-0001.ckpt" + "'";
    CHECK_THROWS_WITH(m.save(t.trainer, state_at(2), true), doctest::Contains(expected.c_str()));
    CHECK_THROWS_WITH(m.save(t.trainer, state_at(2), true), doctest::Contains("not writable"));
    CHECK(read_bytes(old_path) == old_bytes);
  } else {
    MESSAGE("mount(2) not permitted here: only the directory-under-a-file case runs");
  }
  // An output path below a regular file cannot be created: the error names it.
  TempDir dir;
  write_bytes(dir / "file", "x");
  const std::string expected = "cannot create the output directory '" + dir / "file/out" + "'";
  CHECK_THROWS_WITH(tk::CheckpointManager(dir / "file/out").create_directory(), doctest::Contains(expected.c_str()));
}

TEST_CASE("every reader refuses a checkpoint with one flipped byte, naming the file, and changes nothing") {
  TempDir dir;
  Trained t;
  t.steps(2);
  const std::string path = dir / "model.ckpt";
  t.trainer.save(path);
  std::string bytes = read_bytes(path);
  bytes[bytes.size() / 2] = static_cast<char>(bytes[bytes.size() / 2] ^ 0x5a);  // inside a tensor's data
  write_bytes(path, bytes);

  Trained fresh;
  const auto before = testing::flat(*fresh.model);
  const std::string said = "checkpoint '" + path + "' is damaged: ";
  // Trainer::load (resume, the fit loop) ...
  CHECK_THROWS_WITH_AS(fresh.trainer.load(path), doctest::Contains(said.c_str()), std::runtime_error);
  CHECK_THROWS_WITH_AS(fresh.trainer.load(path), doctest::Contains("CRC-32"), std::runtime_error);
  CHECK(torch::equal(testing::flat(*fresh.model), before));
  CHECK(fresh.trainer.windows() == 0);
  // ... and the weights loader (NETWORK.PARTIAL_PRETRAIN), which loaded it without a word before.
  CHECK_THROWS_WITH_AS(tk::load_weights(*fresh.model, path), doctest::Contains(said.c_str()), std::runtime_error);
  CHECK(torch::equal(testing::flat(*fresh.model), before));
}

TEST_CASE("a checkpoint set: the records of one file; damage refused naming the file, or the previous set used; "
          "crashes and retention leave no stray file") {
  TempDir one, dir;
  Trained t;
  t.steps(3);  // (Accumulate<2>: a window open, its gradient and loss in the set)
  tk::CheckpointManager single(one.path, "model", 3), set(dir.path, "model", 2);
  set.set_format(tk::CheckpointFormat::sharded);
  CHECK(set.writes_set(t.trainer));
  CHECK_FALSE(single.writes_set(t.trainer));  // (automatic: one process shards nothing)
  const auto file = single.save(t.trainer, state_at(0, 3), false);
  const auto first = set.save(t.trainer, state_at(0, 3), false);
  const auto shard = [](const std::string& index) { return index + ".00000-of-00001.safetensors"; };
  REQUIRE(tk::detail::ShardSource::is_index(first));
  CHECK(names_in(dir.path) == std::vector<std::string>{"model-0000-000003.ckpt", "model-0000-000003.ckpt.00000-of-00001.safetensors",
                                                       "model-0000-000003.ckpt.records"});
  const auto tensors = testing::checkpoint_tensors(file);
  CHECK(tensors.size() >= 10);
  CHECK(testing::same_tensors(testing::checkpoint_tensors(first), tensors));
  std::string why;
  CHECK(tk::CheckpointManager::is_complete(first, &why));
  CHECK(why.empty());

  SUBCASE("resumed: the trainer's state, as from the file") {
    Trained fresh, from_file;
    const auto loaded = set.resume_newest(fresh.trainer);
    REQUIRE(loaded);
    CHECK(loaded->path == first);
    CHECK(loaded->state.position == tk::FitPosition{0, 3});
    single.load(from_file.trainer, file);
    CHECK(torch::equal(testing::flat(*fresh.model), testing::flat(*from_file.model)));
    fresh.steps(1), from_file.steps(1);  // (the open window's gradient came along)
    CHECK(torch::equal(testing::flat(*fresh.model), testing::flat(*from_file.model)));
    CHECK(fresh.trainer.windows() == from_file.trainer.windows());
  }
  SUBCASE("written in the background: the state at the pause") {
    t.steps(1);
    const auto reference = testing::checkpoint_tensors(single.save(t.trainer, state_at(0, 4), false));
    const auto staged = set.save_in_background(t.trainer, state_at(0, 4), false);
    t.steps(3);
    const auto written = set.wait_background();
    REQUIRE(written);
    CHECK(written->path == staged);
    CHECK(written->bytes == static_cast<std::size_t>(testing::file_size(staged) + testing::file_size(shard(staged)) +
                                                     testing::file_size(staged + ".records")));
    CHECK(testing::same_tensors(testing::checkpoint_tensors(staged), reference));
  }
  SUBCASE("written in the background, save after save: the copies cut from one region, sized from the state") {
    // (on a GPU the region is page-locked, allocated once; here the same path with pinned memory
    // off). Each save at the same point of a window (the open window's gradient is a record). A
    // set's pieces, and one file's records (each record a storage of its own: the archive writes
    // records of several dtypes).
    TempDir other;
    tk::CheckpointManager one_file(other.path, "model", 2);
    std::vector<std::size_t> region, outside, copied, state_bytes;
    std::size_t records = 0;
    for (int i = 0; i < 4; ++i) {
      t.steps(2);
      const auto file_now = single.save(t.trainer, state_at(0, 4 + i), false);
      const auto reference = testing::checkpoint_tensors(file_now);
      const auto staged = set.save_in_background(t.trainer, state_at(0, 4 + i), false);
      const auto staged_file = one_file.save_in_background(t.trainer, state_at(0, 4 + i), false);
      t.steps(2);  // (the state changes while they are written)
      REQUIRE(set.wait_background());
      REQUIRE(one_file.wait_background());
      CHECK(testing::same_tensors(testing::checkpoint_tensors(staged), reference));
      CHECK(testing::same_tensors(testing::checkpoint_tensors(staged_file), reference));
      if (i > 0) CHECK(one_file.staging().outside() == 0);
      std::size_t bytes = 0;
      for (const auto& [key, tensor] : reference) bytes += static_cast<std::size_t>(tensor.numel() * tensor.element_size());
      state_bytes.push_back(bytes);
      records = reference.size();
      region.push_back(set.staging().bytes());
      outside.push_back(set.staging().outside());
      copied.push_back(set.staging().wanted());
    }
    MESSAGE("the state's tensor records " << state_bytes[0] << " B (the generators' states among them, new tensors, "
            "not copies); copied " << copied[0] << " B a save; outside the region " << outside[0] << ", " << outside[1]
            << ", " << outside[2] << ", " << outside[3] << " B; the region " << region[0] << " B after each save");
    for (int i = 0; i < 4; ++i) {
      CAPTURE(i);
      CHECK(copied[i] == copied[0]);
      CHECK(copied[i] <= state_bytes[i]);
      CHECK(region[i] == region[0]);  // no growth
      if (i > 0) CHECK(outside[i] == 0);  // every copy cut from the region
    }
    CHECK(copied[0] > state_bytes[0] / 4);
    CHECK(outside[0] == copied[0]);  // the first save: new allocations, as before; the region after it
    CHECK(region[0] >= copied[0]);
    CHECK(region[0] < copied[0] + 64 * records);  // (each copy 64-byte aligned)
  }
  SUBCASE("a flipped byte in a rank's file: refused naming it, the trainer unchanged") {
    std::string bytes = read_bytes(shard(first));
    std::uint64_t header = 0;
    std::memcpy(&header, bytes.data(), 8);
    const auto at = 8 + header + 2;  // (in the first record: a parameter, which every reader reads)
    bytes[at] = static_cast<char>(bytes[at] ^ 0x5a);
    write_bytes(shard(first), bytes);
    Trained fresh;
    const auto before = testing::flat(*fresh.model);
    const std::string said = "checkpoint '" + shard(first) + "' is damaged: ";
    std::ostringstream report;
    CHECK_FALSE(set.resume_newest(fresh.trainer, report));  // (said, and no older set to go back to)
    CHECK(report.str().find("skipping checkpoint '" + first + "': " + said) != std::string::npos);
    CHECK_THROWS_WITH_AS(fresh.trainer.load(first), doctest::Contains("CRC-32"), std::runtime_error);
    CHECK(torch::equal(testing::flat(*fresh.model), before));
    CHECK(fresh.trainer.windows() == 0);
    CHECK_THROWS_WITH_AS(tk::load_weights(*fresh.model, first), doctest::Contains(said.c_str()), std::runtime_error);
    CHECK_FALSE(tk::CheckpointManager::is_complete(first, &why));
    CHECK(why.find(shard(first)) != std::string::npos);
  }
  SUBCASE("a flipped byte in the index or a piece, or a file missing: the set skipped, said, the previous one used") {
    t.steps(2);
    const auto second = set.save(t.trainer, state_at(0, 5), false);
    for (const std::string damage : {"index", "missing", "piece"}) {
      CAPTURE(damage);
      const std::string damaged = damage == "index" ? second : shard(second);
      const std::string bytes = read_bytes(damaged);
      std::string flipped = bytes;
      std::uint64_t header = 0;
      std::memcpy(&header, bytes.data(), 8);
      const auto at = damage == "index" ? flipped.find("\"elements\": ") + 12 : 8 + header + 2;
      flipped[at] = static_cast<char>(flipped[at] ^ 0x01);
      if (damage == "missing") ::unlink(damaged.c_str());
      else write_bytes(damaged, flipped);
      std::ostringstream report;
      // A damaged piece is found as it is read: resume_newest (and the fit loop) go back then.
      Trained fresh;
      const auto resumed = set.resume_newest(fresh.trainer, report);
      REQUIRE(resumed);
      CHECK(resumed->path == first);
      CHECK(report.str().find("skipping checkpoint '" + second + "'") != std::string::npos);
      CHECK(report.str().find(damage == "index" ? "its index fails its CRC-32"
                              : damage == "missing" ? "cannot be opened" : "fail their CRC-32") != std::string::npos);
      write_bytes(damaged, bytes);
    }
  }
  SUBCASE("a name written again, killed before its new index: the mixture of two saves is skipped, never loaded") {
    const std::string old_file = read_bytes(shard(first)), old_records = read_bytes(first + ".records");
    t.steps(2);
    REQUIRE(set.save(t.trainer, state_at(0, 3), false) == first);  // (the same name, a later state)
    for (const bool records : {false, true}) {
      CAPTURE(records);
      const std::string index = read_bytes(first);
      const std::string member = records ? first + ".records" : shard(first), now = read_bytes(member);
      write_bytes(member, records ? old_records : old_file);  // one file of the earlier save left
      // (the records file is checked as the set opens, a rank's file when it is first read)
      std::ostringstream report;
      Trained fresh;
      const auto before = testing::flat(*fresh.model);
      CHECK_FALSE(set.resume_newest(fresh.trainer, report));
      CHECK(torch::equal(testing::flat(*fresh.model), before));
      INFO(report.str());
      CHECK(report.str().find("skipping checkpoint '" + first + "'") != std::string::npos);
      // (the earlier save's file: its token, or already its size, differs from the index's)
      CHECK((report.str().find("belongs to another save") != std::string::npos ||
             report.str().find("the index says") != std::string::npos));
      write_bytes(member, now);
      CHECK(read_bytes(first) == index);
    }
  }
  SUBCASE("opened from its index alone: a rank's file is first touched, and checked, when its bytes are read") {
    // (W ranks each opening every file would be W^2 metadata operations on a shared file system)
    const std::string bytes = read_bytes(shard(first));
    ::unlink(shard(first).c_str());
    tk::detail::ShardSource source(first);  // (before: refused here, the file missing)
    CHECK(source.world_size() == 1);
    const auto records = source.records();
    REQUIRE_FALSE(records.empty());
    CHECK_THROWS_WITH_AS(source.read(records.front()),
                         doctest::Contains(("its file '" + shard(first) + "' cannot be opened").c_str()),
                         tk::detail::DamagedArchive);
    CHECK(source.verify().find("its file '" + shard(first) + "' cannot be opened") != std::string::npos);
    write_bytes(shard(first), bytes);
    CHECK(torch::equal(source.read(records.front()), testing::checkpoint_tensors(file).at(records.front())));
    CHECK(source.verify().empty());
  }
  SUBCASE("ranges read: into host memory straight, into a device's through two slots in turn (here the same path "
          "with pageable slots), reused from one read to the next") {
    tk::detail::ShardSource direct(first), staged(first);
    staged.stage_host_reads(true);
    const auto whole = testing::checkpoint_tensors(file);
    std::int64_t largest = 0;  // (bytes of the largest record: a chunk is at most one)
    const auto read_all = [&] {
      for (const auto& name : direct.records()) {
        CAPTURE(name);
        const auto expected = whole.at(name).reshape({-1});
        const auto n = expected.numel();
        largest = std::max<std::int64_t>(largest, n * static_cast<std::int64_t>(expected.element_size()));
        for (const auto& [from, length] : std::vector<std::pair<std::int64_t, std::int64_t>>{{0, n}, {n / 3, n - n / 3}, {1, n - 2}}) {
          if (length <= 0) continue;
          auto straight = torch::full({length}, -1, expected.options()), through = straight.clone();
          direct.read_range(name, from, length, straight);
          staged.read_range(name, from, length, through);
          CHECK(torch::equal(straight, expected.narrow(0, from, length)));
          CHECK(torch::equal(through, straight));
        }
      }
    };
    read_all();
    CHECK(direct.staging_bytes() == 0);
    const auto slots = staged.staging_bytes();
    CHECK(slots > 0);
    CHECK(slots <= 2 * largest);
    read_all();
    CHECK(staged.staging_bytes() == slots);
  }
  SUBCASE("killed between a set's files and its index: never loaded; removed by the next save, as retention removes whole sets") {
    // A later set's files without an index, and a killed writer's temporary.
    write_bytes(dir / "model-0000-000007.ckpt.00000-of-00002.safetensors", read_bytes(shard(first)));
    write_bytes(dir / "model-0000-000007.ckpt.records", read_bytes(first + ".records"));
    write_bytes(dir / "model-0000-000007.ckpt.00001-of-00002.safetensors.tmp.999999999", "left by a killed process");
    const auto opened = set.open_newest();
    REQUIRE(opened);
    CHECK(opened->path == first);
    // A save before their position leaves them (they could be another rank's, in flight) ...
    t.steps(2);
    set.save(t.trainer, state_at(0, 5), false);
    CHECK(names_in(dir.path).size() == 9);
    // ... the next ones after it remove them, and keep 2 whole sets.
    for (const std::int64_t index : {9, 11}) {
      t.steps(2);
      set.save(t.trainer, state_at(0, index), false);
    }
    CHECK(names_in(dir.path) == std::vector<std::string>{
                                    "model-0000-000009.ckpt", "model-0000-000009.ckpt.00000-of-00001.safetensors",
                                    "model-0000-000009.ckpt.records", "model-0000-000011.ckpt",
                                    "model-0000-000011.ckpt.00000-of-00001.safetensors", "model-0000-000011.ckpt.records"});
  }
}

}  // namespace test_checkpoint
