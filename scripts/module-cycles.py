#!/usr/bin/env python3
"""Finds circles between the modules of each crate of the workspace.

The modules: those the crate declares, following `mod` declarations from
`lib.rs` (and from `main.rs`, a crate of its own) to `x.rs`, `x/mod.rs` or
the file a `#[path = "..."]` attribute names. An inline `mod x { ... }` is
a module too: paths inside it start from it (`super::` in a `mod tests` is
the module of its file).

A reference from one module to another of its crate is
- a `use` tree (`use crate::{a, b::c}`, `use super::x`, `use a::*`);
- a path in code (`crate::a::f()`, `super::b::T`, `child::f()`), in the
  body of a `macro_rules!` (`$crate::` is `crate::`) or in a macro
  invocation's arguments; a bare `m!(...)` of a `macro_rules! m` that an
  enclosing module defines;
- a name that a `use` brought in, where the code names it (`Training`
  after `use training::Training`; any name of a glob import's module).
A name is followed to the module that defines it: `pub use a::X;` (or
`pub(crate) use a::{X, Y}`, `pub use a::*`, or a private `use` that a child
reaches as `super::X`) in module `m` makes `crate::m::X` a reference to
`a`, not to `m`. A name from another crate is no reference.

The graph: the children of each parent module are compared, each with
everything below it (`a` depends on `b` if anything inside `a` names
anything inside `b`), and a parent with code of its own is one more node
among them, shown as `[lib.rs]`, `[dp/mod.rs]`. Its own code is what it
holds beyond `mod` declarations, `use` declarations and re-exports, and
docs; its inline modules are part of it (the same file), its
`#[cfg(test)]` ones are not (modules of their own). A child that names an
item the parent defines depends on the parent's node; the parent's node
depends on each child whose items its code names (a `use` in the parent
counts only where the parent's code uses the name: a re-export alone is no
dependency). So a parent cannot be both the shared context of its children
and the code that drives them (`EntryContext` in train's lib.rs, named by
`training::setup` while `run_entry` names `training`): the shared item
moves into a module of its own, which the parent and the others import.

Allowed: a child that extends a type its parent defines with an inherent
`impl` block (`impl DataParallel { ... }` in train's dp/zero.rs and
dp/overlap.rs, where dp/mod.rs defines `DataParallel`) holds part of that
type's methods, split off by concern; they reach the type's private fields
and the parent's helpers because they are its descendants. Such a child
counts as part of the parent's own items (its `#[cfg(test)]` code does
not): the two may name each other, and a circle through any other sibling
is still one (dp/plan.rs naming an item of dp/mod.rs while dp/mod.rs names
`plan::DpPlan`).

Prints each circle with one reference per edge and exits 1 if there is
any. `--self-test` checks these rules on scripts/module-cycles-fixtures/
(each folder the src of a small crate, the circles it must show listed in
its `expected` file, one a line); scripts/test.sh runs both.

Limits: names are matched as text, not typed: a method call names nothing
(`self.hook()`), and an item a macro generates is unknown (a path to it
counts as a reference to the module it is named through).

Usage: scripts/module-cycles.py [--self-test | CRATE_SRC_DIR...]   (default: every crate)
"""
import bisect
import os
import re
import sys
from collections import defaultdict

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OWN = "@own"  # the node of a parent's own items among its children

KEYWORDS = set(
    "as async await break const continue crate dyn else enum extern false fn for if impl in let loop match mod move mut pub ref "
    "return self Self static struct super trait true type unsafe use where while union macro_rules".split()
)


SPECIAL = re.compile(r"""//|/\*|(?<![\w])(?:br|r)#*"|"|'""")


def strip(src):
    """The source with comments, strings and char literals blanked (offsets and lines kept)."""
    out, i, n = [], 0, len(src)
    blank = lambda s: re.sub(r"[^\n]", " ", s)
    while i < n:
        m = SPECIAL.search(src, i)
        if not m:
            out.append(src[i:])
            break
        out.append(src[i : m.start()])
        i, tok = m.start(), m.group(0)
        if tok == "//":
            j = src.find("\n", i)
            j = n if j < 0 else j
        elif tok == "/*":
            j, depth = i + 2, 1
            while depth and j < n:
                if src.startswith("/*", j):
                    depth, j = depth + 1, j + 2
                elif src.startswith("*/", j):
                    depth, j = depth - 1, j + 2
                else:
                    j += 1
        elif tok[0] in "rb":
            end = '"' + tok[tok.index("#") : -1] if "#" in tok else '"'
            j = src.find(end, m.end())
            j = n if j < 0 else j + len(end)
        elif tok == '"':
            j = i + 1
            while j < n and src[j] != '"':
                j += 2 if src[j] == "\\" else 1
            j += 1
        else:  # a char literal, or a lifetime (kept)
            c = re.match(r"'(\\[^']{1,10}|[^\\'])'", src[i : i + 13])
            if not c:
                out.append(tok)
                i += 1
                continue
            j = i + len(c.group(0))
        out.append(blank(src[i:j]))
        i = j
    return "".join(out)


def blank_spans(text, spans):
    """The text with each (start, end) span blanked (newlines kept)."""
    out, last = [], 0
    for a, b in sorted(spans):
        a = max(a, last)
        if b <= a:
            continue
        out.append(text[last:a])
        out.append(re.sub(r"[^\n]", " ", text[a:b]))
        last = b
    out.append(text[last:])
    return "".join(out)


def matching_brace(text, i):
    """The index after the `}` that closes the `{` at i."""
    depth = 0
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return j + 1
    return len(text)


MOD = re.compile(r"\bmod\s+(\w+)\s*([{;])")
ATTRS_BEFORE = re.compile(r"((?:#\[[^\]]*\]\s*)*)(?:pub(?:\s*\([^)]*\))?\s+)?$")


def mods_in(text, kind):
    """(start, name, attributes, end) of each `mod name;` (kind ";") or the
    `mod name {` (kind "{") of an inline module; start includes its attributes."""
    for m in MOD.finditer(text):
        if m.group(2) != kind:
            continue
        before = text[max(0, m.start() - 600) : m.start()]
        a = ATTRS_BEFORE.search(before)
        yield m.start() - len(before) + a.start(), m.group(1), a.group(1), m.end()


USE = re.compile(r"\buse\s+([^;]+);")
PATH = re.compile(r"(?<![\w$])(?:\$crate|[A-Za-z_]\w*)(?:::[A-Za-z_]\w*)+")
WORD = re.compile(r"(?<![\w$.])(?<!::)[A-Za-z_]\w*\b(?!\s*:(?!:))")
MACRO_CALL = re.compile(r"(?<![\w$.:])([A-Za-z_]\w*)!\s*[\(\[\{]")
DEFS = re.compile(
    r"\b(?:fn|struct|enum|union|trait|type|static(?:\s+mut)?|const(?!\s+(?:fn|unsafe|async|extern)\b)|macro_rules!)\s+([A-Za-z_]\w*)"
)
TYPE_DEFS = re.compile(r"\b(?:struct|enum|union|type)\s+([A-Za-z_]\w*)")
MACRO_DEFS = re.compile(r"\bmacro_rules!\s+([A-Za-z_]\w*)")
EXPORTED_MACRO = re.compile(r"#\[macro_export\]\s*(?:#\[[^\]]*\]\s*)*macro_rules!\s+([A-Za-z_]\w*)")
INHERENT_IMPL = re.compile(r"\bimpl\s*(?:<[^{;]*?>\s*)?((?:(?:\$crate|\w+)::)*\w+)\s*(?:<[^{;]*>\s*)?(?:where\b[^{;]*)?\{")


class Module:
    def __init__(self, path, file, text, child_dir, inline, test):
        self.path, self.file, self.inline, self.test = path, file, inline, test
        self.child_dir = child_dir  # where `mod x;` inside it looks for x.rs / x/mod.rs
        self.newlines = [m.start() for m in re.finditer("\n", text)]
        self.uses = []  # (line, path segs, is_glob)
        self.bindings = {}  # name -> path segs, as written
        self.globs = []  # path segs of `use a::*`
        spans = []
        for m in USE.finditer(text):
            tree = m.group(1)
            if not re.fullmatch(r"[\w:{},*\s]+", tree):
                continue  # not a `use` declaration (`impl Trait + use<'a>`)
            line = self.line(m.start())
            for path, alias in use_paths(tree):
                segs = [s for s in path.split("::") if s]
                if not segs:
                    continue
                glob = segs[-1] == "*"
                if glob:
                    segs = segs[:-1]
                    self.globs.append(segs)
                elif segs[-1] == "self":
                    segs = segs[:-1]
                    if segs and alias != "_":
                        self.bindings[alias or segs[-1]] = segs
                elif alias != "_":
                    self.bindings[alias or segs[-1]] = segs
                if segs:
                    self.uses.append((line, segs, glob))
            spans.append((m.start(), m.end()))
        spans += [(start, end) for start, _, _, end in mods_in(text, ";")]
        text = blank_spans(text, spans)
        self.code = text  # what remains: the module's own items (and attributes)
        # The module's items: definitions outside any braces (a method, or a
        # function's local item, is not one).
        top = top_level(text)
        self.defs = set(DEFS.findall(top))
        self.type_defs = set(TYPE_DEFS.findall(top))
        self.macros = set(MACRO_DEFS.findall(top))
        self.exported_macros = set(EXPORTED_MACRO.findall(top))
        self.impls = [m.group(1) for m in INHERENT_IMPL.finditer(text) if not re.search(r"\bfor\b", m.group(0))]
        self.words = {}
        for m in WORD.finditer(text):
            if m.group(0) not in KEYWORDS:
                self.words.setdefault(m.group(0), m.start())

    def line(self, offset):
        return bisect.bisect_left(self.newlines, offset) + 1


def top_level(text):
    """The text with everything inside braces blanked."""
    out, depth, last = [], 0, 0
    for m in re.finditer(r"[{}]", text):
        if m.group(0) == "{":
            if depth == 0:
                out.append(text[last : m.start() + 1])
                last = m.start() + 1
            depth += 1
        elif depth:
            depth -= 1
            if depth == 0:
                out.append(re.sub(r"[^\n]", " ", text[last : m.start()]))
                last = m.start()
    out.append(text[last:] if depth == 0 else re.sub(r"[^\n]", " ", text[last:]))
    return "".join(out)


def use_paths(tree, prefix=""):
    """Flattens a use tree `a::{b, c::{d as e}}` into (full path, alias)."""
    tree = tree.strip()
    m = re.match(r"^([\w:]*?)(::)?\{(.*)\}$", tree, re.S)
    if not m:
        path, _, alias = tree.partition(" as ")
        return [(prefix + path.strip(), alias.strip() or None)]
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


def load_crate(root_file):
    """{module path tuple: Module}, following `mod` declarations from a crate root."""
    mods = {}

    def visit(path, file, raw, text, child_dir, inline, test):
        # Inline modules first: their text is theirs, not the enclosing module's.
        spans = []
        for start, name, attrs, end in mods_in(text, "{"):
            if spans and start < spans[-1][1]:
                continue  # inside an inline module already taken
            open_at = end - 1
            close = matching_brace(text, open_at)
            inner = blank_spans(text, [(0, open_at + 1), (close - 1, len(text))])
            is_test = test or bool(re.search(r"\bcfg\s*\(\s*test\s*\)", attrs))
            visit(path + (name,), file, raw, inner, os.path.join(child_dir, name), True, is_test)
            spans.append((start, close))
        text = blank_spans(text, spans)
        for start, name, attrs, end in mods_in(text, ";"):
            attr = re.search(r'#\[\s*path\s*=\s*"([^"]*)"\s*\]', raw[start:end])
            if attr:
                base = child_dir if inline else os.path.dirname(file)
                candidates = [os.path.join(base, attr.group(1))]
            else:
                candidates = [os.path.join(child_dir, name + ".rs"), os.path.join(child_dir, name, "mod.rs")]
            is_test = test or bool(re.search(r"\bcfg\s*\(\s*test\s*\)", attrs))
            for f in candidates:
                if os.path.isfile(f):
                    load(path + (name,), os.path.normpath(f), bool(attr), is_test)
                    break
        mods[path] = Module(path, file, text, child_dir, inline, test)

    def load(path, file, by_path_attr, test):
        raw = open(file, encoding="utf-8").read()
        stem = os.path.splitext(os.path.basename(file))[0]
        # A file named by `#[path]` is a mod.rs-like file: its `mod x;` is x.rs beside it.
        mod_rs = not path or stem == "mod" or by_path_attr
        child_dir = os.path.dirname(file) if mod_rs else os.path.join(os.path.dirname(file), stem)
        visit(path, file, raw, strip(raw), child_dir, False, test)

    load((), root_file, False, False)
    return mods


EXTERNAL = ("ext", None)


class Resolver:
    def __init__(self, mods):
        self.mods = mods
        self.exported_macros = {name: path for path, m in mods.items() for name in m.exported_macros}

    def lookup(self, mod, name, seen=frozenset()):
        """What `name` in module `mod` is: ("mod", path) for a module, ("item", path)
        for an item the module `path` defines, EXTERNAL for a name from outside the
        crate, None when unknown."""
        if (mod, name) in seen:
            return None
        seen = seen | {(mod, name)}
        m = self.mods[mod]
        if mod + (name,) in self.mods:
            return ("mod", mod + (name,))
        if name in m.bindings:
            return self.follow(m.bindings[name], mod, seen) or EXTERNAL
        if name in m.defs:
            return ("item", mod)
        for segs in m.globs:
            src = self.follow(segs, mod, seen)
            if src and src[0] == "mod":
                r = self.lookup(src[1], name, seen)
                if r:
                    return r
        if not mod and name in self.exported_macros:  # `#[macro_export]`: `crate::name!`
            return ("item", self.exported_macros[name])
        return None

    def follow(self, segs, here, seen):
        segs = ["crate" if s == "$crate" else s for s in segs]
        if segs[0] == "crate":
            cur, segs = ("mod", ()), segs[1:]
        elif segs[0] in ("super", "self"):
            path = here
            while segs and segs[0] in ("super", "self"):
                if segs[0] == "super":
                    path = path[:-1]
                segs = segs[1:]
            cur = ("mod", path)
        else:
            cur = self.lookup(here, segs[0], seen)
            segs = segs[1:]
        for s in segs:
            if cur is None or cur[0] != "mod":
                break
            nxt = self.lookup(cur[1], s, seen)
            if nxt is None:
                return ("item", cur[1])  # a name the script cannot see defined: the module's own
            cur = nxt
        return None if cur == EXTERNAL else cur

    def resolve(self, segs, here):
        """Where a path written in module `here` leads: ("mod", path), ("item", path
        of the module that defines it), or None (outside the crate)."""
        return self.follow(segs, here, frozenset())


def check(src_dir):
    found = []
    for root in ("lib.rs", "main.rs"):
        if os.path.isfile(os.path.join(src_dir, root)):
            found += check_crate(src_dir, root)
    return found


def node_label(mods, parent, src_dir):
    m = mods[parent]
    rel = os.path.relpath(m.file, src_dir)
    return f"[{rel}{' mod ' + parent[-1] if m.inline else ''}]"


def check_crate(src_dir, root):
    mods = load_crate(os.path.join(src_dir, root))
    res = Resolver(mods)

    # Children that extend a type of their parent's with an inherent impl.
    extends = {}
    for path, m in mods.items():
        if not path:
            continue
        parent = path[:-1]
        for ty in m.impls:
            r = res.resolve(ty.split("::"), path)
            if r == ("item", parent) and ty.split("::")[-1] in mods[parent].type_defs:
                extends[path] = ty.split("::")[-1]

    def node(parent, path):
        """The node of module `path` among the children of `parent`: the child's
        name, or OWN where the child is part of the parent's own items (an inline
        module, a child that extends a type of the parent's); test code in it
        (`#[cfg(test)]`) is not, unless the parent is test code too."""
        child = path[: len(parent) + 1]
        merged = mods[child].inline or child in extends
        return OWN if merged and mods[path].test == mods[parent].test else child[-1]

    edges = defaultdict(lambda: defaultdict(dict))  # parent -> a -> {b: where}

    def add(here, kind, target, where):
        if target is None:
            return
        what, t = target
        if t == here:
            return
        k = 0
        while k < min(len(here), len(t)) and here[k] == t[k]:
            k += 1
        if k < len(here) and k < len(t):
            parent, a, b = here[:k], node(here[:k], here), node(here[:k], t)
        elif k == len(here):  # the parent's own code names something below it
            if kind != "code":
                return
            parent, a, b = here, OWN, node(here, t)
        else:  # a module names its ancestor t
            if what != "item":
                return
            parent, a, b = t, node(t, here), OWN
        if a != b:
            edges[parent][a].setdefault(b, where)

    # Code before tests, outer modules before inner ones: the first reference
    # recorded for an edge is the one shown.
    for here, m in sorted(mods.items(), key=lambda kv: (kv[1].test, len(kv[0]), kv[0])):
        rel = os.path.relpath(m.file, ROOT)

        def where(offset_or_line, text, is_line=False, resolved=None):
            line = offset_or_line if is_line else m.line(offset_or_line)
            via = ""
            if resolved and resolved[1] != here:
                via = f"  = {'::'.join(('crate',) + resolved[1])}{'' if resolved[0] == 'mod' else ' item'}"
            return f"{rel}:{line}: {text}{via}"

        for line, segs, glob in m.uses:
            r = res.resolve(segs, here)
            add(here, "use", r, where(line, "use " + "::".join(segs) + ("::*" if glob else ""), True, r))
        for p in PATH.finditer(m.code):
            r = res.resolve(p.group(0).split("::"), here)
            add(here, "code", r, where(p.start(), p.group(0), resolved=r))
        for name, off in m.words.items():
            if name in m.bindings:
                r = res.resolve(m.bindings[name], here)
                if r and r[0] == "item":  # a module's name is followed where a path starts with it
                    add(here, "code", r, where(off, name, resolved=r))
            elif m.globs and name not in m.defs:
                for segs in m.globs:
                    src = res.resolve(segs, here)
                    if src and src[0] == "mod":
                        r = res.lookup(src[1], name, frozenset())
                        if r and r[0] == "item":
                            add(here, "code", r, where(off, name + " (use " + "::".join(segs) + "::*)", resolved=r))
                            break
        for mc in MACRO_CALL.finditer(m.code):
            name = mc.group(1)
            if name in m.macros or name in m.bindings:
                continue
            for k in range(len(here) - 1, -1, -1):
                if name in mods[here[:k]].macros:
                    add(here, "code", ("item", here[:k]), where(mc.start(), name + "!", resolved=("item", here[:k])))
                    break

    # Circles among siblings: strongly connected components (Tarjan).
    found = []
    for parent, g in edges.items():
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
        label = lambda v: node_label(mods, parent, src_dir) if v == OWN else v
        for comp in comps:
            name = "::".join(parent) or "crate"
            merged = sorted(p[-1] for p in mods if p and p[:-1] == parent and node(parent, p) == OWN)
            note = f" ({', '.join(merged)} counted as its own items)" if OWN in comp and merged else ""
            lines = [f"{src_dir}: circle among {name}'s modules {', '.join(label(v) for v in comp)}{note}:"]
            for a in comp:
                for b, w in sorted(g.get(a, {}).items()):
                    if b in comp:
                        lines.append(f"  {label(a)} -> {label(b)}  ({w})")
            found.append((f"{name}: {', '.join(label(v) for v in comp)}", "\n".join(lines)))
    return found


def crates():
    for d in ["host/src", "sdk/src"] + sorted(os.path.join("crates", c, "src") for c in os.listdir(os.path.join(ROOT, "crates"))):
        if os.path.isdir(os.path.join(ROOT, d)):
            yield d


def self_test():
    """Each folder of scripts/module-cycles-fixtures is a crate's src; its `expected`
    file lists the circles the check must find, one a line (none: empty)."""
    base = os.path.join(ROOT, "scripts", "module-cycles-fixtures")
    failed = 0
    cases = sorted(d for d in os.listdir(base) if os.path.isdir(os.path.join(base, d)))
    for case in cases:
        d = os.path.join(base, case)
        got = sorted(short for short, _ in check(d))
        with open(os.path.join(d, "expected"), encoding="utf-8") as f:
            want = sorted(l.strip() for l in f if l.strip() and not l.startswith("#"))
        if got != want:
            failed += 1
            print(f"module-cycles self-test {case}: expected {want}, found {got}", file=sys.stderr)
            for _, text in check(d):
                print(text, file=sys.stderr)
    if failed:
        return 1
    print(f"module-cycles self-test: {len(cases)} fixtures as expected")
    return 0


def main():
    if sys.argv[1:] == ["--self-test"]:
        return self_test()
    dirs = sys.argv[1:] or list(crates())
    found = [c for d in dirs for _, c in check(os.path.join(ROOT, d) if not os.path.isabs(d) else d)]
    for c in found:
        print(c)
    if found:
        print(f"{len(found)} circle(s) between modules; break each (move the shared item down, or pass it in)", file=sys.stderr)
        return 1
    print(f"no circles between modules in {len(dirs)} crates")
    return 0


if __name__ == "__main__":
    sys.exit(main())
