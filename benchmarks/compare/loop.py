"""(c) The Python training loop users write, on the same torch wheel as the C++ side.

torch.autocast for the forward, torch.amp.GradScaler for FP16 (scale, backward, unscale_ then
clip_grad_norm_, step, update), loss / N over N accumulated micro-batches, torch.optim.AdamW
with its defaults (on the CPU that is the per-tensor implementation; foreach and fused are
opt-in there). Models, initialisation and data mirror benchmarks/compare/models.hpp exactly
(the same modules in the same order, reseeded N(0, 0.02) / ones / zeros init, the same tensor
expressions for the batches), so the FP32 losses match the C++ implementations'.

With --compile --fused, the loop a speed-conscious user writes: torch.compile(model) (default
mode: TorchInductor, which on a CPU generates C++/OpenMP kernels and compiles them with the
system's C++ compiler) and torch.optim.AdamW(fused=True). The loss, the scaler and the optimizer
stay outside the compiled region, as in the usual recipe. The first window(s) compile; their
times are printed separately (warmup_ms), never in window_ms.

    .venv/bin/python benchmarks/compare/loop.py --model bert-tiny --precision fp16 --accum 4
    .venv/bin/python benchmarks/compare/loop.py --model bert-tiny --precision bf16 --compile --fused

Prints one JSON line with the fields compare (main.cpp) prints.
"""
import argparse
import contextlib
import json
import os
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

SPECS = {  # name: (bert, layers, hidden, heads, vocab, seq, micro_batch, in, out)
    "mlp": (False, 4, 256, 0, 0, 0, 32, 128, 16),
    "bert-tiny": (True, 4, 256, 4, 8192, 64, 4, 0, 0),
    "bert-8x512": (True, 8, 512, 8, 8192, 32, 4, 0, 0),
    "bert-base": (True, 12, 768, 12, 30522, 128, 32, 0, 0),
}


class Mlp(nn.Module):
    def __init__(self, layers, hidden, d_in, d_out):
        super().__init__()
        width = d_in
        self.fc = []
        for i in range(layers):
            nxt = d_out if i + 1 == layers else hidden
            setattr(self, f"fc{i}", nn.Linear(width, nxt))
            self.fc.append(getattr(self, f"fc{i}"))
            width = nxt

    def forward(self, x):
        for i, fc in enumerate(self.fc):
            x = fc(x)
            if i + 1 < len(self.fc):
                x = F.gelu(x)
        return x


class EncoderLayer(nn.Module):
    def __init__(self, hidden, heads):
        super().__init__()
        self.heads = heads
        self.q = nn.Linear(hidden, hidden)
        self.k = nn.Linear(hidden, hidden)
        self.v = nn.Linear(hidden, hidden)
        self.o = nn.Linear(hidden, hidden)
        self.ln1 = nn.LayerNorm(hidden)
        self.ff1 = nn.Linear(hidden, 4 * hidden)
        self.ff2 = nn.Linear(4 * hidden, hidden)
        self.ln2 = nn.LayerNorm(hidden)

    def forward(self, x):
        b, s, h = x.shape
        split = lambda t: t.view(b, s, self.heads, h // self.heads).transpose(1, 2)
        a = F.scaled_dot_product_attention(split(self.q(x)), split(self.k(x)), split(self.v(x)))
        a = a.transpose(1, 2).reshape(b, s, h)
        x = self.ln1(x + self.o(a))
        return self.ln2(x + self.ff2(F.gelu(self.ff1(x))))


class Bert(nn.Module):
    def __init__(self, layers, hidden, heads, vocab, seq):
        super().__init__()
        self.tok = nn.Embedding(vocab, hidden)
        self.pos = nn.Embedding(seq, hidden)
        self.ln_emb = nn.LayerNorm(hidden)
        self.layers = nn.ModuleList(EncoderLayer(hidden, heads) for _ in range(layers))
        self.head = nn.Linear(hidden, vocab)

    def forward(self, ids):
        positions = torch.arange(ids.shape[1], dtype=ids.dtype, device=ids.device)
        x = self.ln_emb(self.tok(ids) + self.pos(positions))
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def init_weights(model, seed):
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.02)
            elif name.endswith(".weight"):
                p.fill_(1.0)
            else:
                p.zero_()


def make_batch(spec, batch, seq, k, device):
    bert, _, _, _, vocab, _, _, d_in, d_out = spec
    if bert:
        ids = (torch.arange(batch).view(batch, 1) * 977 + torch.arange(seq).view(1, seq) * 31
               + k * 7919).remainder(vocab)
        return ids.to(device), (ids * 17 + 3).remainder(vocab).to(device)
    x = torch.sin(torch.arange(batch * d_in, dtype=torch.float32).view(batch, d_in) * 0.01 + float(k))
    return x.to(device), torch.arange(batch).remainder(d_out).to(device)


def status_kib(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return -1


def require_compile_toolchain():
    """Inductor's CPU kernels are C++ built as Python extension modules: they need a C++
    compiler and Python.h. Say what is missing before torch.compile fails deep inside."""
    import shutil
    import sysconfig
    header = os.path.join(sysconfig.get_paths()["include"], "Python.h")
    if not os.path.exists(header):
        raise SystemExit(f"--compile: {header} is missing: torch.compile's CPU kernels include it "
                         "(Debian: apt-get install python3-dev, for the Python the venv was made from)")
    if not (shutil.which(os.environ.get("CXX", "g++")) or shutil.which("c++")):
        raise SystemExit("--compile: no C++ compiler (g++ or $CXX): torch.compile's CPU kernels are C++")


def compile_info():
    """What torch.compile ran on: the backend, Inductor's CPU code generator and the compiler it
    called, and how many graphs Dynamo compiled (a recompilation would show here)."""
    import torch._dynamo.utils
    import torch._inductor.config as inductor
    from torch._inductor import cpp_builder
    try:
        cxx = cpp_builder.get_cpp_compiler()
    except Exception as e:  # the point of asking: a missing compiler is a finding, not a crash
        cxx = f"none ({e})"
    frames = torch._dynamo.utils.counters["stats"]
    return {"compile_backend": "inductor", "cpp_wrapper": bool(inductor.cpp_wrapper),
            "cpu_backend": getattr(inductor, "cpu_backend", "cpp"), "cxx": cxx,
            "frames_compiled": int(frames.get("unique_graphs", 0)),
            "inductor_threads": int(inductor.cpp.threads) if inductor.cpp.threads > 0 else torch.get_num_threads(),
            "cache_dir": os.environ.get("TORCHINDUCTOR_CACHE_DIR", "default")}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="bert-tiny", choices=sorted(SPECS))
    ap.add_argument("--precision", default="fp32", choices=["fp32", "bf16", "fp16"])
    ap.add_argument("--accum", type=int, default=1)
    ap.add_argument("--micro-batch", type=int, default=0)
    ap.add_argument("--seq", type=int, default=0)
    ap.add_argument("--windows", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--threads", type=int, default=int(os.environ.get("TRAINKIT_BENCH_THREADS", "2")))
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--fused", action="store_true",
                    help="torch.optim.AdamW(fused=True): the opt-in fused kernel (not the default)")
    ap.add_argument("--compile", action="store_true",
                    help="torch.compile(model), default mode (the first windows compile; see warmup_ms)")
    a = ap.parse_args()

    if a.compile:
        require_compile_toolchain()
    torch.set_num_threads(a.threads)
    rss_start = status_kib("VmRSS")
    device = torch.device(a.device)
    spec = SPECS[a.model]
    bert, layers, hidden, heads, vocab, seq, default_batch, d_in, d_out = spec
    batch = a.micro_batch or default_batch
    data_seq = a.seq or seq
    if bert and data_seq > seq:
        raise SystemExit(f"--seq {data_seq} exceeds the model's {seq}")
    model = Bert(layers, hidden, heads, vocab, seq) if bert else Mlp(layers, hidden, d_in, d_out)
    init_weights(model, 0)
    model.to(device)
    # Only the model is compiled (its forward, and through AOTAutograd its backward); the loss,
    # loss / N, the scaler and the optimizer run eagerly, as in the usual recipe.
    forward = torch.compile(model) if a.compile else model
    pool = [make_batch(spec, batch, data_seq, k, device) for k in range(4)]

    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=1e-2,
                                  **({"fused": True} if a.fused else {}))
    fp16 = a.precision == "fp16"
    dtype = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}[a.precision]
    scaler = torch.amp.GradScaler(device.type, enabled=fp16)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def loss_of(k):
        x, y = pool[k % len(pool)]
        out = forward(x)
        return F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    k = 0
    scale_before = scaler.get_scale() if fp16 else 1.0
    window_ms, phase_ms, warmup_ms, losses = [], [], [], []
    skipped = 0
    for w in range(a.warmup + a.windows):
        sync()
        t0 = time.perf_counter()
        window_loss = torch.zeros((), device=device)
        for _ in range(a.accum):
            with torch.autocast(device.type, dtype=dtype) if dtype else contextlib.nullcontext():
                loss = loss_of(k)
            k += 1
            loss = loss / a.accum
            window_loss += loss.detach()
            scaler.scale(loss).backward()
        sync()
        t1 = time.perf_counter()
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()
        sync()
        t2 = time.perf_counter()
        if fp16:  # outside the timed region: get_scale() reads the scale to the host
            scale_now = scaler.get_scale()
            skipped += scale_now < scale_before
            scale_before = scale_now
        losses.append(window_loss)
        if w >= a.warmup:
            window_ms.append((t2 - t0) * 1e3)
            phase_ms.append((t2 - t1) * 1e3)
        else:  # with --compile, the first of these includes the compilation
            warmup_ms.append((t2 - t0) * 1e3)
    hwm = status_kib("VmHWM")
    params = sum(p.numel() for p in model.parameters())
    impl = "python" + ("-compile" if a.compile else "") + ("-fused" if a.fused else "")
    print(json.dumps({
        "impl": impl, "model": a.model, "precision": a.precision, "accum": a.accum,
        "micro_batch": batch, "seq": data_seq if bert else 0, "threads": torch.get_num_threads(), "params": params,
        "tensors": len(list(model.parameters())), "window_ms": [round(v, 4) for v in window_ms],
        "phase_ms": [round(v, 4) for v in phase_ms], "warmup_ms": [round(v, 4) for v in warmup_ms],
        "losses": [round(float(l), 7) for l in losses], "skipped": skipped, "vmhwm_kib": hwm,
        "rss_start_kib": rss_start, "copy_gbs": 0.0, "floor_ms": 0.0,
        "gpu_peak_mib": torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else 0.0,
        "torch": torch.__version__, **(compile_info() if a.compile else {})}))


if __name__ == "__main__":
    main()
