#!/usr/bin/env python3
"""The table of bench/rank_flows.sh: per flow, the Rust and the Python build's
rank on the compression track of the board built from the operator's
reruns, their operator figures (time vs baseline per workload), whether
the two builds trained bit for bit alike (every evaluation, train loss,
the bytes on the wire and the step to target of every submission entry,
in the submitter's runs and in the operator's reruns), and whether they
share a rank.
Usage: bench/rank_flows.py OUT N"""
import glob
import json
import os
import sys

out, n = sys.argv[1], int(sys.argv[2])


def trajectory(path):
    """Each submission entry's evaluations and bytes on the wire, by workload and repeat."""
    r = json.load(open(path))
    t = {}
    for e in r["entries"]:
        if "submission" not in e["id"]:
            continue
        m = e.get("metrics") or {}
        key = e["id"].split("/")[0] + "/" + e["id"].rsplit("/", 1)[-1]
        # (step, value) of each point: the curves' middle field is the clock.
        curve = lambda name: [(p[0], p[2]) for p in m.get(name) or []]
        t[key] = (curve("eval_curve"), curve("accuracy_curve"), curve("loss_curve"), m.get("bytes_on_wire"), m.get("steps_to_target"))
    return t


def board_rows(md):
    """(rank, plugin, cells, measured by) of the compression track's rows."""
    rows, on = {}, False
    for line in open(md):
        if line.startswith("### ") and "track `compression`" in line:
            on = True
            continue
        if on and line.startswith("### "):
            break
        if on and line.startswith("| ") and "topk-" in line:
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            name = cells[1].split()[0]
            rows[name] = (cells[0], cells[3:6], cells[-2])
    return rows


print("| flow | topk-rs rank | topk-py rank | shared | bit for bit (runs, reruns) | topk-rs time vs baseline (gpt, resnet, t5) | topk-py time vs baseline | measured by |")
print("| --- | --- | --- | --- | --- | --- | --- | --- |")
shared = 0
for f in range(1, n + 1):
    d = os.path.join(out, f"flow{f}")
    md = os.path.join(d, "board", "LEADERBOARD.md")
    if not os.path.exists(md):
        print(f"| {f} | - | - | not run | | | | {open(os.path.join(d, 'report.txt')).read().strip()[-200:] if os.path.exists(os.path.join(d, 'report.txt')) else ''} |")
        continue
    rows = board_rows(md)
    rs, py = rows.get("topk-rs"), rows.get("topk-py")
    same_runs = trajectory(os.path.join(d, "rs.json")) == trajectory(os.path.join(d, "py.json"))
    reruns = {}
    for p in glob.glob(os.path.join(d, "repro", "*.rerun.json")):
        reruns["py" if "py.bundle" in os.path.basename(p) else "rs"] = trajectory(p)
    same_reruns = len(reruns) == 2 and reruns["rs"] == reruns["py"]
    both = rs and py and rs[0] == py[0] and rs[0].startswith("=")
    shared += bool(both)
    print(f"| {f} | {rs[0] if rs else '-'} | {py[0] if py else '-'} | {'yes' if both else 'NO'} | {same_runs}, {same_reruns} | "
          f"{', '.join(rs[1]) if rs else '-'} | {', '.join(py[1]) if py else '-'} | {rs[2] if rs else ''}; {py[2] if py else ''} |")
print(f"\n{shared} of {n} flows: the two builds share a rank")
