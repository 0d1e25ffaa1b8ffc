#!/usr/bin/env python3
"""ctest benchmarks.compare_same_losses: the comparison compares like with like.

Runs every implementation (trainkit, branching, libtorch: `compare`; python: loop.py, when a
Python with torch is given) for a few FP32 windows of the MLP (N = 2) and of a small BERT-tiny
(N = 1) and checks that they compute the same losses, window for window: same model, same
initial weights, same data, the same optimizer arithmetic. Not a timing test.

    check_same_losses.py COMPARE [PYTHON]
"""
import json
import os
import subprocess
import sys

CASES = [
    ["--model", "mlp", "--accum", "2", "--windows", "3", "--warmup", "0"],
    ["--model", "bert-tiny", "--micro-batch", "1", "--seq", "8", "--accum", "1", "--windows", "2", "--warmup", "0"],
]


def run(cmd):
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    if p.returncode != 0:
        sys.exit(f"FAILED: {' '.join(cmd)}\n{p.stderr}")
    return json.loads(p.stdout.strip().splitlines()[-1])["losses"]


def main():
    compare = sys.argv[1]
    python = sys.argv[2] if len(sys.argv) > 2 else ""
    loop = os.path.join(os.path.dirname(os.path.abspath(__file__)), "loop.py")
    have_python = bool(python) and subprocess.run([python, "-c", "import torch"], capture_output=True).returncode == 0
    if not have_python:
        print(f"note: no Python with torch ({python or 'none given'}); checking the C++ implementations only")
    bad = 0
    for case in CASES:
        common = case + ["--precision", "fp32", "--threads", "1"]
        losses = {impl: run([compare, "--impl", impl, "--bandwidth", "0"] + common)
                  for impl in ("trainkit", "branching", "libtorch")}
        if have_python:
            losses["python"] = run([python, loop] + common)
        reference = losses["trainkit"]
        for impl, values in losses.items():
            same = len(values) == len(reference) and all(
                abs(a - b) <= 1e-5 * max(1.0, abs(b)) for a, b in zip(values, reference))
            print(f"{case[1]:10s} {impl:10s} {'same' if same else 'DIFFERENT'}: {values}")
            bad += not same
    if bad:
        sys.exit(f"{bad} implementation(s) computed other losses than trainkit")


if __name__ == "__main__":
    main()
