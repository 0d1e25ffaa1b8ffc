// TensorBoard event files: CRC-32C, the protobuf and TFRecord bytes of one event against a
// hand-computed expectation, the writer's file, and its errors. (TensorBoard's own reader reads
// the files back in the ctest tensorboard.read_back.)
#include "../support/helpers.hpp"

#include <trainkit/log/tensorboard.hpp>

#include <dirent.h>
#include <sys/stat.h>

#include <fstream>
#include <sstream>

namespace test_tensorboard {  // this file's names, apart from those of the files it shares a unity batch with

namespace {

std::string bytes(std::initializer_list<int> values) {
  std::string out;
  for (const int v : values) out.push_back(static_cast<char>(v));
  return out;
}

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream text;
  text << in.rdbuf();
  return text.str();
}

std::vector<std::string> list_dir(const std::string& dir) {
  std::vector<std::string> names;
  if (DIR* d = ::opendir(dir.c_str())) {
    while (const dirent* e = ::readdir(d)) {
      const std::string name = e->d_name;
      if (name != "." && name != "..") names.push_back(name);
    }
    ::closedir(d);
  }
  std::sort(names.begin(), names.end());
  return names;
}

std::uint64_t little_endian(const std::string& s, std::size_t at, int n) {
  std::uint64_t v = 0;
  for (int i = n - 1; i >= 0; --i) v = (v << 8) | static_cast<unsigned char>(s[at + i]);
  return v;
}

/// Splits a TFRecord file into its records' data, checking every length and CRC.
std::vector<std::string> read_records(const std::string& file) {
  std::vector<std::string> records;
  std::size_t at = 0;
  while (at < file.size()) {
    REQUIRE(file.size() - at >= 12);
    const auto length = little_endian(file, at, 8);
    CHECK(little_endian(file, at + 8, 4) == tk::detail::masked_crc32c(file.substr(at, 8)));
    REQUIRE(file.size() - at >= 16 + length);
    records.push_back(file.substr(at + 12, length));
    CHECK(little_endian(file, at + 12 + length, 4) == tk::detail::masked_crc32c(records.back()));
    at += 16 + length;
  }
  return records;
}

}  // namespace

TEST_CASE("crc32c: known vectors (RFC 3720 B.4, the check value) and the TFRecord mask") {
  using tk::detail::crc32c;
  CHECK(crc32c("") == 0u);
  CHECK(crc32c("123456789") == 0xE3069283u);
  CHECK(crc32c(std::string(32, '\0')) == 0x8A9136AAu);
  CHECK(crc32c(std::string(32, '\xff')) == 0x62A8AB43u);
  std::string ascending, descending;
  for (int i = 0; i < 32; ++i) {
    ascending.push_back(static_cast<char>(i));
    descending.push_back(static_cast<char>(31 - i));
  }
  CHECK(crc32c(ascending) == 0x46DD794Eu);
  CHECK(crc32c(descending) == 0x113FDB5Cu);
  CHECK(tk::detail::crc32c_extend(crc32c("1234"), "56789") == 0xE3069283u);
  // ((0xE3069283 >> 15) | (0xE3069283 << 17)) + 0xa282ead8, mod 2^32
  CHECK(tk::detail::masked_crc32c("123456789") == 0xC78AB0E5u);
}

TEST_CASE("event encoding: one scalar event, byte for byte") {
  // Event{wall_time 1.5, step 3, summary{value{tag "Loss", simple_value 0.5}}}
  const std::string event = tk::detail::encode_scalar_event(1.5, 3, "Loss", 0.5f);
  const std::string expected =
      bytes({0x09, 0, 0, 0, 0, 0, 0, 0xF8, 0x3F,  // field 1, fixed64: 1.5 = 0x3FF8000000000000
             0x10, 0x03,                          // field 2, varint: step 3
             0x2A, 0x0D,                          // field 5, 13 bytes: Summary
             0x0A, 0x0B,                          //   field 1, 11 bytes: Value
             0x0A, 0x04, 'L', 'o', 's', 's',      //     field 1, "Loss"
             0x15, 0, 0, 0, 0x3F});               //     field 2, fixed32: 0.5f = 0x3F000000
  CHECK(event == expected);

  std::string record;
  tk::detail::append_tfrecord(record, event);
  // Length 26 as uint64 LE; the CRCs from TensorBoard's Python masked_crc32c for these bytes.
  const std::string framed = bytes({26, 0, 0, 0, 0, 0, 0, 0, 0x12, 0x9B, 0xD8, 0x2D}) + expected +
                             bytes({0x5E, 0x99, 0x29, 0xB2});
  CHECK(record == framed);
}

TEST_CASE("event encoding: the file-version event, negative and long varints") {
  CHECK(tk::detail::encode_file_version_event(0.0) ==
        bytes({0x09, 0, 0, 0, 0, 0, 0, 0, 0, 0x1A, 13}) + "brain.Event:2");
  std::string varint;
  tk::detail::put_int64(varint, 2, -1);
  CHECK(varint == bytes({0x10, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0x01}));
  varint.clear();
  tk::detail::put_varint(varint, 300);
  CHECK(varint == bytes({0xAC, 0x02}));
  // A 200-byte tag: the lengths around it take two varint bytes. Value: key, length 200 (2),
  // tag, float field = 1 + 2 + 200 + 5 = 208; Summary: 1 + 2 + 208 = 211 = 0xD3 0x01.
  const std::string tag(200, 't');
  const std::string event = tk::detail::encode_scalar_event(0.0, 1, tag, 1.0f);
  CHECK(event.substr(11, 3) == bytes({0x2A, 0xD3, 0x01}));
  CHECK(event.substr(14, 3) == bytes({0x0A, 0xD0, 0x01}));
  CHECK(event.size() == 9 + 2 + 3 + 211);
}

TEST_CASE("TensorBoardWriter: one file in the log directory, version record first, then scalars") {
  testing::TempDir dir;
  const std::string log_dir = dir / "runs/a";  // created with its parent
  std::string path;
  {
    tk::TensorBoardWriter writer(log_dir);
    path = writer.path();
    writer.add_scalar(tk::scalar_tags::train_loss, 0.25, 7, 1000.0);
    writer.add_scalar(tk::scalar_tags::lr_group(1), 1e-3, 7, 1000.0);
  }  // the destructor flushes
  const auto names = list_dir(log_dir);
  REQUIRE(names.size() == 1);
  CHECK(log_dir + "/" + names[0] == path);
  char host[256] = {};
  ::gethostname(host, sizeof host - 1);
  CHECK(names[0].rfind("events.out.tfevents.", 0) == 0);
  CHECK(names[0].find(std::string(".") + host) != std::string::npos);

  const auto records = read_records(read_file(path));
  REQUIRE(records.size() == 3);
  CHECK(records[0].substr(9) == bytes({0x1A, 13}) + "brain.Event:2");
  CHECK(records[1] == tk::detail::encode_scalar_event(1000.0, 7, "Train-Loss", 0.25f));
  CHECK(records[2] == tk::detail::encode_scalar_event(1000.0, 7, "LR/Group_1", 1e-3f));
}

TEST_CASE("TensorBoardWriter: buffered until the flush policy, flush() or close()") {
  testing::TempDir dir;
  tk::TensorBoardOptions options;
  options.flush.every_records = 3;
  options.flush.every_seconds = 1e9;
  tk::TensorBoardWriter writer(dir.path, options);
  const long version_only = testing::file_size(writer.path());
  CHECK(version_only > 0);  // written at construction
  writer.add_scalar("a", 1, 1);
  writer.add_scalar("a", 2, 2);
  CHECK(testing::file_size(writer.path()) == version_only);
  writer.add_scalar("a", 3, 3);
  const long three = testing::file_size(writer.path());
  CHECK(three > version_only);
  writer.add_scalar("a", 4, 4);
  CHECK(testing::file_size(writer.path()) == three);
  writer.flush();
  CHECK(testing::file_size(writer.path()) > three);
  CHECK(read_records(read_file(writer.path())).size() == 5);
  writer.close();
  writer.close();  // idempotent
}

TEST_CASE("TensorBoardWriter: two writers in one directory in the same second get two files") {
  testing::TempDir dir;
  tk::TensorBoardWriter first(dir.path), second(dir.path);
  CHECK(first.path() != second.path());
  CHECK(list_dir(dir.path).size() == 2);
  tk::TensorBoardOptions options;
  options.filename_suffix = ".rank1";
  tk::TensorBoardWriter third(dir.path, options);
  CHECK(third.path().find(".rank1") != std::string::npos);
}

TEST_CASE("TensorBoardWriter: an unwritable log directory is an error naming it") {
  testing::TempDir dir;
  // A log directory below a regular file cannot be created, for root too.
  { std::ofstream(dir / "file") << "x"; }
  const std::string below_file = dir / "file/runs";
  CHECK_THROWS_WITH_AS(tk::TensorBoardWriter{below_file},
                       doctest::Contains(("'" + below_file + "'").c_str()), std::runtime_error);
  CHECK_THROWS_WITH_AS(tk::TensorBoardWriter{below_file}, doctest::Contains("Not a directory"),
                       std::runtime_error);
  // A read-only directory: root writes through the permission bits, so only others see it fail.
  const std::string read_only = dir / "read-only";
  REQUIRE(::mkdir(read_only.c_str(), 0555) == 0);
  if (::geteuid() == 0) {
    MESSAGE("running as root: the read-only-directory case is not checked (root ignores 0555)");
  } else {
    CHECK_THROWS_WITH_AS(tk::TensorBoardWriter{read_only},
                         doctest::Contains(("TensorBoard event file '" + read_only + "/events").c_str()),
                         std::runtime_error);
  }
}

}  // namespace test_tensorboard
