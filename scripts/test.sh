#!/usr/bin/env bash
# Every check CI runs (`./x test`, which sources scripts/env.sh first so that
# libtorch is installed and on the library path).
set -euo pipefail
cd "$(dirname "$0")/.."
rustup component add rustfmt clippy >/dev/null 2>&1 || true
# The HTML report is checked in headless Chromium (Debian's package).
if ! command -v chromium >/dev/null 2>&1; then
  echo "== installing chromium for the HTML report test"
  SUDO=""; [ "$(id -u)" = 0 ] || SUDO=sudo
  $SUDO apt-get install -y -q chromium >/dev/null 2>&1 || { $SUDO apt-get update -q >/dev/null && $SUDO apt-get install -y -q chromium >/dev/null; }
fi
echo "== plugins and fixtures (wasm32-wasip2 components and native libraries)"
scripts/build-plugins.sh
echo "== cargo fmt --check"
cargo fmt --all -- --check
echo "== cargo clippy"
cargo clippy --workspace --all-targets -- -D warnings
echo "== cargo doc -p harness-sdk (the plugin SDK's docs, warnings denied)"
RUSTDOCFLAGS="-D warnings" cargo doc -p harness-sdk --no-deps --quiet
echo "== cargo test (release: the tests train real models)"
# Snapshot mismatches fail instead of writing .snap.new files.
CI=${CI:-true} cargo test --workspace --release
echo "== ./x install (a harness command that runs from any folder)"
repo=$PWD; tmp=$(mktemp -d)
./x install "$tmp/bin" --no-build >/dev/null
cp suites/cpu.toml "$tmp/"
(cd "$tmp" && env -u LD_LIBRARY_PATH "$tmp/bin/harness" validate cpu.toml)
rm -rf "$tmp"; cd "$repo"
echo "== bench scripts parse"
python3 -m py_compile bench/*.py
for f in bench/*.sh; do bash -n "$f"; done
echo "all checks passed"
