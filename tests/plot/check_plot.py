"""tools/trainkit-plot on a scalar log as the fit loop writes it (NaN and Infinity as strings, a
torn last line): one panel per tag, a red mark per non-finite point, and the errors' exit codes.

    check_plot.py PLOT WORKDIR
"""
import json
import os
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET


def fail(message):
    print("FAIL: " + message)
    sys.exit(1)


def main():
    plot, work = sys.argv[1], sys.argv[2]
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work)
    log = os.path.join(work, "model-scalars.jsonl")
    with open(log, "w") as f:
        for step in range(1, 41):
            loss = "NaN" if step in (17, 18) else 2.0 / step
            for tag, value in (("Train-Loss", loss), ("LR/Group_0", 1e-4 * min(1, step / 10)), ("loss-scale", 65536.0)):
                f.write(json.dumps({"step": step, "tag": tag, "value": value, "wall_time": 1.7e9 + step}) + "\n")
        f.write(json.dumps({"step": 40, "tag": "Val-Acc", "value": 0.5, "wall_time": 1.7e9}) + "\n")
        f.write('{"step":41,"tag":"Train-')  # torn by a crash
    p = subprocess.run([sys.executable, plot, log], capture_output=True, text=True)
    if p.returncode != 0:
        fail("trainkit-plot exited %d: %s" % (p.returncode, p.stderr))
    svg = os.path.join(work, "model-scalars.svg")
    root = ET.parse(svg).getroot()
    ns = "{http://www.w3.org/2000/svg}"
    titles = [t.text for t in root.iter(ns + "text") if t.get("font-weight") == "bold"]
    if titles != ["Train-Loss", "LR/Group_0", "loss-scale", "Val-Acc"]:
        fail("panels %s" % titles)
    marks = [l for l in root.iter(ns + "line") if l.get("class") == "nonfinite"]
    if len(marks) != 2:
        fail("%d non-finite marks, expected 2" % len(marks))
    if len(list(root.iter(ns + "polyline"))) != 3 or len(list(root.iter(ns + "circle"))) != 1:
        fail("expected 3 curves and one single point (Val-Acc)")
    for args, status in (([log, "--tags", "Nope"], 2), ([os.path.join(work, "missing.jsonl")], 1)):
        p = subprocess.run([sys.executable, plot] + args, capture_output=True, text=True)
        if p.returncode != status or "error:" not in p.stderr:
            fail("%s: exit %d (expected %d), said %r" % (args, p.returncode, status, p.stderr))
    print("OK: 4 panels, 2 non-finite marks, errors with exit 1 and 2")


if __name__ == "__main__":
    main()
