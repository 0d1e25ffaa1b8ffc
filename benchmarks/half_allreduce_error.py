# Error of a half-precision gradient all-reduce (TrainerOptions::reduce_precision half: each
# rank's half gradient weighted to the mean, then summed in its dtype) against the fp32
# all-reduce of the same half gradients (reduce_precision fp32), and against rounding the exact
# mean once to the half dtype. Gloo on the CPU, W = 2, 4, 8 ranks, 1 Mi log-normal elements
# (FP16 ones times a loss scale of 1024, clamped to fp16's range).
#
#   .venv/bin/python benchmarks/half_allreduce_error.py
#
# Prints, per W and dtype, the error relative to the exact mean: the norm of the difference over
# the norm, and the median elementwise relative error. (NCCL's ring adds in the half dtype at
# each of W-1 hops; Gloo's sum is comparable. The figures decide the automatic default.)
import os, sys, torch, torch.distributed as dist, torch.multiprocessing as mp
N = 1 << 20
def worker(rank, W, port, q):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=W)
    torch.manual_seed(100 + rank)
    res = {}
    for dtype, scale in ((torch.float16, 1024.0), (torch.bfloat16, 1.0)):
        # gradients of mixed magnitudes (log-normal), as a half .grad holds them, with a loss scale for fp16
        g = (torch.randn(N) * torch.exp(torch.randn(N) * 2) * 1e-3 * scale).clamp(-6e4, 6e4).to(dtype)
        exact = g.double(); dist.all_reduce(exact)             # reference: exact sum
        f32 = g.float(); dist.all_reduce(f32)                  # today: fp32 all-reduce
        h = (g.float() / W).to(dtype); dist.all_reduce(h)       # half, pre-divided (mean)
        ref = exact / W
        def rel(x): return ((x.double() - ref).norm() / ref.norm()).item(), ((x.double() - ref).abs() / ref.abs().clamp_min(1e-30)).median().item()
        res[str(dtype)] = dict(fp32=rel(f32 / W), half_mean=rel(h), half_round_once=rel((f32 / W).to(dtype)))
    if rank == 0: q.put(res)
    dist.destroy_process_group()
if __name__ == "__main__":
    ctx = mp.get_context("spawn")
    for W in (2, 4, 8):
        q = ctx.Queue()
        ps = [ctx.Process(target=worker, args=(r, W, 29500 + W, q)) for r in range(W)]
        [p.start() for p in ps]; out = q.get(); [p.join() for p in ps]
        for k, v in out.items():
            print(f"W={W} {k:15s} " + "  ".join(f"{n}: norm-rel {a:.2e} median-rel {b:.2e}" for n, (a, b) in v.items()))
