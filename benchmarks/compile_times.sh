#!/usr/bin/env bash
# Compile-time figures.
#   1. A cold build of the main job's program (ccache off, 2 jobs) with each translation unit's
#      time and object size.
#   2. A user's one-file program against plain <torch/torch.h>: each file's compile command (-O2,
#      no precompiled header, ccache off) run alone 3 times, interleaved, CPU seconds (user + sys)
#      and their median.
#   3. Edit and rebuild: the guide's your-model program (docs/guide/your-model.md: tk::fit,
#      checkpoints, validation; data parallel under torchrun added as the data-parallel guide says)
#      against the same training written as a plain torch::optim loop
#      (benchmarks/compile_times/plain_loop.cpp), each rebuilt after touching its one file
#      (compile and link, the libraries and precompiled headers built before), 3 runs
#      interleaved, in each way a user can build it: header-only, trainkit::compiled, with
#      trainkit::precompiled, and with its trainer from trainkit::registry (extern templates).
#
#   benchmarks/compile_times.sh [--edit-only] [--source DIR] [WORK_DIR]
#     --edit-only   section 3 alone (~10 minutes here)
#     --source DIR  section 3 with the headers and CMake of another checkout of trainkit (its
#                   figures before a change); its missing targets are left out
#     WORK_DIR      default /tmp/trainkit-compile-times (emptied)
#
# Prints markdown tables. Needs nothing but scripts/setup's LibTorch. Takes ~25 minutes here.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
EDIT_ONLY=0
SOURCE="$ROOT"
while [[ $# -gt 0 ]]; do
  case "$1" in
    --edit-only) EDIT_ONLY=1; shift ;;
    --source) SOURCE="$(cd "$2" && pwd)"; shift 2 ;;
    -*) echo "compile_times.sh: unknown option $1" >&2; exit 2 ;;
    *) break ;;
  esac
done
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

if [[ $EDIT_ONLY == 0 ]]; then
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
fi

# 3. Edit and rebuild: the guide's your-model program against a plain loop.
EDIT="$WORK/edit"
mkdir -p "$EDIT/src"
cp "$ROOT/benchmarks/compile_times/plain_loop.cpp" "$EDIT/src/plain_loop.cpp"
awk '/<!-- example -->/{on=1; next} /<!-- \/example -->/{on=0} on && /^```cpp/{code=1; next} on && /^```/{code=0; next} code' \
  "$ROOT/docs/guide/your-model.md" >"$EDIT/src/guide.cpp"
python3 - "$EDIT/src" <<'EOF'
import sys
src = sys.argv[1]
s = open(f"{src}/guide.cpp").read()
# Data parallel under torchrun, as the data-parallel guide says (a ProcessGroup, DataParallel).
s = s.replace("#include <trainkit/trainkit.hpp>\n",
              "#include <trainkit/trainkit.hpp>\n#include <trainkit/parallel/data_parallel.hpp>\n#include <cstdlib>\n", 1)
made = "  Trainer trainer(model, tk::AdamW{3e-3, 1e-4}, tk::TrainerOptions().max_grad_norm(1.0));\n"
assert made in s, "the guide's trainer line changed: update benchmarks/compile_times.sh"
s = s.replace(made, made + "  if (std::getenv(\"WORLD_SIZE\"))  // under torchrun: data parallel\n"
              "    trainer.set_replicas(std::make_shared<tk::DataParallel>(tk::ProcessGroup::create()));\n", 1)
open(f"{src}/your_model.cpp", "w").write(s)
# The same with a registered type: the window length in the options (trainkit::registry's
# explicit instantiations, declared extern in the user's file).
fixed = "tk::AccumulationPolicy<kAccumulate>"
assert fixed in s
d = s.replace(fixed, "tk::AccumulationPolicy<tk::Dynamic>", 1)
d = d.replace("tk::TrainerOptions().max_grad_norm(1.0)", "tk::TrainerOptions().max_grad_norm(1.0).accumulation_steps(kAccumulate)", 1)
open(f"{src}/your_model_registry.cpp", "w").write(d)
EOF
cat >"$EDIT/CMakeLists.txt" <<EOF
cmake_minimum_required(VERSION 3.18)
project(edit LANGUAGES CXX)
add_subdirectory("$SOURCE" trainkit)
add_executable(plain_loop src/plain_loop.cpp)
target_link_libraries(plain_loop PRIVATE torch)
add_executable(plain_loop_pch src/plain_loop.cpp)
target_link_libraries(plain_loop_pch PRIVATE torch)
target_precompile_headers(plain_loop_pch PRIVATE <torch/torch.h>)
add_executable(header_only src/your_model.cpp)
target_link_libraries(header_only PRIVATE trainkit::trainkit)
add_executable(compiled src/your_model.cpp)
target_link_libraries(compiled PRIVATE trainkit::compiled)
add_executable(registry src/your_model_registry.cpp)
target_link_libraries(registry PRIVATE trainkit::registry)
if(TARGET trainkit::precompiled)
  add_executable(compiled_precompiled src/your_model.cpp)
  target_link_libraries(compiled_precompiled PRIVATE trainkit::compiled trainkit::precompiled)
  add_executable(registry_precompiled src/your_model_registry.cpp)
  target_link_libraries(registry_precompiled PRIVATE trainkit::registry trainkit::precompiled)
endif()
EOF
cmake -S "$EDIT" -B "$EDIT/build" "${flags[@]}" >"$WORK/edit-configure.log" 2>&1
targets=(plain_loop plain_loop_pch header_only compiled registry compiled_precompiled registry_precompiled)
ninja -C "$EDIT/build" -t targets all >"$WORK/edit-targets.txt"
present=()
for t in "${targets[@]}"; do
  if grep -q "^$t:" "$WORK/edit-targets.txt"; then present+=("$t"); fi
done
cmake --build "$EDIT/build" --parallel 2 >"$WORK/edit-build.log" 2>&1
# Each program trains (the plain loop as the guide's does: two runs, the second resumed).
for t in "${present[@]}"; do
  mkdir -p "$EDIT/run_$t"
  (cd "$EDIT/run_$t" && "$EDIT/build/$t" >"$WORK/edit-run-$t.log" 2>&1) ||
    { echo "compile_times.sh: $t did not train (see $WORK/edit-run-$t.log)" >&2; exit 1; }
done
for rep in 1 2 3; do
  for t in "${present[@]}"; do
    case $t in plain*) file=plain_loop.cpp ;; registry*) file=your_model_registry.cpp ;; *) file=your_model.cpp ;; esac
    touch "$EDIT/src/$file"
    /usr/bin/time -f "$t %e %U %S" cmake --build "$EDIT/build" --target "$t" 2>&1 >/dev/null | tail -n 1
  done
done >"$WORK/edit-times.txt"
echo "## edit and rebuild: the guide's your-model program (touched, compiled, linked; -O2, ccache off), 3 runs"
echo
echo "source: $SOURCE ($(git -C "$SOURCE" rev-parse --short HEAD 2>/dev/null || echo '?'))"
echo
echo "| program | wall s | median | CPU s median | / plain loop (CPU) |"
echo "|---|---|---|---|---|"
python3 - "$WORK/edit-times.txt" <<'EOF'
import statistics, sys
wall, cpu = {}, {}
for line in open(sys.argv[1]):
    name, w, user, system = line.split()
    wall.setdefault(name, []).append(float(w))
    cpu.setdefault(name, []).append(float(user) + float(system))
plain = statistics.median(cpu["plain_loop"])
for name in wall:
    c = statistics.median(cpu[name])
    print(f"| {name} | {', '.join(f'{x:.1f}' for x in wall[name])} | {statistics.median(wall[name]):.1f} | {c:.1f} | {c / plain:.2f} |")
EOF
