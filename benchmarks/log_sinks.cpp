// The cost of logging one scalar through each of trainkit's sinks, against writing the same
// line with fprintf (what a hand-rolled logger does), and the file bytes each scalar takes.
// Prints a table; ratios are against fprintf measured in the same run. Median of `runs`.
//   build/benchmarks/log_sinks [scalars per run = 200000] [runs = 5]
#include <trainkit/log/progress.hpp>
#include <trainkit/log/scalars.hpp>
#include <trainkit/log/tensorboard.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include <sys/stat.h>
#include <unistd.h>

namespace {

const std::vector<std::string> tags = {"Train-Loss",   "LR/Group_0",    "grad-para/Total-Norm",
                                       "loss-scale",   "skipped-steps", "samples-per-second",
                                       "Val-Acc"};

double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

long size_of(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0 ? static_cast<long>(st.st_size) : 0;
}

struct Result {
  double ns_per_scalar;
  double bytes_per_scalar;
};

/// Times `n` scalars into a fresh sink made by `make` in `dir` (closing it included).
Result time_sink(const std::function<std::unique_ptr<trainkit::ScalarSink>(const std::string&)>& make,
                 const std::function<long(const std::string&)>& bytes, const std::string& dir,
                 long n) {
  const auto start = std::chrono::steady_clock::now();
  {
    auto sink = make(dir);
    for (long i = 0; i < n; ++i) sink->add_scalar(tags[i % 7], 1.0 / (i + 1), i / 7);
    sink->close();
  }
  const double seconds = seconds_since(start);
  return {seconds / n * 1e9, static_cast<double>(bytes(dir)) / n};
}

}  // namespace

int main(int argc, char** argv) {
  const long n = argc > 1 ? std::atol(argv[1]) : 200000;
  const int runs = argc > 2 ? std::atoi(argv[2]) : 5;
  char pattern[] = "/tmp/trainkit-log-bench-XXXXXX";
  const std::string root = ::mkdtemp(pattern);

  struct Case {
    const char* name;
    std::function<Result(const std::string&)> run;
  };
  int counter = 0;
  const auto fresh = [&] { return root + "/" + std::to_string(counter++); };
  std::vector<Case> cases = {
      {"fprintf CSV line (baseline)",
       [&](const std::string& dir) {
         ::mkdir(dir.c_str(), 0755);
         const std::string path = dir + "/plain.csv";
         const auto start = std::chrono::steady_clock::now();
         std::FILE* f = std::fopen(path.c_str(), "w");
         for (long i = 0; i < n; ++i)
           std::fprintf(f, "%ld,%s,%.17g,%.6f\n", i / 7, tags[i % 7].c_str(), 1.0 / (i + 1),
                        1.7e9);
         std::fclose(f);
         return Result{seconds_since(start) / n * 1e9, double(size_of(path)) / n};
       }},
      {"ScalarRecorder (memory)",
       [&](const std::string& dir) {
         return time_sink([](const std::string&) { return std::make_unique<trainkit::ScalarRecorder>(); },
                          [](const std::string&) { return 0L; }, dir, n);
       }},
      {"CsvScalarWriter",
       [&](const std::string& dir) {
         return time_sink(
             [](const std::string& d) { return std::make_unique<trainkit::CsvScalarWriter>(d + "/s.csv"); },
             [](const std::string& d) { return size_of(d + "/s.csv"); }, dir, n);
       }},
      {"JsonlScalarWriter",
       [&](const std::string& dir) {
         return time_sink(
             [](const std::string& d) { return std::make_unique<trainkit::JsonlScalarWriter>(d + "/s.jsonl"); },
             [](const std::string& d) { return size_of(d + "/s.jsonl"); }, dir, n);
       }},
      {"TensorBoardWriter",
       [&](const std::string& dir) {
         std::string path;
         return time_sink(
             [&](const std::string& d) {
               auto w = std::make_unique<trainkit::TensorBoardWriter>(d);
               path = w->path();
               return w;
             },
             [&](const std::string&) { return size_of(path); }, dir, n);
       }},
      {"ScalarFanout(TB + CSV + JSONL)",
       [&](const std::string& dir) {
         std::string path;
         return time_sink(
             [&](const std::string& d) {
               auto f = std::make_unique<trainkit::ScalarFanout>();
               path = f->emplace<trainkit::TensorBoardWriter>(d).path();
               f->emplace<trainkit::CsvScalarWriter>(d + "/s.csv");
               f->emplace<trainkit::JsonlScalarWriter>(d + "/s.jsonl");
               return f;
             },
             [&](const std::string& d) {
               return size_of(path) + size_of(d + "/s.csv") + size_of(d + "/s.jsonl");
             },
             dir, n);
       }},
  };

  std::printf("%ld scalars per run, median of %d runs, files in %s\n\n", n, runs, root.c_str());
  std::printf("| sink | ns / scalar | vs fprintf | bytes / scalar |\n|---|---|---|---|\n");
  double baseline = 0;
  for (const auto& c : cases) {
    std::vector<Result> results;
    for (int r = 0; r < runs; ++r) results.push_back(c.run(fresh()));
    std::sort(results.begin(), results.end(),
              [](const Result& a, const Result& b) { return a.ns_per_scalar < b.ns_per_scalar; });
    const Result median = results[results.size() / 2];
    if (baseline == 0) baseline = median.ns_per_scalar;
    std::printf("| %s | %.0f | %.2fx | %.1f |\n", c.name, median.ns_per_scalar,
                median.ns_per_scalar / baseline, median.bytes_per_scalar);
  }

  // The progress line's update() when nothing is drawn (the per-step cost the fit loop pays).
  std::ostringstream sink;
  trainkit::ProgressOptions options;
  options.out = &sink;
  options.terminal = false;
  options.every_seconds = 1e9;
  std::vector<double> per_update;
  for (int r = 0; r < runs; ++r) {
    trainkit::ProgressLine progress(options);
    trainkit::ProgressState state;
    state.total = n;
    const auto start = std::chrono::steady_clock::now();
    for (long i = 0; i < n; ++i) {
      state.step = i;
      state.samples = 32 * i;
      progress.update(state);
    }
    per_update.push_back(seconds_since(start) / n * 1e9);
  }
  std::sort(per_update.begin(), per_update.end());
  std::printf("\nProgressLine::update, not drawn: %.0f ns\n", per_update[per_update.size() / 2]);
  std::string command = "rm -rf " + root;
  return std::system(command.c_str()) == 0 ? 0 : 1;
}
