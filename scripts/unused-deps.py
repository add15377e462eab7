#!/usr/bin/env python3
"""Fails when a workspace member's manifest declares a dependency that its
code never names: every crate under `[dependencies]` (and the
target-specific ones) must appear in the member's `src/` or `build.rs`,
every `[dev-dependencies]` crate in `src/`, `tests/`, `benches/` or
`examples/`, every `[build-dependencies]` crate in `build.rs`, as
`name::`, `use name`, `extern crate name` or `#[name::...]`, with a dash
in the name read as an underscore and a renamed dependency by its key.
A dependency that is needed without being named (one that only turns on
a feature of another, a `links` crate) is listed, with why, under
`[package.metadata.unused-deps] ignored = ["name"]`.

This is the check `cargo udeps` would make, without a nightly toolchain or
a build: it reads the sources, so a name in a comment or a string counts
as a use (it misses some unused crates, never flags a used one).

Usage: scripts/unused-deps.py [--self-test | MEMBER_DIR...]   (default: every member)
"""
import os
import re
import sys
import tempfile
import tomllib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

TABLES = {
    "dependencies": ("src", "build.rs"),
    "dev-dependencies": ("src", "tests", "benches", "examples"),
    "build-dependencies": ("build.rs",),
}


def members():
    with open(os.path.join(ROOT, "Cargo.toml"), "rb") as f:
        ws = tomllib.load(f)["workspace"]
    return [os.path.join(ROOT, m) for m in ws["members"]]


def sources(member, places):
    """The text of every .rs file under `places` of `member`."""
    out = []
    for place in places:
        path = os.path.join(member, place)
        if os.path.isfile(path):
            out.append(open(path, encoding="utf-8", errors="replace").read())
            continue
        for dirpath, _, files in os.walk(path):
            for name in files:
                if name.endswith(".rs"):
                    out.append(open(os.path.join(dirpath, name), encoding="utf-8", errors="replace").read())
    return "\n".join(out)


def declared(manifest):
    """(table, key) of every dependency, target-specific ones included."""
    found = []
    for table in TABLES:
        for key in manifest.get(table, {}):
            found.append((table, key))
        for target in manifest.get("target", {}).values():
            for key in target.get(table, {}):
                found.append((table, key))
    return found


def used(name, text):
    ident = re.escape(name.replace("-", "_"))
    return re.search(rf"(\b{ident}\s*::|\buse\s+{ident}\b|\bextern\s+crate\s+{ident}\b)", text) is not None


def check(member):
    with open(os.path.join(member, "Cargo.toml"), "rb") as f:
        manifest = tomllib.load(f)
    meta = manifest.get("package", {}).get("metadata", {}).get("unused-deps", {})
    ignored = set(meta.get("ignored", []))
    # Targets declared elsewhere (host's tests in the top-level tests/cli):
    # their folders count as the member's.
    extra = {
        kind: [os.path.relpath(os.path.dirname(os.path.join(member, t["path"])), member) for t in manifest.get(kind, []) if "path" in t]
        for kind in ("test", "bench", "example")
    }
    places = dict(TABLES)
    places["dev-dependencies"] = TABLES["dev-dependencies"] + tuple(p for ps in extra.values() for p in ps)
    texts = {table: sources(member, ps) for table, ps in places.items()}
    rel = os.path.relpath(os.path.join(member, "Cargo.toml"), ROOT)
    return [
        f"{rel}: [{table}] `{key}` is never named in its {', '.join(places[table])}: remove it, or list it under "
        f"[package.metadata.unused-deps] ignored with why"
        for table, key in declared(manifest)
        if key not in ignored and not used(key, texts[table])
    ]


def self_test():
    """The rules on a made-up member: a named crate passes, an unnamed one,
    a dev-dependency named only in src's sibling folders and a renamed one
    are told apart, an ignored one passes."""
    with tempfile.TemporaryDirectory() as d:
        os.makedirs(os.path.join(d, "src"))
        os.makedirs(os.path.join(d, "tests"))
        with open(os.path.join(d, "Cargo.toml"), "w") as f:
            f.write('[package]\nname = "x"\n[package.metadata.unused-deps]\nignored = ["links-only"]\n'
                    '[dependencies]\nserde-json = "1"\nunused-one = "1"\nlinks-only = "1"\n'
                    '[dev-dependencies]\ninsta = "1"\ntempfile = "3"\n')
        with open(os.path.join(d, "src", "lib.rs"), "w") as f:
            f.write("use serde_json::Value;\n")
        with open(os.path.join(d, "tests", "t.rs"), "w") as f:
            f.write("fn t() { insta::assert_snapshot!(1); }\n")
        got = sorted(p.split("`")[1] for p in check(d))
        if got != ["tempfile", "unused-one"]:
            sys.exit(f"unused-deps self-test: expected tempfile and unused-one flagged, got {got}")
    print("unused-deps self-test: as expected")


def main():
    if sys.argv[1:] == ["--self-test"]:
        return self_test()
    dirs = [os.path.abspath(d) for d in sys.argv[1:]] or members()
    problems = [p for d in dirs for p in check(d)]
    for p in problems:
        print(p, file=sys.stderr)
    if problems:
        sys.exit(1)
    print(f"every dependency named in its code, {len(dirs)} manifests")


if __name__ == "__main__":
    main()
