"""A checkpoint set read from Python with safetensors and the index alone: the snippet of
docs/guide/checkpoints.md ("Sets"), run as the guide prints it, against the C++ values.

    read_set.py DRIVER TOOL GUIDE WORKDIR

DRIVER is tests/dist/driver.cpp's program, TOOL trainkit-weights, GUIDE docs/guide/checkpoints.md.
Two Gloo ranks train with ZeRO stage 2 and save the same state twice: one file gathered on rank 0
(--save) and a set, each rank its own slices (--save-set). The checks:
  1. the snippet's records hold every tensor of the index, each chunk's CRC-32 checked with zlib;
     its read_checkpoint reads the gathered single file too, and its records equal the set's;
  2. their model weights equal, bit for bit, those trainkit-weights converts from the set and from
     the gathered file (its C++ reader), and the optimizer's state is there for every parameter;
  3. trainkit-weights inspect names the set; convert to .pt opens with torch.load(weights_only).
"""
import os
import re
import shutil
import socket
import subprocess
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "support"))
from packages import fail, import_or_install, run  # noqa: E402


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def snippet(guide):
    text = open(guide).read()
    m = re.search(r"<!-- python: read_set -->\s*```python\n(.*?)```", text, re.S)
    if not m:
        fail("%s has no ```python block after <!-- python: read_set -->" % guide)
    return m.group(1)


def main():
    if len(sys.argv) != 5:
        fail("usage: read_set.py DRIVER TOOL GUIDE WORKDIR")
    driver, tool, guide, work = sys.argv[1:]
    import_or_install("safetensors", "safetensors")
    import torch
    from safetensors.torch import load_file

    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work)
    p = lambda name: os.path.join(work, name)
    port = str(free_port())
    args = [driver, "--out", p("run"), "--model", "mlp-ln", "--steps", "3", "--batch", "4", "--sharding", "2",
            "--bucket-bytes", "256", "--save", p("gathered.ckpt"), "--save-set", p("set")]
    ranks = []
    for r in range(2):
        env = dict(os.environ, RANK=str(r), WORLD_SIZE="2", LOCAL_RANK=str(r), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=port)
        ranks.append(subprocess.Popen(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    for r, proc in enumerate(ranks):
        out, _ = proc.communicate(timeout=240)
        if proc.returncode != 0:
            fail("rank %d exited %d:\n%s" % (r, proc.returncode, out))
    index = p("set/set-0000.ckpt")

    # 1. The guide's snippet, as printed.
    scope = {}
    exec(compile(snippet(guide), guide + " (read_set)", "exec"), scope)
    records = scope["read_set"](index)
    import json
    expected_names = set(json.load(open(index))["tensors"])
    if set(records) != expected_names:
        fail("the snippet read %d records, the index has %d" % (len(records), len(expected_names)))
    # read_checkpoint: the set's index as read_set, and the single file of the same state.
    if set(scope["read_checkpoint"](index)) != expected_names:
        fail("read_checkpoint on the set's index reads other records than read_set")
    single = scope["read_checkpoint"](p("gathered.ckpt"))
    missing = sorted(expected_names - set(single))
    if missing:
        fail("read_checkpoint on the single file lacks %d of the set's records: %s" % (len(missing), missing[:5]))
    for k in expected_names:
        if single[k].dtype != records[k].dtype or not torch.equal(single[k], records[k]):
            fail("read_checkpoint: the single file's %s differs from the set's" % k)

    # 2. Against the C++ readers: the set's weights and the gathered file's.
    run([tool, "convert", index, p("set.safetensors")])
    run([tool, "convert", p("gathered.ckpt"), p("gathered.safetensors")])
    from_set, gathered = load_file(p("set.safetensors")), load_file(p("gathered.safetensors"))
    weights = {k[len("model.param."):]: v for k, v in records.items() if k.startswith("model.param.")}
    weights.update({k[len("model.buffer."):]: v for k, v in records.items() if k.startswith("model.buffer.")})
    if len(weights) < 6:
        fail("the set holds %d weights" % len(weights))
    for name, cpp in (("trainkit-weights convert of the set", from_set),
                      ("trainkit-weights convert of the gathered file", gathered)):
        if set(cpp) != set(weights):
            fail("%s: names %s against the snippet's %s" % (name, sorted(cpp), sorted(weights)))
        for k, v in weights.items():
            if cpp[k].dtype != v.dtype or not torch.equal(cpp[k], v):
                fail("%s: %s differs from the snippet's" % (name, k))
    moments = [k for k in records if k.startswith("optim.")]
    if len(moments) < len([k for k in records if k.startswith("model.param.")]):
        fail("the set holds the optimizer's state of %d records only" % len(moments))
    pieces = sum(len(t["chunks"]) for t in json.load(open(index))["tensors"].values())
    if pieces <= len(records):
        fail("no record is split over the ranks' files (%d chunks for %d records)" % (pieces, len(records)))

    # 3. The tool on a set.
    said = run([tool, "inspect", index])
    if "checkpoint set" not in said:
        fail("trainkit-weights inspect does not name the set:\n" + said)
    run([tool, "convert", index, p("set.pt")])
    loaded = torch.load(p("set.pt"), weights_only=True)
    for k, v in weights.items():
        if not torch.equal(loaded[k], v):
            fail("set.pt: %s differs" % k)
    print("ok: %d records (%d chunks over 2 files), %d weights equal to the C++ readers', the single file's "
          "%d records equal where the set has them" % (len(records), pieces, len(weights), len(single)))


if __name__ == "__main__":
    main()
