"""TensorBoard's own reader reads back every scalar trainkit's TensorBoardWriter wrote.

    read_back.py WRITER WORKDIR

runs WRITER WORKDIR (tests/tensorboard/write_scalars.cpp), which writes WORKDIR/run/ (one event
file) and WORKDIR/expected.jsonl (every scalar: tag, step, value as a double, wall time), then
reads the event file with tensorboard's own readers and compares each (tag, step, value, wall
time): event_file_loader.LegacyEventFileLoader (every raw Event in order: the version record,
then one Summary simple_value per scalar), EventFileLoader (the same after the migration
TensorBoard's server applies: the scalar as a float tensor of the "scalars" plugin), and
event_accumulator.EventAccumulator (each tag's series). Values
are float32 in the file: compared with the double rounded to float32, bit for bit (NaN to NaN).
Where the tensorboard package is missing it is installed into this interpreter's environment
(the torch venv, .venv/); if that fails the test fails.
"""
import glob
import json
import math
import os
import shutil
import subprocess
import sys

import numpy

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "support"))
from packages import import_or_install  # noqa: E402


def fail(message):
    print("FAIL: " + message)
    sys.exit(1)


def import_tensorboard():
    import_or_install("tensorboard", "tensorboard")
    from tensorboard.backend.event_processing import event_accumulator, event_file_loader
    from tensorboard.util import tensor_util
    return event_accumulator, event_file_loader, tensor_util


def same_float32(read, written):
    """`read` (a float32 widened to double) is `written` rounded to float32 (IEEE rounding, as
    the C++ cast: beyond float32's range to infinity), bit for bit: -0.0 is not 0.0."""
    with numpy.errstate(over="ignore"):
        want = numpy.float32(written)
    if numpy.isnan(want):
        return math.isnan(read)
    return numpy.float32(read).tobytes() == want.tobytes()


def main():
    if len(sys.argv) != 3:
        fail("usage: read_back.py WRITER WORKDIR")
    writer, workdir = sys.argv[1], sys.argv[2]
    event_accumulator, event_file_loader, tensor_util = import_tensorboard()

    shutil.rmtree(workdir, ignore_errors=True)
    os.makedirs(workdir)
    if subprocess.call([writer, workdir]) != 0:
        fail("%s %s failed" % (writer, workdir))
    expected = []
    with open(os.path.join(workdir, "expected.jsonl")) as f:
        for line in f:
            # Numbers as their text: json would read "-0" as the int 0, losing the sign.
            row = json.loads(line, parse_int=str, parse_float=str)
            expected.append((row["tag"], int(row["step"]), float(row["value"]),
                             float(row["wall_time"])))  # float() reads "NaN", "Infinity" too
    files = glob.glob(os.path.join(workdir, "run", "*tfevents*"))
    if len(files) != 1:
        fail("expected one event file in %s/run, found %s" % (workdir, files))
    print("%d scalars written to %s" % (len(expected), files[0]))

    # 1. Every raw record, in order; 2. the same as TensorBoard's server migrates them.
    def read_value(value):
        return value.simple_value
    def read_tensor(value):
        if value.metadata.plugin_data.plugin_name != "scalars":
            fail("migrated value of plugin %r" % value.metadata.plugin_data.plugin_name)
        return float(tensor_util.make_ndarray(value.tensor))
    for loader, read in ((event_file_loader.LegacyEventFileLoader, read_value),
                         (event_file_loader.EventFileLoader, read_tensor)):
        name = loader.__name__
        events = list(loader(files[0]).Load())
        if len(events) != 1 + len(expected):
            fail("%s: %d events read, %d expected (+1 version record)" %
                 (name, len(events), len(expected)))
        if events[0].file_version != "brain.Event:2":
            fail("%s: first event's file_version is %r" % (name, events[0].file_version))
        for i, (event, want) in enumerate(zip(events[1:], expected)):
            values = event.summary.value
            if len(values) != 1:
                fail("%s: event %d holds %d values" % (name, i, len(values)))
            got = (values[0].tag, event.step, read(values[0]), event.wall_time)
            if (got[0] != want[0] or got[1] != want[1] or not same_float32(got[2], want[2])
                    or got[3] != want[3]):
                fail("%s: event %d: read %r, wrote %r" % (name, i, got, want))

    # 3. TensorBoard's scalar view: every tag's series (size_guidance 0: no sampling).
    accumulator = event_accumulator.EventAccumulator(
        os.path.join(workdir, "run"), size_guidance={event_accumulator.SCALARS: 0})
    accumulator.Reload()
    by_tag = {}
    for tag, step, value, wall_time in expected:
        by_tag.setdefault(tag, []).append((step, value, wall_time))
    tags = accumulator.Tags()["scalars"]
    if sorted(tags) != sorted(by_tag):
        fail("tags read %s, written %s" % (sorted(tags), sorted(by_tag)))
    for tag, series in by_tag.items():
        read = accumulator.Scalars(tag)
        if len(read) != len(series):
            fail("%s: %d scalars read, %d written" % (tag, len(read), len(series)))
        for r, (step, value, wall_time) in zip(read, series):
            if r.step != step or not same_float32(r.value, value) or r.wall_time != wall_time:
                fail("%s: read %r, wrote %r" % (tag, (r.step, r.value, r.wall_time),
                                                 (step, value, wall_time)))
    print("OK: %d scalars over %d tags read back by tensorboard %s" %
          (len(expected), len(by_tag), __import__("tensorboard").__version__))
    check_resumed(workdir, tensor_util)


def check_resumed(workdir, tensor_util):
    """A stopped and resumed run (two event files, each opened by a session start): both of
    TensorBoard's readers (the scalar accumulator and the server's plugin accumulator) show each
    (tag, step) once, with the values of resumed.jsonl, the text log cut back at the resume."""
    from tensorboard.backend.event_processing import event_accumulator, plugin_event_accumulator
    by_tag = {}
    steps_seen = set()
    with open(os.path.join(workdir, "resumed.jsonl")) as f:
        for line in f:
            row = json.loads(line)
            key = (row["tag"], row["step"])
            if key in steps_seen:
                fail("resumed.jsonl holds %r twice" % (key,))
            steps_seen.add(key)
            by_tag.setdefault(row["tag"], []).append((row["step"], row["value"]))
    run_dir = os.path.join(workdir, "resumed")
    if len(glob.glob(os.path.join(run_dir, "*tfevents*"))) != 2:
        fail("expected two event files in %s" % run_dir)
    scalars = event_accumulator.EventAccumulator(
        run_dir, size_guidance={event_accumulator.SCALARS: 0})
    scalars.Reload()
    tensors = plugin_event_accumulator.EventAccumulator(
        run_dir, tensor_size_guidance={"scalars": 0})
    tensors.Reload()
    for tag, series in by_tag.items():
        for name, read in (
                ("EventAccumulator", [(s.step, s.value) for s in scalars.Scalars(tag)]),
                ("plugin EventAccumulator",
                 [(t.step, float(tensor_util.make_ndarray(t.tensor_proto)))
                  for t in tensors.Tensors(tag)])):
            if [s for s, _ in read] != [s for s, _ in series]:
                fail("resumed run, %s, %s: steps %s, the log has %s" %
                     (name, tag, [s for s, _ in read], [s for s, _ in series]))
            for (step, got), (_, want) in zip(read, series):
                if not same_float32(got, want):
                    fail("resumed run, %s, %s at step %d: %r, the log has %r" %
                         (name, tag, step, got, want))
    print("OK: a resumed run's %d points are shown once each by both readers" %
          sum(len(s) for s in by_tag.values()))


if __name__ == "__main__":
    main()
