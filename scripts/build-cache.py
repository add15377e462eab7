#!/usr/bin/env python3
"""Copy a cargo target/ folder without the workspace's own build units.

    build-cache.py SRC DST        copy SRC to DST (DST must not exist)
    build-cache.py --size SRC     print the bytes such a copy would take

The workspace's crates (harness*, the plugins, the test fixtures and every
test, bench and build-script target of them) are rebuilt by every fresh
clone anyway: scripts/build-cache.sh removes their fingerprints on restore.
Their outputs are most of a target/ folder (each clone path and each change
gives them new hashes), so a cache that kept them grew by a build's worth on
every save. Only the third-party units (wasmtime, cranelift, tch, ...) are
copied. Modification times are kept: cargo compares them with the sources'.
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
    return {n.replace("-", "_") for n in names}


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


def walk(src, units):
    """Yield (path relative to src, is_dir) for what the copy keeps."""
    for top, dirs, files in os.walk(src):
        rel = os.path.relpath(top, src)
        # A profile folder (release/, wasm32-wasip2/release/) holds the
        # final artifacts beside its .fingerprint/.
        if os.path.basename(top) in UNIT_FOLDERS or ".fingerprint" in dirs:
            dirs[:] = [d for d in dirs if d in UNIT_FOLDERS or not is_workspace(d, units)]
            files = [f for f in files if not is_workspace(f, units)]
        for d in dirs:
            yield os.path.normpath(os.path.join(rel, d)), True
        for f in files:
            yield os.path.normpath(os.path.join(rel, f)), False


def main(argv):
    units = workspace_units()
    if argv[:1] == ["--size"] and len(argv) == 2:
        src = argv[1]
        total = 0
        for rel, is_dir in walk(src, units):
            path = os.path.join(src, rel)
            if not is_dir and not os.path.islink(path):
                total += os.lstat(path).st_size
        print(total)
        return 0
    if len(argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    src, dst = argv
    if os.path.exists(dst):
        print(f"build-cache.py: {dst} exists; copy to a new folder", file=sys.stderr)
        return 2
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
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
