#!/usr/bin/env python3
"""Finds circles between the modules of each crate of the workspace.

Every reference a module makes to another module of its crate counts:
`use` trees (`use crate::{a, b::c}`, `use super::x`), and inline paths in
code (`crate::a::f()`, `super::b::T`). Sibling modules are compared (the
children of one parent, each with everything below it): `a` depends on `b`
if anything inside `a` names anything inside `b`. A parent and its own
children may name each other (items of `mod.rs` used by a child are the
parent's to give). Prints each circle with one reference per edge, and
exits 1 if there is any.

Usage: scripts/module-cycles.py [CRATE_SRC_DIR...]   (default: every crate)
"""
import os
import re
import sys
from collections import defaultdict

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def strip(src):
    """The source with comments, strings and char literals blanked (lines kept)."""
    out, i, n = [], 0, len(src)
    blank = lambda s: re.sub(r"[^\n]", " ", s)
    while i < n:
        c = src[i]
        if src.startswith("//", i):
            j = src.find("\n", i)
            j = n if j < 0 else j
        elif src.startswith("/*", i):
            j, depth = i + 2, 1
            while depth and j < n:
                if src.startswith("/*", j):
                    depth, j = depth + 1, j + 2
                elif src.startswith("*/", j):
                    depth, j = depth - 1, j + 2
                else:
                    j += 1
        elif c in "rb" and re.match(r'(br|r)#*"', src[i : i + 12]) and not (i and (src[i - 1].isalnum() or src[i - 1] == "_")):
            m = re.match(r'(br|r)(#*)"', src[i:])
            end = '"' + m.group(2)
            j = src.find(end, i + len(m.group(0))) + len(end)
        elif c == '"':
            j = i + 1
            while j < n and src[j] != '"':
                j += 2 if src[j] == "\\" else 1
            j += 1
        elif c == "'" and re.match(r"'(\\[^']{1,10}|[^\\'])'", src[i : i + 13]):
            j = i + len(re.match(r"'(\\[^']{1,10}|[^\\'])'", src[i:]).group(0))
        else:
            out.append(c)
            i += 1
            continue
        out.append(blank(src[i:j]))
        i = j
    return "".join(out)


def modules(src_dir):
    """{module path tuple: file} for a crate's src folder."""
    mods = {}
    for dp, _, fs in os.walk(src_dir):
        for f in fs:
            if not f.endswith(".rs"):
                continue
            rel = os.path.relpath(os.path.join(dp, f), src_dir)[:-3].split(os.sep)
            if rel[-1] in ("lib", "main", "mod"):
                rel = rel[:-1]
            mods[tuple(rel)] = os.path.join(dp, f)
    return mods


def use_paths(tree, prefix=""):
    """Flattens a use tree `a::{b, c::{d}}` into full paths."""
    tree = tree.strip()
    m = re.match(r"^([\w:]*?)(::)?\{(.*)\}$", tree, re.S)
    if not m:
        return [prefix + tree.split(" as ")[0].strip()]
    head, body = m.group(1), m.group(3)
    parts, depth, cur = [], 0, ""
    for ch in body:
        if ch == "," and depth == 0:
            parts.append(cur)
            cur = ""
            continue
        depth += ch == "{"
        depth -= ch == "}"
        cur += ch
    parts.append(cur)
    base = prefix + head + ("::" if head else "")
    return [p for part in parts if part.strip() for p in use_paths(part, base)]


def resolve(path, here, mods):
    """The module (tuple) a path names, or None when outside the crate."""
    segs = [s for s in path.split("::") if s]
    if not segs:
        return None
    if segs[0] == "crate":
        cur, segs = (), segs[1:]
    elif segs[0] in ("super", "self"):
        cur = here
        while segs and segs[0] in ("super", "self"):
            if segs[0] == "super":
                cur = cur[:-1]
            segs = segs[1:]
    elif here + (segs[0],) in mods:
        cur = here  # a child module named without `self::`
    else:
        return None
    for s in segs:
        if cur + (s,) in mods:
            cur = cur + (s,)
        else:
            break
    return cur


def check(src_dir):
    mods = modules(src_dir)
    edges = defaultdict(dict)  # (parent, a) -> {b: "file:line: path"}
    path_re = re.compile(r"\b(?:crate|super|self)(?:::\w+)+|\b\w+(?:::\w+)+")
    for here, file in mods.items():
        text = strip(open(file, encoding="utf-8").read())
        refs = []
        for m in re.finditer(r"\buse\s+([^;]+);", text):
            line = text.count("\n", 0, m.start()) + 1
            refs += [(line, p) for p in use_paths(m.group(1))]
        for m in path_re.finditer(text):
            refs.append((text.count("\n", 0, m.start()) + 1, m.group(0)))
        # A module's own `mod.rs` is `here`; a file `a/b.rs` is here = (a, b).
        for line, p in refs:
            target = resolve(p, here, mods)
            if target is None or target == here:
                continue
            k = 0
            while k < min(len(here), len(target)) and here[k] == target[k]:
                k += 1
            if k == len(here) or k == len(target):
                continue  # parent and descendant
            parent, a, b = here[:k], here[k], target[k]
            where = f"{os.path.relpath(file, ROOT)}:{line}: {p}"
            edges[(parent, a)].setdefault(b, where)
    # Circles among siblings: strongly connected components (Tarjan).
    graph = defaultdict(dict)
    for (parent, a), bs in edges.items():
        graph[parent][a] = bs
    found = []
    for parent, g in graph.items():
        index, low, stack, on, comps, counter = {}, {}, [], set(), [], [0]

        def visit(v):
            index[v] = low[v] = counter[0]
            counter[0] += 1
            stack.append(v)
            on.add(v)
            for w in g.get(v, {}):
                if w not in index:
                    visit(w)
                    low[v] = min(low[v], low[w])
                elif w in on:
                    low[v] = min(low[v], index[w])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    comps.append(sorted(comp))

        for v in list(g):
            if v not in index:
                visit(v)
        for comp in comps:
            name = "::".join(parent) or "crate"
            lines = [f"{src_dir}: circle among {name}'s modules {', '.join(comp)}:"]
            for a in comp:
                for b, where in sorted(g.get(a, {}).items()):
                    if b in comp:
                        lines.append(f"  {a} -> {b}  ({where})")
            found.append("\n".join(lines))
    return found


def crates():
    for d in ["host/src", "sdk/src"] + sorted(os.path.join("crates", c, "src") for c in os.listdir(os.path.join(ROOT, "crates"))):
        if os.path.isdir(os.path.join(ROOT, d)):
            yield d


def main():
    dirs = sys.argv[1:] or list(crates())
    found = [c for d in dirs for c in check(os.path.join(ROOT, d) if not os.path.isabs(d) else d)]
    for c in found:
        print(c)
    if found:
        print(f"{len(found)} circle(s) between modules; break each (move the shared item down, or pass it in)", file=sys.stderr)
        return 1
    print(f"no circles between modules in {len(dirs)} crates")
    return 0


if __name__ == "__main__":
    sys.exit(main())
