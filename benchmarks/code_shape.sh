#!/usr/bin/env bash
# The shape of the tree, for notes and reviews: headers and lines per folder of include/trainkit/,
# the largest headers, and the branches on the sharding mode in storage/.
#
#   benchmarks/code_shape.sh [REV]      (REV: a git revision to measure instead of the work tree)
#
# A branch on the mode is a line of include/trainkit/storage/ that branches (if, ?:, while) on
# one of the predicates that name a mode: the stage-3 schedule's pointer (units_, not the
# schedule's own list units_[u]), sharded(),
# shards_gradients(), a Sharding:: value, single_process_, communicates(), sharded_units().
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if (($#)); then
  TREE="$(mktemp -d)"
  trap 'rm -rf "$TREE"' EXIT
  git -C "$ROOT" archive "$1" include | tar -x -C "$TREE"
else
  TREE="$ROOT"
fi
cd "$TREE/include/trainkit"

echo "| folder | headers | lines | largest |"
echo "|---|---|---|---|"
for d in . $(find . -mindepth 1 -maxdepth 1 -type d | sort); do
  files="$(find "$d" -maxdepth 1 -name '*.hpp' | sort)"
  [[ -n "$files" ]] || continue
  n="$(echo "$files" | wc -l)"
  lines="$(cat $files | wc -l)"
  largest="$(wc -l $files | grep -v ' total$' | sort -rn | head -1 | awk '{print $2 " (" $1 ")"}')"
  echo "| ${d#./} | $n | $lines | ${largest#./} |"
done
echo
echo "Headers over 600 lines: $(find . -name '*.hpp' -exec wc -l {} + | grep -v ' total$' | awk '$1 > 600 {printf "%s (%d) ", $2, $1}')"
echo
predicates='units_([^[a-z_]|$)|\bsharded\(\)|shards_gradients\(\)|Sharding::|single_process_|communicates\(\)|sharded_units\(\)'
branches='\bif \(|\? |\bwhile \('
count="$(grep -rEn "$branches" storage | grep -E "$predicates" | grep -vE '^\S+:\s*///|^\S+:[0-9]+:\s*//' | wc -l)"
echo "Branches on the sharding mode in storage/: $count"
grep -rEn "$branches" storage | grep -E "$predicates" | grep -vE '^\S+:[0-9]+:\s*//' | awk -F: '{print $1}' | sort | uniq -c | sort -rn
