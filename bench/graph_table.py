#!/usr/bin/env python3
"""The table of bench/gpu_graphs.sh: per entry, eager against CUDA-graph runs.

    bench/graph_table.py DIR NAME

reads DIR/NAME-eager-*.json and DIR/NAME-graph-*.json (harness results)."""
import glob, json, os, sys

d, name = sys.argv[1], sys.argv[2]


def load(mode):
    runs = {}
    for p in sorted(glob.glob(os.path.join(d, f"{name}-{mode}-*.json"))):
        for e in json.load(open(p))["entries"]:
            runs.setdefault(e["id"], []).append(e)
    return runs


eager, graph = load("eager"), load("graph")
print(f"{'entry':44s} {'eager tok/s':>22s} {'graph tok/s':>22s} {'ratio':>6s} {'graph p50':>9s} {'replays':>7s} {'max |dloss|':>11s} {'peak alloc GiB e/g':>18s} {'reserved GiB e/g':>16s}")
for eid in sorted(set(eager) | set(graph)):
    es, gs = eager.get(eid, []), graph.get(eid, [])
    ok = lambda rs: [r for r in rs if r["status"] == "ok"]
    if not ok(es) or not ok(gs):
        bad = [r for r in es + gs if r["status"] != "ok"]
        print(f"{eid:44s} FAILED: {bad[0].get('error', '')[:200] if bad else 'missing'}")
        continue
    es, gs = ok(es), ok(gs)
    tps = lambda rs: [r["metrics"]["tokens_per_s"] for r in rs]
    mean = lambda xs: sum(xs) / len(xs)
    te, tg = tps(es), tps(gs)
    gm = gs[0]["metrics"]
    p50 = gm.get("phases", {}).get("graph", {}).get("p50_ms")
    # The loss curves of the first run of each: same seed, same steps.
    ce = {s: l for s, _, l in es[0]["metrics"]["loss_curve"]}
    cg = {s: l for s, _, l in gm["loss_curve"]}
    common = sorted(set(ce) & set(cg))
    dl = max((abs(ce[s] - cg[s]) for s in common), default=float("nan"))
    mem = lambda m, k: m["memory"].get(k, 0) / 2**30
    em = es[0]["metrics"]
    print(
        f"{eid:44s} {' / '.join(f'{t:,.0f}' for t in te):>22s} {' / '.join(f'{t:,.0f}' for t in tg):>22s} "
        f"{mean(tg) / mean(te):6.3f} {p50 if p50 is not None else float('nan'):9.2f} {gm.get('cuda_graph_steps', 0):7d} {dl:11.2e} "
        f"{mem(em, 'peak_device_allocated_bytes'):8.2f}/{mem(gm, 'peak_device_allocated_bytes'):<8.2f} "
        f"{mem(em, 'peak_device_reserved_bytes'):7.2f}/{mem(gm, 'peak_device_reserved_bytes'):<7.2f}"
    )
