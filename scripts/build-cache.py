#!/usr/bin/env python3
"""Copy a cargo target/ folder without the workspace's own build units.

    build-cache.py SRC DST        copy SRC to DST (DST must not exist)
    build-cache.py --size SRC     print the bytes such a copy would take
    build-cache.py --same SRC DST exit 0 if DST holds what a copy of SRC
                                  would (the same files, sizes and times)
    build-cache.py --self-test    check what a copy keeps on a made-up target/

The workspace's crates (harness*, the plugins, the test fixtures and every
test, bench and build-script target of them) are rebuilt by every fresh
clone anyway (its sources are newer than anything saved before it). Their
outputs are most of a target/ folder (each clone path and each change gives
them new hashes), so a cache that kept them grew by a build's worth on
every save. Only the third-party units (wasmtime, cranelift, tch, ...) are
copied, and neither target/doc nor target/tmp. Modification times are
kept: cargo compares them with the sources'.
"""

import json
import os
import re
import shutil
import subprocess
import sys

HASH = re.compile(r"-[0-9a-f]{16}$")
ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")


def workspace_units():
    """Names of the workspace's packages and targets, `-` read as `_`."""
    out = subprocess.run(
        ["cargo", "metadata", "--no-deps", "--format-version", "1", "--offline"],
        cwd=ROOT, check=True, capture_output=True, text=True).stdout
    names = set()
    for pkg in json.loads(out)["packages"]:
        names.add(pkg["name"])
        names.update(t["name"] for t in pkg["targets"])
    # Every package's build script is a target of this name; the package's
    # name, which cargo gives the script's folders, already covers it.
    names.discard("build-script-build")
    return {n.replace("-", "_") for n in names} | SCAFFOLDED


def unit_of(entry):
    """The unit an entry of a target/ folder belongs to, as cargo names it:
    `libfoo_bar-0123456789abcdef.rlib`, `foo-bar-0123456789abcdef` (a
    fingerprint or build-script folder), `foo.d`, `libfoo.so` -> foo_bar / foo."""
    stem = entry.split(".", 1)[0]
    stem = HASH.sub("", stem).replace("-", "_")
    return stem


def is_workspace(entry, units):
    stem = unit_of(entry)
    return stem in units or (stem.startswith("lib") and stem[3:] in units)


# Where cargo puts one entry per unit; inside a unit's own folder (a build
# script's out/, say) names are the unit's business and all kept.
UNIT_FOLDERS = {"deps", ".fingerprint", "build", "incremental", "examples"}
# Folders of target/ itself that are no build: the docs, scratch files and
# the plugin artifacts (scripts/build-plugins.sh copies the workspace's
# plugins there: rebuilt by every clone).
NOT_BUILDS = {"doc", "tmp", "plugins"}
# The crate tests/cli/plugins.rs scaffolds with `harness plugin new` and
# builds into target/scaffold-test (to share its SDK's dependencies): new
# sources in every run, so rebuilt by every run, as the workspace's are.
SCAFFOLDED = {"my_avg"}


def walk(src, units):
    """Yield (path relative to src, is_dir) for what the copy keeps."""
    for top, dirs, files in os.walk(src):
        rel = os.path.relpath(top, src)
        if rel == ".":
            dirs[:] = [d for d in dirs if d not in NOT_BUILDS]
        # A profile folder (release/, wasm32-wasip2/release/) holds the
        # final artifacts beside its .fingerprint/.
        if os.path.basename(top) in UNIT_FOLDERS or ".fingerprint" in dirs:
            dirs[:] = [d for d in dirs if d in UNIT_FOLDERS or not is_workspace(d, units)]
            files = [f for f in files if not is_workspace(f, units)]
        for d in dirs:
            yield os.path.normpath(os.path.join(rel, d)), True
        for f in files:
            yield os.path.normpath(os.path.join(rel, f)), False


def self_test():
    """A made-up target/ with the workspace's units and third-party ones:
    the copy keeps exactly the third-party ones, with their times."""
    import tempfile
    units = {"harness", "harness_format", "harness_kernels", "harness_plugin_topk", "harness_sdk", "cli"} | SCAFFOLDED
    h = "0123456789abcdef"
    keep = [f"release/deps/libserde-{h}.rlib", f"release/deps/serde-{h}.d",
            f"release/.fingerprint/serde-{h}/lib-serde", f"release/build/torch-sys-{h}/out/harness.h",
            f"release/build/torch-sys-{h}/build-script-build", f"wasm32-wasip2/release/deps/libwit_bindgen-{h}.rlib",
            f"wasm32-wasip2/release/.fingerprint/serde-{h}/lib-serde", f"scaffold-test/wasm32-wasip2/release/deps/libwit_bindgen-{h}.rlib", "CACHEDIR.TAG",
            "release/.cargo-lock", ".rustc_info.json"]
    drop = [f"release/deps/libharness_format-{h}.rlib", f"release/deps/harness_format-{h}", f"release/deps/cli-{h}",
            f"release/deps/harness-{h}.d", f"release/.fingerprint/harness-kernels-{h}/lib-harness_kernels",
            f"release/build/harness-kernels-{h}/out/k.o", "release/harness", "release/libharness_plugin_topk.so",
            "release/libharness_plugin_topk.d", f"release/incremental/harness_sdk-{h}/s-1/dep-graph.bin",
            "doc/harness/index.html", "tmp/scratch", "plugins/topk.wasm", "plugins/harness.wasm",
            "scaffold-test/wasm32-wasip2/release/deps/my_avg.wasm", f"scaffold-test/wasm32-wasip2/release/.fingerprint/my-avg-{h}/lib-my_avg",
            f"wasm32-wasip2/release/deps/libharness_sdk-{h}.rlib", "wasm32-wasip2/release/harness_plugin_topk.wasm"]
    with tempfile.TemporaryDirectory() as tmp:
        src, dst = os.path.join(tmp, "target"), os.path.join(tmp, "copy")
        for rel in keep + drop:
            os.makedirs(os.path.dirname(os.path.join(src, rel)), exist_ok=True)
            with open(os.path.join(src, rel), "w") as f:
                f.write(rel)
            os.utime(os.path.join(src, rel), (1_000_000_000, 1_000_000_000))
        copy(src, dst, units)
        got = sorted(os.path.relpath(os.path.join(t, f), dst) for t, _, fs in os.walk(dst) for f in fs)
        assert got == sorted(keep), f"kept {got}, not {sorted(keep)}"
        assert all(os.stat(os.path.join(dst, k)).st_mtime == 1_000_000_000 for k in keep), "times not kept"
        assert size(src, units) == sum(len(k) for k in keep), "the size counts other files"
        assert same(src, dst, units), "a copy differs from what it copied"
        os.utime(os.path.join(src, "release/.cargo-lock"), (2_000_000_000, 2_000_000_000))
        assert same(src, dst, units), "cargo's lock file, touched by every build, counted as a unit"
        os.utime(os.path.join(src, keep[0]), (2_000_000_000, 2_000_000_000))
        assert not same(src, dst, units), "a rebuilt unit (a newer time) went unseen"
        os.utime(os.path.join(src, keep[0]), (1_000_000_000, 1_000_000_000))
        with open(os.path.join(src, "release/deps/libnew-" + h + ".rlib"), "w") as f:
            f.write("new")
        assert not same(src, dst, units), "a new unit went unseen"
        os.remove(os.path.join(src, "release/deps/libnew-" + h + ".rlib"))
        os.remove(os.path.join(src, keep[0]))
        assert not same(src, dst, units), "a removed unit went unseen"
    print("build-cache.py: self-test passed")
    return 0


def listing(src, units):
    """What a copy of src holds: each file's path, size and time; each
    link's path and target."""
    out = {}
    for rel, is_dir in walk(src, units):
        path = os.path.join(src, rel)
        if os.path.islink(path):
            out[rel] = ("link", os.readlink(path))
        elif not is_dir:
            st = os.lstat(path)
            out[rel] = (st.st_size, st.st_mtime_ns)
    return out


# Cargo's own bookkeeping, rewritten by every build: no build unit.
BOOKKEEPING = {".cargo-lock", ".rustc_info.json"}


def same(src, dst, units):
    """Whether dst (a copy made earlier) holds what a copy of src would:
    then a save has nothing to write. Folders and cargo's bookkeeping files
    are not compared (folders' times follow their files)."""
    if not os.path.isdir(dst):
        return False

    def units_of(listed):
        return {k: v for k, v in listed.items() if os.path.basename(k) not in BOOKKEEPING}
    # The copy of a copy keeps what it holds: its listing needs no filter.
    return units_of(listing(src, units)) == units_of(listing(dst, set()))


def size(src, units):
    return sum(v[0] for v in listing(src, units).values() if v[0] != "link")


def copy(src, dst, units):
    os.makedirs(dst)
    dirs = []
    for rel, is_dir in walk(src, units):
        s, d = os.path.join(src, rel), os.path.join(dst, rel)
        if os.path.islink(s):
            os.symlink(os.readlink(s), d)
        elif is_dir:
            os.makedirs(d)
            dirs.append((s, d))
        else:
            shutil.copy2(s, d)
    # Folders' times last: filling a folder changes its time.
    for s, d in reversed(dirs):
        shutil.copystat(s, d)


def main(argv):
    if argv == ["--self-test"]:
        return self_test()
    units = workspace_units()
    if argv[:1] == ["--size"] and len(argv) == 2:
        print(size(argv[1], units))
        return 0
    if argv[:1] == ["--same"] and len(argv) == 3:
        return 0 if same(argv[1], argv[2], units) else 1
    if len(argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    src, dst = argv
    if os.path.exists(dst):
        print(f"build-cache.py: {dst} exists; copy to a new folder", file=sys.stderr)
        return 2
    copy(src, dst, units)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
