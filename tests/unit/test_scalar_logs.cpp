// Scalar logs: the CSV and JSON-lines files, appending, buffering, the fan-out, and the errors
// of an unwritable path or a full disk (/dev/full).
#include "../support/helpers.hpp"

#include <trainkit/log/scalars.hpp>

#include <algorithm>
#include <fstream>
#include <sstream>

namespace test_scalar_logs {  // this file's names, apart from those of the files it shares a unity batch with

namespace {

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream text;
  text << in.rdbuf();
  return text.str();
}

const double nan = std::numeric_limits<double>::quiet_NaN();
const double inf = std::numeric_limits<double>::infinity();

template <class Writer>
void write_examples(Writer& writer) {
  writer.add_scalar(tk::scalar_tags::train_loss, 0.25, 12, 1733150000.123456);
  writer.add_scalar(tk::scalar_tags::lr_group(0), 0.1, 12, 1733150000.5);
  writer.add_scalar(tk::scalar_tags::validation("Acc"), nan, 13, 1.0);
  writer.add_scalar("loss-scale", inf, 14, 2.0);
  writer.add_scalar("grad-para/Total-Norm", -inf, -1, 3.0);
  writer.add_scalar("a,\"b\"\n", 1e300, 15, 4.0);
}

}  // namespace

TEST_CASE("scalar tags: the names the fit loop logs") {
  CHECK(std::string(tk::scalar_tags::train_loss) == "Train-Loss");
  CHECK(tk::scalar_tags::lr_group(2) == "LR/Group_2");
  CHECK(std::string(tk::scalar_tags::grad_norm) == "grad-para/Total-Norm");
  CHECK(tk::scalar_tags::validation("Acc") == "Val-Acc");
  CHECK(std::string(tk::scalar_tags::loss_scale) == "loss-scale");
  CHECK(std::string(tk::scalar_tags::skipped_steps) == "skipped-steps");
  CHECK(std::string(tk::scalar_tags::samples_per_second) == "samples-per-second");
}

TEST_CASE("CsvScalarWriter: header, one line per scalar, quoting, non-finite values") {
  testing::TempDir dir;
  const std::string path = dir / "logs/scalars.csv";  // the directory is created
  {
    tk::CsvScalarWriter csv(path);
    write_examples(csv);
  }
  CHECK(read_file(path) ==
        "step,tag,value,wall_time\n"
        "12,Train-Loss,0.25,1733150000.123456\n"
        "12,LR/Group_0,0.10000000000000001,1733150000.500000\n"
        "13,Val-Acc,nan,1.000000\n"
        "14,loss-scale,inf,2.000000\n"
        "-1,grad-para/Total-Norm,-inf,3.000000\n"
        "15,\"a,\"\"b\"\"\n\",1.0000000000000001e+300,4.000000\n");
}

TEST_CASE("JsonlScalarWriter: one object per line, escaping, non-finite values as strings") {
  testing::TempDir dir;
  const std::string path = dir / "scalars.jsonl";
  {
    tk::JsonlScalarWriter jsonl(path);
    write_examples(jsonl);
    jsonl.add_scalar("t\\ab\x01", 1.5, 16, 5.0);
  }
  CHECK(read_file(path) ==
        "{\"step\":12,\"tag\":\"Train-Loss\",\"value\":0.25,\"wall_time\":1733150000.123456}\n"
        "{\"step\":12,\"tag\":\"LR/Group_0\",\"value\":0.10000000000000001,"
        "\"wall_time\":1733150000.500000}\n"
        "{\"step\":13,\"tag\":\"Val-Acc\",\"value\":\"NaN\",\"wall_time\":1.000000}\n"
        "{\"step\":14,\"tag\":\"loss-scale\",\"value\":\"Infinity\",\"wall_time\":2.000000}\n"
        "{\"step\":-1,\"tag\":\"grad-para/Total-Norm\",\"value\":\"-Infinity\","
        "\"wall_time\":3.000000}\n"
        "{\"step\":15,\"tag\":\"a,\\\"b\\\"\\u000a\",\"value\":1.0000000000000001e+300,"
        "\"wall_time\":4.000000}\n"
        "{\"step\":16,\"tag\":\"t\\\\ab\\u0001\",\"value\":1.5,\"wall_time\":5.000000}\n");
  // Every line is JSON that nlohmann reads back to the written double.
  std::istringstream lines(read_file(path));
  std::string line;
  std::getline(lines, line);
  const auto first = nlohmann::json::parse(line);
  CHECK(first["value"].get<double>() == 0.25);
  std::getline(lines, line);
  CHECK(nlohmann::json::parse(line)["value"].get<double>() == 0.1);
}

TEST_CASE("text logs: append by default (one header), truncate on request") {
  testing::TempDir dir;
  const std::string path = dir / "scalars.csv";
  for (int run = 0; run < 2; ++run) {
    tk::CsvScalarWriter csv(path);
    csv.add_scalar("x", run, run, 0.0);
  }
  CHECK(read_file(path) == "step,tag,value,wall_time\n0,x,0,0.000000\n1,x,1,0.000000\n");
  tk::TextLogOptions options;
  options.append = false;
  {
    tk::CsvScalarWriter csv(path, options);
    csv.add_scalar("x", 2, 2, 0.0);
  }
  CHECK(read_file(path) == "step,tag,value,wall_time\n2,x,2,0.000000\n");
}

TEST_CASE("text logs: buffered until every_records, flush() or close()") {
  testing::TempDir dir;
  const std::string path = dir / "scalars.jsonl";
  tk::TextLogOptions options;
  options.flush.every_records = 2;
  options.flush.every_seconds = 1e9;
  tk::JsonlScalarWriter jsonl(path, options);
  jsonl.add_scalar("x", 1, 1, 0.0);
  CHECK(testing::file_size(path) == 0);
  jsonl.add_scalar("x", 2, 2, 0.0);
  const long two = testing::file_size(path);
  CHECK(two > 0);
  jsonl.add_scalar("x", 3, 3, 0.0);
  CHECK(testing::file_size(path) == two);
  jsonl.flush();
  CHECK(testing::file_size(path) > two);
  // every_seconds = 0: every record is written at once.
  options.flush.every_seconds = 0;
  options.flush.every_records = 1000;
  tk::CsvScalarWriter csv(dir / "now.csv", options);
  csv.add_scalar("x", 1, 1, 0.0);
  CHECK(read_file(dir / "now.csv") == "step,tag,value,wall_time\n1,x,1,0.000000\n");
}

TEST_CASE("drop_points_after: the trailing points past a step and a torn last line go, nothing else") {
  testing::TempDir dir;
  const auto write = [](const std::string& path, std::int64_t from, std::int64_t to) {
    tk::JsonlScalarWriter jsonl(path);
    for (std::int64_t step = from; step <= to; ++step) {
      jsonl.add_scalar("a", 1.0, step, 0.0);
      jsonl.add_scalar("b", 2.0, step, 0.0);
    }
  };
  const std::string path = dir / "scalars.jsonl";
  CHECK(tk::drop_points_after(path, 3) == 0);  // no file yet: nothing to do
  // An earlier run (steps 1..9), then a run that logged steps 1..7 and died in a line.
  write(path, 1, 9);
  write(path, 1, 7);
  { std::ofstream(path, std::ios::app) << "{\"step\":8,\"ta"; }
  const std::string text = read_file(path);
  CHECK(tk::drop_points_after(path, 4) == 2 * 3 + 1);
  const std::string kept = read_file(path);
  CHECK(kept == text.substr(0, kept.size()));
  CHECK(kept.size() < text.size());
  CHECK(kept.substr(kept.rfind('{')) == "{\"step\":4,\"tag\":\"b\",\"value\":2,\"wall_time\":0.000000}\n");
  CHECK(std::count(kept.begin(), kept.end(), '\n') == 2 * 9 + 2 * 4);  // the earlier run is whole
  CHECK(tk::drop_points_after(path, 4) == 0);  // idempotent
  // CSV: the header is not a point and stops the scan.
  const std::string csv_path = dir / "scalars.csv";
  {
    tk::CsvScalarWriter csv(csv_path);
    for (std::int64_t step = 1; step <= 5; ++step) csv.add_scalar("a", 1.0, step, 0.0);
  }
  CHECK(tk::drop_points_after(csv_path, 2) == 3);
  CHECK(read_file(csv_path) == "step,tag,value,wall_time\n1,a,1,0.000000\n2,a,1,0.000000\n");
  CHECK(tk::drop_points_after(csv_path, 0) == 2);
  CHECK(read_file(csv_path) == "step,tag,value,wall_time\n");
}

TEST_CASE("ScalarFanout: one wall time for all sinks, each sink called despite another's error") {
  tk::ScalarFanout fanout;
  auto& a = fanout.emplace<tk::ScalarRecorder>();
  auto& b = fanout.emplace<tk::ScalarRecorder>();
  fanout.add_scalar("Train-Loss", 1.5, 3);
  REQUIRE(a.scalars().size() == 1);
  REQUIRE(b.scalars().size() == 1);
  CHECK(a.scalars()[0].wall_time == b.scalars()[0].wall_time);
  CHECK(a.scalars()[0].wall_time > 1.5e9);  // stamped with the Unix time
  CHECK(a.scalars()[0].tag == "Train-Loss");
  CHECK(a.scalars()[0].step == 3);
  CHECK(a.scalars()[0].value == 1.5);

  // A full disk in the first sink: the error reaches the caller, the second sink still records.
  tk::ScalarFanout failing;
  tk::TextLogOptions at_once;
  at_once.flush.every_records = 1;
  failing.emplace<tk::CsvScalarWriter>("/dev/full", at_once);
  auto& recorder = failing.emplace<tk::ScalarRecorder>();
  CHECK_THROWS_WITH_AS(failing.add_scalar("x", 1, 1), doctest::Contains("'/dev/full'"),
                       std::runtime_error);
  CHECK(recorder.scalars().size() == 1);
}

TEST_CASE("text logs: a full disk or an unwritable path is an error naming the file") {
  {
    tk::JsonlScalarWriter full("/dev/full");
    full.add_scalar("x", 1, 1, 0.0);  // buffered
    CHECK_THROWS_WITH_AS(full.flush(), "trainkit: cannot write JSON-lines log '/dev/full': No space left on device",
                         std::runtime_error);
    CHECK_THROWS_AS(full.close(), std::runtime_error);
  }  // the destructor does not report the error a second time, nor throw
  testing::TempDir dir;
  { std::ofstream(dir / "file") << "x"; }
  const std::string below_file = dir / "file/scalars.csv";
  CHECK_THROWS_WITH_AS(tk::CsvScalarWriter{below_file},
                       doctest::Contains(("'" + dir / "file" + "'").c_str()), std::runtime_error);
  if (::geteuid() != 0) {
    const std::string read_only = dir / "read-only";
    REQUIRE(::mkdir(read_only.c_str(), 0555) == 0);
    CHECK_THROWS_WITH_AS(tk::CsvScalarWriter{read_only + "/scalars.csv"},
                         doctest::Contains("Permission denied"), std::runtime_error);
  } else {
    MESSAGE("running as root: the read-only-directory case is not checked (root ignores 0555)");
  }
}

}  // namespace test_scalar_logs
