"""Weights between trainkit and PyTorch, both ways, checked with PyTorch's own readers.

    roundtrip.py FIXTURE TOOL WORKDIR

FIXTURE is tests/weights/weights_fixture (a small C++ model with PyTorch's names), TOOL is
trainkit-weights. The checks:
  1. trainkit -> PyTorch: a trainkit checkpoint converted to .pt opens with
     torch.load(weights_only=True) and loads into the same PyTorch model with
     load_state_dict(strict=True); converted to .safetensors it opens with
     safetensors.torch.load_file; both hold exactly the weights the C++ model held.
  2. PyTorch -> trainkit: torch.save(model.state_dict()) (an OrderedDict, with _metadata) and
     safetensors.torch.save_file load strictly into the C++ model (load_weights), exactly; a
     bfloat16 file loads with its conversion reported.
  3. Broken input: a truncated state_dict and a file of another kind are errors naming the file
     (exit 1), never a crash.
Where the safetensors package is missing it is installed into this interpreter's environment
(scripts/setup installs it); if that fails the test fails.
"""
import os
import shutil
import subprocess
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "support"))
from packages import fail, import_or_install, run  # noqa: E402


def import_safetensors():
    import_or_install("safetensors", "safetensors")
    import safetensors.torch
    return safetensors.torch


def main():
    if len(sys.argv) != 4:
        fail("usage: roundtrip.py FIXTURE TOOL WORKDIR")
    fixture, tool, work = sys.argv[1:]
    import torch
    from torch import nn
    st = import_safetensors()

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1 = nn.Linear(4, 8)
            self.norm = nn.LayerNorm(8)
            self.fc2 = nn.Linear(8, 3)
            self.bn = nn.BatchNorm1d(3)

    def same(a, b, what):
        if set(a) != set(b):
            fail("%s: names %s against %s" % (what, sorted(a), sorted(b)))
        for k in a:
            if a[k].dtype != b[k].dtype or a[k].shape != b[k].shape or not torch.equal(a[k], b[k]):
                fail("%s: %s differs (%s %s against %s %s)" % (what, k, a[k].dtype, tuple(a[k].shape),
                                                               b[k].dtype, tuple(b[k].shape)))

    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work)
    p = lambda name: os.path.join(work, name)
    run([fixture, "write", work])
    expected = st.load_file(p("expected.safetensors"))
    if len(expected) != 11:  # 8 parameters, 3 BatchNorm buffers (one of them int64)
        fail("expected.safetensors holds %d tensors" % len(expected))

    # 1. trainkit -> PyTorch.
    run([tool, "convert", p("model.ckpt"), p("model.pt")])
    run([tool, "convert", p("model.ckpt"), p("model.safetensors")])
    state = torch.load(p("model.pt"), weights_only=True)
    same(dict(state), expected, "model.pt (torch.load)")
    net = Net()
    net.load_state_dict(state, strict=True)
    same(dict(net.state_dict()), expected, "load_state_dict(model.pt)")
    same(st.load_file(p("model.safetensors")), expected, "model.safetensors")
    listing = run([tool, "inspect", p("model.ckpt")])
    if "trainkit checkpoint, 11 tensors" not in listing or "bn.num_batches_tracked  Long []" not in listing:
        fail("inspect model.ckpt said:\n" + listing)
    print("OK: a trainkit checkpoint as .pt and .safetensors, read by torch.load and safetensors")

    # 2. PyTorch -> trainkit.
    torch.manual_seed(5)
    net = Net()
    with torch.no_grad():
        for t in net.state_dict().values():
            if t.is_floating_point():
                t.copy_(torch.randn_like(t))
        net.bn.num_batches_tracked.fill_(7)
    theirs = {k: v.clone() for k, v in net.state_dict().items()}
    torch.save(net.state_dict(), p("torch.pt"))  # an OrderedDict with _metadata
    st.save_file(theirs, p("torch.safetensors"))
    for source in ("torch.pt", "torch.safetensors"):
        said = run([fixture, "load", p(source), p(source + ".back.safetensors")])
        if "loaded 11, converted 0" not in said:
            fail("loading %s said: %s" % (source, said))
        same(st.load_file(p(source + ".back.safetensors")), theirs, source + " loaded by trainkit")
    half = {k: (v.to(torch.bfloat16) if v.is_floating_point() else v) for k, v in theirs.items()}
    torch.save(half, p("bf16.pt"))
    said = run([fixture, "load", p("bf16.pt"), p("bf16.back.safetensors")])
    if "converted 10" not in said or "converted fc1.weight (BFloat16 -> Float)" not in said:
        fail("loading bf16.pt said: " + said)
    back = st.load_file(p("bf16.back.safetensors"))
    for k, v in half.items():
        if not torch.equal(back[k], v.to(back[k].dtype)):
            fail("bf16.pt: %s differs after the conversion" % k)
    # Views of one storage (transposed, offset), a 0-dim and an empty tensor, as torch.save keeps them.
    t = torch.arange(12.0).reshape(3, 4)
    views = {"a": t, "b": t.t(), "c": t[1:, 2:], "d": torch.tensor(3.5, dtype=torch.float64), "e": torch.zeros(0, 5)}
    torch.save(views, p("views.pt"))
    run([tool, "convert", p("views.pt"), p("views.safetensors")])
    same(st.load_file(p("views.safetensors")), {k: v.contiguous() for k, v in views.items()}, "views.pt converted")
    print("OK: torch.save and safetensors files load strictly into the C++ model; bf16 converted; views kept")

    # 3. Broken input.
    with open(p("torch.pt"), "rb") as f:
        data = f.read()
    with open(p("truncated.pt"), "wb") as f:
        f.write(data[: len(data) // 2])
    said = run([tool, "inspect", p("truncated.pt")], expect=1)
    if "truncated.pt" not in said or "Traceback" in said:
        fail("a truncated file: " + said)
    with open(p("notes.txt"), "w") as f:
        f.write("not weights\n")
    said = run([tool, "inspect", p("notes.txt")], expect=1)
    if "is not a weights file trainkit reads" not in said:
        fail("a text file: " + said)
    run([tool, "convert", p("model.ckpt"), p("model.npz")], expect=2)
    print("OK: broken input is an error naming the file")


if __name__ == "__main__":
    main()
