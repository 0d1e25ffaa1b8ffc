#!/usr/bin/env python3
"""Runs the comparison and prints it as markdown (benchmarks/run_all.sh calls this).

Every (model, precision, accumulation, implementation) is its own process, so its peak resident
memory is its own; the processes of one repetition run one configuration after another with the
implementations in a rotating order, and repetitions follow each other, so that a change of load
on the machine hits every implementation alike. Figures are medians: of the windows inside a
process, then over the repetitions.

Implementations: trainkit (the compiled Trainer), branching (the same step with run-time policy
switches), libtorch (the hand-written LibTorch loop), python (loop.py on the same torch wheel).
Optional (--impls ...,NAME): python-fused, python-compile (torch.compile(model) + fused AdamW) and
fwdbwd (the windows' forward + backward alone, from which, with the optimizer phase's floor, the
limit of a window follows).
Needs only the Python standard library; loop.py runs under --python (the project's venv).
"""
import argparse
import atexit
import datetime
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

IMPLS = ["trainkit", "branching", "libtorch", "python"]
# Optional (--impls ...,python-fused): the Python loop with torch.optim.AdamW(fused=True), the
# opt-in fused kernel, to show how much of the difference is the update kernel alone.
# python-compile: what a speed-conscious user runs, torch.compile(model) (default mode) with
# torch.optim.AdamW(fused=True). fwdbwd: the windows' micro-steps alone (compare --impl fwdbwd),
# for the limit of a window: forward + backward + the optimizer phase's floor.
# trainkit-limit: trainkit with its forward + backward alone timed after each window in the same
# process (compare --interleave-fwdbwd 1), the limit paired window by window.
OPTIONAL = ["python-fused", "python-compile", "fwdbwd", "trainkit-limit"]
# Only for the time tables (not the memory sweep, not the operator counts).
TIMING_ONLY = ["branching", "python-fused", "python-compile", "fwdbwd", "trainkit-limit"]
# Per process: micro-steps to time (ceil(budget / N) windows) and warm-up windows. The MLP's
# windows are short and noisy, so it gets many.
BUDGET = {"mlp": (40, 3), "bert-tiny": (8, 1), "bert-8x512": (4, 1)}
# FP16 on a CPU without fp16 arithmetic (no AVX512-FP16 / AMX-FP16) runs its matrix products
# about 40x slower than fp32; to keep the run bounded, FP16 BERT runs use micro-batches of
# (sequences, tokens) below, in every implementation alike. The window is then dominated by
# those products; the optimizer phase is the same size as in FP32.
FP16_CPU_BATCH = {"bert-tiny": (1, 16), "bert-8x512": (1, 8)}
# ... and time 2 micro-steps' worth of windows per process (those products run at ~3 GFLOP/s).
FP16_CPU_BUDGET = 2
# python-compile: warm-up windows per process. The first compiles; while other compilations ran
# on this 2-core VM, the windows after it were seen at ~300 ms (MLP) for a few seconds, eager
# ATen calls in them included, so a few more windows pass before timing (cheap for the MLP).
# Their times are reported apart (loop.py's warmup_ms), never in the medians.
COMPILE_WARMUP = {"mlp": 30, "bert-tiny": 4, "bert-8x512": 3}


def load():
    return "%.2f %.2f %.2f" % os.getloadavg()


def machine():
    cpu = "unknown CPU"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return f"{platform.node()}: {cpu}, {os.cpu_count()} cores, {mem:.0f} GiB, {platform.system()} {platform.release()}"


class Runner:
    def __init__(self, args):
        self.args = args
        self.raw = open(args.raw, "w") if args.raw else None
        self.failures = []
        # torch.compile's on-disk caches (Inductor's FX graph and kernel caches, AOTAutograd's)
        # start empty in every driver run, so the first python-compile process of a (model,
        # precision) compiles from nothing and the later ones find its kernels: both are reported.
        self.inductor_cache = tempfile.mkdtemp(prefix="trainkit-inductor-")
        atexit.register(shutil.rmtree, self.inductor_cache, True)
        self.compiled = set()

    def run(self, impl, model, precision, accum, micro_batch=0, windows=None, warmup=None, extra=()):
        budget, u = BUDGET[model]
        slow_fp16 = precision.startswith("fp16") and model in FP16_CPU_BATCH and not self.args.full_fp16
        if slow_fp16:
            budget = FP16_CPU_BUDGET
        w = windows if windows is not None else max(1, round(-(-budget // accum) * self.args.scale))
        if impl == "python-compile" and warmup is None:
            u = COMPILE_WARMUP[model]
        u = warmup if warmup is not None else u
        common = ["--model", model, "--precision", precision, "--accum", str(accum),
                  "--windows", str(w), "--warmup", str(u), "--threads", str(self.args.threads)]
        seq = 0
        if slow_fp16:
            micro_batch, seq = FP16_CPU_BATCH[model]
        if micro_batch:
            common += ["--micro-batch", str(micro_batch)]
        if seq:
            common += ["--seq", str(seq)]
        common += list(extra)
        env = None
        if impl in ("python", "python-fused", "python-compile"):
            cmd = [self.args.python, os.path.join(self.args.here, "loop.py")] + common
            if impl == "python-fused":
                cmd.append("--fused")
            if impl == "python-compile":
                cmd += ["--compile", "--fused"]
                env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=self.inductor_cache)
        elif impl == "trainkit-limit":
            cmd = [self.args.compare, "--impl", "trainkit", "--interleave-fwdbwd", "1"] + common
        else:
            cmd = [self.args.compare, "--impl", impl] + common
        cold = impl == "python-compile" and (model, precision) not in self.compiled
        try:
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=self.args.timeout, env=env)
            if p.returncode != 0:
                raise RuntimeError(p.stderr.strip().splitlines()[-1] if p.stderr.strip() else f"exit {p.returncode}")
            rec = json.loads(p.stdout.strip().splitlines()[-1])
        except Exception as e:  # one failing process must not lose the others' figures
            self.failures.append(f"{' '.join(cmd)}: {e}")
            print(f"[driver] FAILED {impl} {model} {precision} N={accum}: {e}", file=sys.stderr)
            return None
        if impl == "python-compile":
            self.compiled.add((model, precision))
            rec["cold_cache"] = cold
        if self.raw:
            self.raw.write(json.dumps(rec) + "\n")
            self.raw.flush()
        return rec


def med(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def fmt(v, digits=2):
    return "n/a" if v is None else f"{v:.{digits}f}"


def ratio(a, b):
    return None if a is None or b is None or b == 0 else a / b


def main():
    here = os.path.dirname(os.path.abspath(__file__))
    root = os.path.dirname(os.path.dirname(here))
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--compare", default=os.path.join(root, "build", "benchmarks", "compare", "compare"))
    ap.add_argument("--python", default=os.path.join(root, ".venv", "bin", "python"))
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=int(os.environ.get("TRAINKIT_BENCH_THREADS", "2")))
    ap.add_argument("--models", default="mlp,bert-tiny,bert-8x512")
    ap.add_argument("--precisions", default="fp32,bf16,fp16",
                    help="also bf16master, fp16master: trainkit's master weights (trainkit only)")
    ap.add_argument("--accums", default="1,4")
    ap.add_argument("--impls", default=",".join(IMPLS))
    ap.add_argument("--scale", type=float, default=1.0, help="multiplies the timed windows per process")
    ap.add_argument("--sweep", default="bert-tiny:16", help="MODEL:EFFECTIVE_BATCH for the memory table, or 'none'")
    ap.add_argument("--full-fp16", action="store_true",
                    help="FP16 at the models' default micro-batch (slow on CPUs without fp16 arithmetic)")
    ap.add_argument("--count-ops", type=int, default=1, help="1: also count the ATen calls of each phase")
    ap.add_argument("--timeout", type=int, default=600)
    ap.add_argument("--raw", default="", help="also write every process's JSON line to this file")
    args = ap.parse_args()
    args.here = here
    models, precisions = args.models.split(","), args.precisions.split(",")
    accums = [int(a) for a in args.accums.split(",")]
    impls = args.impls.split(",")
    runner = Runner(args)

    started = time.time()
    load_start = load()
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    configs = [(m, p, n) for m in models for p in precisions for n in accums]
    records = {}  # (model, precision, accum, impl) -> [record per repetition]
    for rep in range(args.reps):
        for c, (m, p, n) in enumerate(configs):
            shift = (rep + c) % len(impls)
            for impl in impls[shift:] + impls[:shift]:
                if p.endswith("master") and impl != "trainkit":
                    continue  # master weights: a trainkit mode the others do not have
                rec = runner.run(impl, m, p, n)
                if rec:
                    rec["_rep"] = rep
                    records.setdefault((m, p, n, impl), []).append(rec)
            print(f"[driver] repetition {rep + 1}/{args.reps}, configuration {c + 1}/{len(configs)} "
                  f"({m} {p} N={n}) done at {time.time() - started:.0f} s", file=sys.stderr)
        print(f"[driver] repetition {rep + 1}/{args.reps} done after {time.time() - started:.0f} s, load {load()}",
              file=sys.stderr)

    # ATen operator calls per optimizer phase: separate, short runs (counting costs time).
    op_counts = {}
    if args.count_ops:
        for m in models:
            for p in [p for p in precisions if p in ("fp32", "fp16")]:
                for impl in [i for i in impls if i in ("trainkit", "branching", "libtorch")]:
                    rec = runner.run(impl, m, p, 1, windows=2, warmup=1, extra=["--count-ops", "1", "--bandwidth", "0"])
                    if rec and rec.get("phase_ops"):
                        op_counts[(m, p, impl)] = statistics.median(rec["phase_ops"])

    sweep = []
    if args.sweep != "none":
        sm, eff = args.sweep.split(":")
        eff = int(eff)
        if eff % 8:
            ap.error(f"--sweep {args.sweep}: the effective batch must be a multiple of 8 (N = 1, 2, 4, 8)")
        for n in (1, 2, 4, 8):
            row = {}
            for impl in [i for i in impls if i not in TIMING_ONLY]:
                row[impl] = runner.run(impl, sm, "fp32", n, micro_batch=eff // n, windows=2, warmup=1)
            sweep.append((n, eff // n, row))

    def fig(key, field):
        recs = records.get(key, [])
        return med([statistics.median(r[field]) for r in recs if r[field]])

    def paired(key, impl, field):
        """Median over the repetitions of impl / trainkit, each repetition's pair measured back to
        back (so a slow change of load cancels out), of the per-process medians."""
        mine = {r["_rep"]: statistics.median(r[field]) for r in records.get(key + (impl,), []) if r[field]}
        tk = {r["_rep"]: statistics.median(r[field]) for r in records.get(key + ("trainkit",), []) if r[field]}
        return med([mine[k] / tk[k] for k in mine if k in tk and tk[k] > 0])

    def over_floor(key):
        """trainkit's phase over the floor measured in the same process, median over processes."""
        return med([statistics.median(r["phase_ms"]) / r["floor_ms"]
                    for r in records.get(key + ("trainkit",), []) if r["phase_ms"] and r["floor_ms"] > 0])

    def per_rep(key, value):
        """Median over the repetitions of value(records of this repetition, by implementation)."""
        reps = {}
        for (m, p, n, i), rs in records.items():
            if (m, p, n) == key:
                for r in rs:
                    reps.setdefault(r["_rep"], {})[i] = r
        return med([value(rs) for rs in reps.values()])

    def over_limit(key, step="floor_ms"):
        """trainkit's window over fwdbwd's window + the optimizer phase's floor (the floor from
        the trainkit process, as in trainkit / floor), or + fwdbwd's fused AdamW step
        (step="adamw_ms"), each repetition's own processes."""
        def value(rs):
            tk, fb = rs.get("trainkit"), rs.get("fwdbwd")
            if not tk or not fb or not tk["window_ms"] or not fb["window_ms"]:
                return None
            extra = (tk if step == "floor_ms" else fb).get(step, 0.0)
            return statistics.median(tk["window_ms"]) / (statistics.median(fb["window_ms"]) + extra) if extra else None
        return per_rep(key, value)

    def over_limit_paired(key):
        """trainkit-limit: each window over the forward + backward timed right after it in the
        same process plus that process's floor; median over the windows, then the processes."""
        return med([statistics.median([w / (f + r["floor_ms"]) for w, f in zip(r["window_ms"], r["fwdbwd_ms"])])
                    for r in records.get(key + ("trainkit-limit",), [])
                    if r.get("fwdbwd_ms") and r["floor_ms"] > 0])

    def hwm(key):
        return med([r["vmhwm_kib"] / 1024 for r in records.get(key, [])])

    shown = IMPLS + [i for i in OPTIONAL if i in impls]
    fused = "python-fused" in impls
    everything = [r for rs in records.values() for r in rs] + [r for _, _, row in sweep for r in row.values() if r]
    torch_version = next((r.get("torch") for r in everything if r.get("torch")), "?")
    out = []
    out.append(f"Date: {date}. Machine: {machine()}.")
    out.append(f"torch {torch_version} (the same wheel for LibTorch and Python), {args.threads} intra-op threads in "
               f"every implementation (torch::set_num_threads / torch.set_num_threads; TRAINKIT_BENCH_THREADS).")
    out.append(f"Load average at start {load_start}, at end {load()}; {args.reps} repetitions, interleaved; "
               f"{time.time() - started:.0f} s in all.")
    busy = max(float(load_start.split()[0]), float(load().split()[0]))
    if busy > 0.5 * (os.cpu_count() or 1):
        out.append(f"**The machine was loaded (load average up to {busy:.1f} on {os.cpu_count()} cores): other "
                   "processes took CPU time from these runs, so single timings are inflated and noisy; read the "
                   "ratios as rough.**")
    out.append("Command: `benchmarks/run_all.sh` (= `python3 benchmarks/compare/driver.py "
               + " ".join(sys.argv[1:]) + "`).")
    out.append("")

    if args.reps > 0:  # timing runs were made
        out.append("### Time per optimizer step (one whole window), ms, median")
        out.append("")
        out.append("Ratios here and below: the median over the repetitions of each repetition's own pair (the "
                   "processes of one repetition run back to back, so a change of load cancels out); they need "
                   "not equal the ratio of the medians shown. trainkit / floor: each process's phase over the "
                   "floor measured in that process.")
        out.append("")
        if not args.full_fp16:
            out.append("FP16 BERT rows use micro-batches of " + ", ".join(
                f"{b} x {t} tokens ({m})" for m, (b, t) in FP16_CPU_BATCH.items()) +
                " (this CPU has no fp16 arithmetic: fp16 matrix products are ~40x slower than fp32); "
                "the other rows use the models' defaults (bert-tiny 4 x 64, bert-8x512 4 x 32, MLP 32 samples).")
            out.append("")
        out.append("| model | precision | N | trainkit | branching | hand-written LibTorch | Python | LibTorch / trainkit | Python / trainkit | branching / trainkit |"
                   + (" Python, fused AdamW | its / trainkit |" if fused else ""))
        out.append("|---|---|---|---|---|---|---|---|---|---|" + ("---|---|" if fused else ""))
        for m, p, n in configs:
            t = {i: fig((m, p, n, i), "window_ms") for i in shown}
            out.append(f"| {m} | {p} | {n} | {fmt(t['trainkit'])} | {fmt(t['branching'])} | {fmt(t['libtorch'])} | "
                       f"{fmt(t['python'])} | {fmt(paired((m, p, n), 'libtorch', 'window_ms'))}x | "
                       f"{fmt(paired((m, p, n), 'python', 'window_ms'))}x | {fmt(paired((m, p, n), 'branching', 'window_ms'), 3)}x |"
                       + (f" {fmt(t['python-fused'])} | {fmt(paired((m, p, n), 'python-fused', 'window_ms'))}x |" if fused else ""))
        out.append("")

        out.append("### Optimizer phase alone (unscale + clip + update + zero), ms, median")
        out.append("")
        out.append("Floor: 32 bytes per parameter (AdamW reads p, g, m, v and writes p, m, v; zeroing writes g) over the "
                   "copy bandwidth measured in each C++ process at the model's size.")
        out.append("")
        out.append("| model | precision | N | params | copy GB/s | floor | trainkit | trainkit / floor | hand-written LibTorch | LibTorch / trainkit | Python | Python / trainkit |"
                   + (" Python, fused AdamW | its / trainkit |" if fused else ""))
        out.append("|---|---|---|---|---|---|---|---|---|---|---|---|" + ("---|---|" if fused else ""))
        floors = {}
        for m, p, n in configs:
            cpp = [r for i in ("trainkit", "branching", "libtorch") for r in records.get((m, p, n, i), [])]
            gbs = med([r["copy_gbs"] for r in cpp if r["copy_gbs"] > 0])
            fl = med([r["floor_ms"] for r in cpp if r["floor_ms"] > 0])
            params = cpp[0]["params"] if cpp else None
            t = {i: fig((m, p, n, i), "phase_ms") for i in shown}
            floors[(m, p, n)] = fl
            out.append(f"| {m} | {p} | {n} | {fmt(params / 1e6 if params else None)} M | {fmt(gbs, 1)} | {fmt(fl, 3)} | "
                       f"{fmt(t['trainkit'], 3)} | {fmt(over_floor((m, p, n)))}x | {fmt(t['libtorch'], 3)} | "
                       f"{fmt(paired((m, p, n), 'libtorch', 'phase_ms'))}x | {fmt(t['python'], 3)} | "
                       f"{fmt(paired((m, p, n), 'python', 'phase_ms'))}x |"
                       + (f" {fmt(t['python-fused'], 3)} | {fmt(paired((m, p, n), 'python-fused', 'phase_ms'))}x |" if fused else ""))
        out.append("")

        if "python-compile" in impls or "fwdbwd" in impls:
            out.append("### What a speed-conscious user runs, and the limit of a window, ms, median")
            out.append("")
            out.append("torch.compile: `torch.compile(model)` (default mode) and `torch.optim.AdamW(fused=True)` "
                       "(`loop.py --compile --fused`), the loss, scaler and optimizer eager; its warm-up windows "
                       "(compilation) are not in the median (next table). Limit: the windows' forward + backward "
                       "alone (`compare --impl fwdbwd`: the same micro-batches, autocast, loss / N and backward "
                       "into existing gradients, no optimizer phase) plus the optimizer phase's floor (32 bytes "
                       "per parameter over the copy bandwidth, as above, from the trainkit process). fused AdamW: "
                       "one at::_fused_adamw_ step and zeroing over the same parameter count in one flat tensor "
                       "(the fwdbwd process), the update as its kernel does it. Ratios: each repetition's own "
                       "processes, median over the repetitions.")
            out.append("")
            out.append("| model | precision | N | trainkit | torch.compile + fused AdamW | its / trainkit | fwd+bwd | "
                       "floor | limit (fwd+bwd + floor) | trainkit / limit | "
                       "fused AdamW step | trainkit / (fwd+bwd + fused AdamW) |")
            out.append("|---|---|---|---|---|---|---|---|---|---|---|---|")
            for m, p, n in configs:
                key = (m, p, n)
                tk_w = fig(key + ("trainkit",), "window_ms")
                fb = fig(key + ("fwdbwd",), "window_ms")
                fl = med([r["floor_ms"] for r in records.get(key + ("trainkit",), []) if r["floor_ms"] > 0])
                aw = med([r.get("adamw_ms", 0) for r in records.get(key + ("fwdbwd",), []) if r.get("adamw_ms", 0) > 0])
                out.append(f"| {m} | {p} | {n} | {fmt(tk_w)} | {fmt(fig(key + ('python-compile',), 'window_ms'))} | "
                           f"{fmt(paired(key, 'python-compile', 'window_ms'))}x | {fmt(fb)} | {fmt(fl, 3)} | "
                           f"{fmt(fb + fl if fb is not None and fl is not None else None)} | "
                           f"{fmt(over_limit(key), 3)}x | {fmt(aw, 3)} | {fmt(over_limit(key, 'adamw_ms'), 3)}x |")
            out.append("")

        if "trainkit-limit" in impls:
            out.append("### The limit of a window, measured in the same process, ms, median")
            out.append("")
            out.append("trainkit's windows alternating with the windows' forward + backward alone in the same process "
                       "(`compare --impl trainkit --interleave-fwdbwd 1`: after each window, the same micro-batches' "
                       "forward + backward into the trainer's zeroed gradients, timed, then zeroed again), so that "
                       "each window is compared with its neighbour. trainkit / limit: each window over (the "
                       "forward + backward after it + the process's floor), median over the windows, then over the "
                       "repetitions.")
            out.append("")
            out.append("| model | precision | N | windows per process | trainkit window | fwd+bwd | floor | "
                       "optimizer phase | phase / floor | trainkit / limit |")
            out.append("|---|---|---|---|---|---|---|---|---|---|")
            for m, p, n in configs:
                key = (m, p, n)
                rs = [r for r in records.get(key + ("trainkit-limit",), []) if r.get("fwdbwd_ms")]
                out.append(f"| {m} | {p} | {n} | {len(rs[0]['window_ms']) if rs else 0} | "
                           f"{fmt(fig(key + ('trainkit-limit',), 'window_ms'))} | "
                           f"{fmt(med([statistics.median(r['fwdbwd_ms']) for r in rs]))} | "
                           f"{fmt(med([r['floor_ms'] for r in rs]), 3)} | {fmt(fig(key + ('trainkit-limit',), 'phase_ms'), 3)} | "
                           f"{fmt(med([statistics.median(r['phase_ms']) / r['floor_ms'] for r in rs if r['floor_ms'] > 0]))}x | "
                           f"{fmt(over_limit_paired(key), 3)}x |")
            out.append("")

        compiled = [r for (m, p, n, i), rs in records.items() if i == "python-compile" for r in rs]
        if compiled:
            info = compiled[0]
            out.append("### torch.compile: backend and compilation")
            out.append("")
            out.append(f"Backend {info.get('compile_backend')}, CPU code generator `{info.get('cpu_backend')}` "
                       f"(C++ with OpenMP, compiled by `{info.get('cxx')}`), cpp_wrapper {info.get('cpp_wrapper')}, "
                       f"{info.get('inductor_threads')} OpenMP threads in its kernels; graphs compiled per process: "
                       + "/".join(str(v) for v in sorted({r.get('frames_compiled') for r in compiled})) +
                       ". First window: the one that compiles (Dynamo traces, AOTAutograd makes the backward, "
                       "Inductor generates C++ and calls the compiler), with an empty cache (the run's first "
                       "process of that model and precision) and with the cache the first one filled (the "
                       "other processes; median). Compilation: the first window minus that process's median "
                       "window. Later warm-up windows: the slowest of the others before timing began.")
            out.append("")
            out.append("| model | precision | first window, empty cache, s | compilation, empty cache, s | "
                       "first window, filled cache, s | compilation, filled cache, s | later warm-up windows, slowest, ms |")
            out.append("|---|---|---|---|---|---|---|")
            for m in models:
                for p in precisions:
                    rs = [r for r in compiled if r["model"] == m and r["precision"] == p and r.get("warmup_ms")]
                    if not rs:
                        continue
                    cold = [r for r in rs if r.get("cold_cache")]
                    warm = [r for r in rs if not r.get("cold_cache")]
                    first = lambda group: med([r["warmup_ms"][0] / 1e3 for r in group])
                    comp = lambda group: med([(r["warmup_ms"][0] - statistics.median(r["window_ms"])) / 1e3
                                              for r in group if r["window_ms"]])
                    later = max([w for r in rs for w in r["warmup_ms"][1:]], default=None)
                    out.append(f"| {m} | {p} | {fmt(first(cold), 1)} | {fmt(comp(cold), 1)} | {fmt(first(warm), 1)} | "
                               f"{fmt(comp(warm), 1)} | {fmt(later, 1)} |")
            out.append("")

        out.append("### Peak resident memory (VmHWM), MiB, median (one process per configuration)")
        out.append("")
        out.append("| model | precision | N | " + " | ".join(shown) + " |")
        out.append("|---|---|---|" + "---|" * len(shown))
        for m, p, n in configs:
            out.append(f"| {m} | {p} | {n} | " + " | ".join(fmt(hwm((m, p, n, i)), 0) for i in shown) + " |")
        starts = {i: med([r["rss_start_kib"] / 1024 for k, rs in records.items() if k[3] == i for r in rs]) for i in shown}
        out.append("")
        out.append("Resident memory before the model is built (the runtime itself): " +
                   ", ".join(f"{i} {fmt(starts[i], 0)} MiB" for i in shown) + ".")
        out.append("")

    if op_counts:
        out.append("### ATen operator calls per optimizer phase (top level, N = 1; a separate short run)")
        out.append("")
        out.append("| model | precision | trainkit | branching | hand-written LibTorch |")
        out.append("|---|---|---|---|---|")
        for m in models:
            for p in [p for p in precisions if p in ("fp32", "fp16")]:
                out.append(f"| {m} | {p} | " + " | ".join(fmt(op_counts.get((m, p, i)), 0)
                                                          for i in ("trainkit", "branching", "libtorch")) + " |")
        out.append("")

    if sweep:
        out.append(f"### Peak resident memory at a fixed effective batch ({args.sweep.split(':')[1]} sequences, "
                   f"{args.sweep.split(':')[0]}, fp32), MiB")
        out.append("")
        names = [i for i in impls if i not in TIMING_ONLY]
        out.append("| N | micro-batch | " + " | ".join(names) + " |")
        out.append("|---|---|" + "---|" * len(names))
        for n, mb, row in sweep:
            out.append(f"| {n} | {mb} | " + " | ".join(
                fmt(row[i]["vmhwm_kib"] / 1024 if row.get(i) else None, 0) for i in names) + " |")
        out.append("")

    if args.reps > 0:  # timing runs were made
        out.append("### Same model, same data: the first window's loss (before any update) and the last one's")
        out.append("")
        out.append("| model | precision | N | " + " | ".join(shown) + " |")
        out.append("|---|---|---|" + "---|" * len(shown))
        for m, p, n in configs:
            cells = []
            for i in shown:
                rs = records.get((m, p, n, i), [])
                cells.append(f"{rs[0]['losses'][0]:.5f} / {rs[0]['losses'][-1]:.5f}" if rs else "n/a")
            out.append(f"| {m} | {p} | {n} | " + " | ".join(cells) + " |")
        out.append("")

        # --- targets ---------------------------------------------------------------------------
        out.append("### Targets")
        out.append("")

        def span(values):
            values = [v for v in values if v is not None]
            return (min(values), max(values)) if values else (None, None)

        rows = []
        for m in models:
            cfg = [(m, p, n) for p, n in [(p, n) for p in precisions for n in accums]]
            tk_floor = span([over_floor(c) for c in cfg])
            rows.append((f"{m}: optimizer phase <= 1.3x the bandwidth floor", tk_floor[1] is not None and tk_floor[1] <= 1.3,
                         f"trainkit / floor {fmt(tk_floor[0])}x .. {fmt(tk_floor[1])}x"))
            vs_lt = span([paired(c, "libtorch", "phase_ms") for c in cfg])
            rows.append((f"{m}: optimizer phase >= 2x faster than hand-written LibTorch", vs_lt[0] is not None and vs_lt[0] >= 2,
                         f"speed-up {fmt(vs_lt[0])}x .. {fmt(vs_lt[1])}x"))
            w_lt = span([paired(c, "libtorch", "window_ms") for c in cfg])
            w_py = span([paired(c, "python", "window_ms") for c in cfg])
            if m == "bert-tiny":
                rows.append(("bert-tiny: window >= 1.3x faster than Python", w_py[0] is not None and w_py[0] >= 1.3,
                             f"speed-up {fmt(w_py[0])}x .. {fmt(w_py[1])}x"))
                rows.append(("bert-tiny: window >= 1.1x faster than hand-written LibTorch", w_lt[0] is not None and w_lt[0] >= 1.1,
                             f"speed-up {fmt(w_lt[0])}x .. {fmt(w_lt[1])}x"))
            rows.append((f"{m}: window never slower than LibTorch or Python",
                         None not in (w_lt[0], w_py[0]) and min(w_lt[0], w_py[0]) >= 1.0,
                         f"vs LibTorch {fmt(w_lt[0])}x .. {fmt(w_lt[1])}x, vs Python {fmt(w_py[0])}x .. {fmt(w_py[1])}x"))
            if "fwdbwd" in impls:
                lim = span([over_limit(c) for c in cfg])
                rows.append((f"{m}: window <= 1.05x the limit (fwd+bwd + the optimizer phase's floor)"
                             + ("" if m != "mlp" else " (reported; no target)"),
                             lim[1] is not None and lim[1] <= 1.05,
                             f"trainkit / limit {fmt(lim[0], 3)}x .. {fmt(lim[1], 3)}x"))
            if "trainkit-limit" in impls:
                lim = span([over_limit_paired(c) for c in cfg])
                rows.append((f"{m}: window <= 1.05x the limit, same process"
                             + ("" if m != "mlp" else " (reported; no target)"),
                             lim[1] is not None and lim[1] <= 1.05,
                             f"trainkit / limit {fmt(lim[0], 3)}x .. {fmt(lim[1], 3)}x"))
            if "python-compile" in impls:
                w_pc = span([paired(c, "python-compile", "window_ms") for c in cfg])
                rows.append((f"{m}: window not slower than torch.compile + fused AdamW",
                             w_pc[0] is not None and w_pc[0] >= 1.0,
                             f"speed-up {fmt(w_pc[0])}x .. {fmt(w_pc[1])}x"))
        if sweep:
            tk = [row.get("trainkit") for _, _, row in sweep]
            if all(tk):
                mib = [r["vmhwm_kib"] / 1024 for r in tk]
                rows.append(("peak memory falls as the micro-batch shrinks (trainkit, N = 1, 2, 4, 8)",
                             all(a > b for a, b in zip(mib, mib[1:])), " > ".join(f"{v:.0f}" for v in mib) + " MiB"))
        # A target whose figures this run did not measure (an implementation left out) is not shown.
        rows = [r for r in rows if "n/a" not in r[2]]
        out.append("| target | met | figures (min .. max over the precisions and N) |")
        out.append("|---|---|---|")
        for name, met, detail in rows:
            out.append(f"| {name} | {'yes' if met else 'NO'} | {detail} |")
        out.append("")
    if runner.failures:
        out.append("Failed runs:")
        out.extend(f"- `{f}`" for f in runner.failures)
        out.append("")
    # A ratio whose implementation did not run reads "n/a", not "n/ax".
    print("\n".join(out).replace("n/ax", "n/a"))
    return 1 if runner.failures else 0


if __name__ == "__main__":
    sys.exit(main())
