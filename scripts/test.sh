#!/usr/bin/env bash
# Every check CI runs (`./x test`, which sources scripts/env.sh first so that
# libtorch is installed and on the library path). Each step prints its time,
# and a table of them ends the run.
set -euo pipefail
cd "$(dirname "$0")/.."

timings=()
step_name=""
step_start=$SECONDS
step() {
  [ -n "$step_name" ] && timings+=("$(printf '%6d s  %s' $((SECONDS - step_start)) "$step_name")")
  step_name=$1
  step_start=$SECONDS
  [ -n "$step_name" ] && echo "== $step_name"
  return 0
}

rustup component add rustfmt clippy >/dev/null 2>&1 || true

# The build cache: a fresh clone (no target/ yet) starts from a copy of the
# third-party units of the last fresh clone's target/ (scripts/build-cache.sh),
# so that the dependencies (wasmtime, cranelift, tch, ...) are not compiled
# again: cargo's fingerprints rebuild whatever changed, and the workspace's
# crates always (the cache holds none of them). After every check passed,
# the clone's third-party units become the cache. A cache that does not fit
# on the disk is skipped, never fatal. HARNESS_BUILD_CACHE=0 turns both off.
fresh_clone=false
if [ ! -e target ] && [ "${HARNESS_BUILD_CACHE:-1}" != 0 ]; then
  fresh_clone=true
  step "build cache: restoring target/"
  scripts/build-cache.sh restore
fi

step "cargo fmt --check"
cargo fmt --all -- --check

step "circles between modules"
# Its rules on the fixtures of scripts/module-cycles-fixtures/ first, then
# every crate of the workspace.
python3 scripts/module-cycles.py --self-test
python3 scripts/module-cycles.py

step "what the build cache keeps (scripts/build-cache.py on a made-up target/)"
python3 scripts/build-cache.py --self-test

step "dependencies the code never names"
python3 scripts/unused-deps.py --self-test
python3 scripts/unused-deps.py

# The HTML report is checked in headless Chromium (Debian's package).
if ! command -v chromium >/dev/null 2>&1; then
  step "installing chromium for the HTML report test"
  SUDO=""; [ "$(id -u)" = 0 ] || SUDO=sudo
  $SUDO apt-get install -y -q chromium >/dev/null 2>&1 || { $SUDO apt-get update -q >/dev/null && $SUDO apt-get install -y -q chromium >/dev/null; }
fi

step "plugins and fixtures (wasm32-wasip2 components and native libraries)"
scripts/build-plugins.sh

step "build the tests (release: the tests train real models)"
# One cargo invocation for every test of the workspace, so that each crate is
# compiled once with one set of features: `-p` or `--exclude` would resolve
# the features anew (the report's tests turn on the format's `testing`) and
# compile the format and the report a second time.
tests_json=$(mktemp)
cargo test --workspace --release --no-run --message-format=json-render-diagnostics > "$tests_json"

step "format and report crates: the layers below libtorch and wasmtime, tested without them"
# They must not depend on libtorch or wasmtime: the report and the verifier
# build anywhere. Their test programs run without the libtorch environment
# to prove it (each in its crate's folder, as cargo test runs them).
for c in harness-format harness-report; do
  if cargo tree -p "$c" -e normal --prefix none | grep -Eq '^(tch|torch-sys|wasmtime|cudarc) '; then
    echo "$c depends on libtorch, cudarc or wasmtime:" >&2
    cargo tree -p "$c" -e normal -i tch -i wasmtime 2>/dev/null >&2 || true
    exit 1
  fi
done
python3 - "$tests_json" > "$tests_json.run" <<'PY'
import json, os, sys
for line in open(sys.argv[1]):
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["profile"]["test"]:
        folder = os.path.dirname(m["manifest_path"])
        if folder.endswith(("/crates/format", "/crates/report")):
            print(folder, m["executable"])
PY
[ "$(wc -l < "$tests_json.run")" -ge 2 ] || { echo "no test programs of harness-format and harness-report in the build" >&2; exit 1; }
while read -r folder exe; do
  echo "running ${exe#"$PWD/"}"
  (cd "$folder" && env -u LIBTORCH_USE_PYTORCH -u LD_LIBRARY_PATH CI=${CI:-true} "$exe" -q)
done < "$tests_json.run"
rm -f "$tests_json" "$tests_json.run"

# clippy and doc check in the release profile, as the tests build: the build
# scripts (libtorch's C++ glue, cranelift's generated code) and the proc
# macros they share with the test build are then built once, not once per
# profile.
step "cargo clippy"
cargo clippy --release --workspace --all-targets -- -D warnings

step "cargo doc (every crate's docs, warnings denied)"
RUSTDOCFLAGS="-D warnings" cargo doc --release --workspace --no-deps --document-private-items --quiet

step "cargo test (every crate's tests, built above)"
# Snapshot mismatches fail instead of writing .snap.new files. One libtorch
# CPU thread per test process (unless the caller sets OMP_NUM_THREADS): the
# tests run about one per core, and an OpenMP pool spanning every core in
# each of them oversubscribes the cores and spins at every barrier. One test
# more than there are cores: a CLI test spends part of its time starting
# processes and waiting for them (139 CLI tests on the 2-core VM: 539 s two
# at a time, 511 s three at a time).
OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} CI=${CI:-true} cargo test --workspace --release -- --test-threads "$(( $(nproc) + 1 ))"

step "./x install (a harness command that runs from any folder)"
repo=$PWD; tmp=$(mktemp -d)
./x install "$tmp/bin" --no-build >/dev/null
cp suites/cpu.toml "$tmp/"
(cd "$tmp" && env -u LD_LIBRARY_PATH "$tmp/bin/harness" validate cpu.toml)
rm -rf "$tmp"; cd "$repo"

step "bench scripts parse"
python3 -m py_compile bench/*.py
for f in bench/*.sh; do bash -n "$f"; done

if $fresh_clone; then
  step "build cache: saving target/"
  scripts/build-cache.sh save
fi

step ""
echo "== time per step"
printf '%s\n' "${timings[@]}"
echo "all checks passed"
