#!/usr/bin/env bash
# Compile-time figures: a cold build of the main job's program (ccache off, 2 jobs) with each
# translation unit's time and object size, and a user's one-file program against plain
# <torch/torch.h>: each file's compile command (-O2, no precompiled header, ccache off) run
# alone 3 times, interleaved, CPU seconds (user + sys) and their median.
#
#   benchmarks/compile_times.sh [WORK_DIR]     (default /tmp/trainkit-compile-times; emptied)
#
# Prints markdown tables. Needs nothing but scripts/setup's LibTorch. Takes ~15 minutes here.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
WORK="${1:-/tmp/trainkit-compile-times}"
TORCH_PREFIX="$("$ROOT/scripts/setup" | tail -n 1)"
export CCACHE_DISABLE=1
rm -rf "$WORK"
mkdir -p "$WORK"

flags=(-G Ninja -DCMAKE_BUILD_TYPE=Release "-DCMAKE_CXX_FLAGS_RELEASE=-O2 -DNDEBUG"
       "-DCMAKE_PREFIX_PATH=$TORCH_PREFIX")

# Object time (ninja's log, ms) and size for every object of a build tree.
table() {
  local build="$1"
  echo "| translation unit | compile s | object MB |"
  echo "|---|---|---|"
  awk 'NR > 1 && $4 ~ /\.(o|gch)$/ { printf "%s %.1f\n", $4, ($2 - $1) / 1000 }' "$build/.ninja_log" |
    while read -r obj secs; do
      size=$(stat -c %s "$build/$obj" 2>/dev/null || echo 0)
      printf "| %s | %s | %.2f |\n" "${obj#*.dir/}" "$secs" "$(echo "$size / 1048576" | bc -l)"
    done
}

# 1. The main job's program, cold.
cmake -S "$ROOT" -B "$WORK/main" "${flags[@]}" >"$WORK/main-configure.log" 2>&1
start=$(date +%s.%N)
cmake --build "$WORK/main" --parallel 2 --target example_vlbert >"$WORK/main-build.log" 2>&1
end=$(date +%s.%N)
echo "## example_vlbert, cold (ccache off, -j2): $(printf '%.0f' "$(echo "$end - $start" | bc -l)") s wall"
echo
table "$WORK/main"
echo

# 2. A user's one-file program: plain torch, the umbrella header alone, the README's example.
mkdir -p "$WORK/user/src"
cat >"$WORK/user/src/plain_torch.cpp" <<'EOF'
#include <torch/torch.h>
int main() {
  torch::nn::Linear model(16, 1);
  torch::optim::AdamW optimizer(model->parameters(), torch::optim::AdamWOptions(1e-2));
  const auto x = torch::randn({256, 16}), y = x.sum(1, true);
  for (int i = 0; i < 8; ++i) {
    optimizer.zero_grad();
    torch::mse_loss(model(x), y).backward();
    optimizer.step();
  }
}
EOF
cat >"$WORK/user/src/trainkit_header.cpp" <<'EOF'
#include <trainkit/trainkit.hpp>
#include <torch/torch.h>
int main() {
  torch::nn::Linear model(16, 1);
  torch::optim::AdamW optimizer(model->parameters(), torch::optim::AdamWOptions(1e-2));
  const auto x = torch::randn({256, 16}), y = x.sum(1, true);
  for (int i = 0; i < 8; ++i) {
    optimizer.zero_grad();
    torch::mse_loss(model(x), y).backward();
    optimizer.step();
  }
}
EOF
# The README's example, as ctest's readme.example compiles it.
awk '/<!-- example -->/{on=1; next} /<!-- \/example -->/{on=0} on && /^```cpp/{code=1; next} on && /^```/{code=0; next} code' \
  "$ROOT/README.md" >"$WORK/user/src/readme_example.cpp"
# The same program with its trainer from the registry (make_trainer, trainkit::registry).
cat >"$WORK/user/src/registry_user.cpp" <<'EOF'
#include <trainkit/trainkit.hpp>
#include <torch/torch.h>
namespace tk = trainkit;
int main() {
  torch::nn::Linear model(16, 1);
  const auto x = torch::randn({256, 16}), y = x.sum(1, true);
  tk::OptimizerSettings adamw;
  adamw.name = "AdamW", adamw.lr = 1e-2, adamw.weight_decay = 1e-4;
  const auto trainer = tk::make_trainer({tk::PrecisionKind::FP16Dynamic, 4, tk::ClipKind::ClipNorm}, model.ptr(),
                                        adamw, tk::TrainerOptions().max_grad_norm(1.0));
  for (int epoch = 0; epoch < 20; ++epoch) {
    for (int i = 0; i < 256; i += 32) {
      auto xb = x.narrow(0, i, 32), yb = y.narrow(0, i, 32);
      auto r = trainer->micro_step([&] { return torch::mse_loss(model(xb), yb); });
      if (r.window_closed && epoch % 5 == 0 && i == 96) std::printf("loss %.4f\n", r.report.loss());
    }
    trainer->flush();
  }
}
EOF
# The same two programs including the one header they need (<trainkit/trainer/trainer.hpp>,
# <trainkit/run/registry.hpp>) instead of the umbrella, and the README's example in the compiled mode
# (trainkit::compiled: TRAINKIT_COMPILED_LIB, the non-template definitions in a library). The
# registry's users are in the compiled mode whatever they include (trainkit::registry links it).
cp "$WORK/user/src/readme_example.cpp" "$WORK/user/src/readme_compiled.cpp"
sed 's|<trainkit/trainkit.hpp>|<trainkit/trainer/trainer.hpp>|' "$WORK/user/src/readme_example.cpp" >"$WORK/user/src/trainer_hpp_compiled.cpp"
sed 's|<trainkit/trainkit.hpp>|<trainkit/run/registry.hpp>|' "$WORK/user/src/registry_user.cpp" >"$WORK/user/src/registry_hpp_user.cpp"
cat >"$WORK/user/CMakeLists.txt" <<EOF
cmake_minimum_required(VERSION 3.18)
project(user LANGUAGES CXX)
add_subdirectory("$ROOT" trainkit)
foreach(name plain_torch trainkit_header readme_example readme_compiled trainer_hpp_compiled registry_user
             registry_hpp_user)
  add_executable(\${name} src/\${name}.cpp)
  target_link_libraries(\${name} PRIVATE trainkit::trainkit)
endforeach()
target_link_libraries(readme_compiled PRIVATE trainkit::compiled)
target_link_libraries(trainer_hpp_compiled PRIVATE trainkit::compiled)
target_link_libraries(registry_user PRIVATE trainkit::registry)
target_link_libraries(registry_hpp_user PRIVATE trainkit::registry)
EOF
cmake -S "$WORK/user" -B "$WORK/user/build" "${flags[@]}" >"$WORK/user-configure.log" 2>&1
# Objects first (the registry's shards too), so that the commands below find their headers' build.
cmake --build "$WORK/user/build" --parallel 2 >"$WORK/user-build.log" 2>&1
names=(plain_torch trainkit_header readme_example readme_compiled trainer_hpp_compiled registry_user registry_hpp_user)
for name in "${names[@]}"; do
  (cd "$WORK/user/build" && ninja -t commands "$name" | grep -- " -c .*src/$name.cpp" | head -n 1) >"$WORK/cmd_$name.sh"
done
for rep in 1 2 3; do
  for name in "${names[@]}"; do
    (cd "$WORK/user/build" && /usr/bin/time -f "$name %U %S" bash "$WORK/cmd_$name.sh" 2>&1 >/dev/null | tail -n 1)
  done
done >"$WORK/user-cpu.txt"
echo "## a user's one-file program (ccache off, -O2, no precompiled header): CPU s (user + sys), 3 runs"
echo
echo "| file | CPU s | median | / plain torch |"
echo "|---|---|---|---|"
python3 - "$WORK/user-cpu.txt" <<'EOF'
import statistics, sys
runs = {}
for line in open(sys.argv[1]):
    name, user, system = line.split()
    runs.setdefault(name, []).append(float(user) + float(system))
plain = statistics.median(runs["plain_torch"])
for name, t in runs.items():
    print(f"| {name} | {', '.join(f'{x:.1f}' for x in t)} | {statistics.median(t):.1f} | {statistics.median(t) / plain:.2f} |")
EOF
