#!/usr/bin/env bash
# Do two bit-identical builds of one compressor share a rank, flow after
# flow? (docs/report.md, "Ranks that survive a rerun"). Each of N
# independent flows does what a plugin author and the operator do, from
# nothing:
#   1. `harness plugin new compressor` in Rust and in Python, the body
#      replaced by the same top-k with error feedback (bench/flows/), built;
#   2. each entered separately: `harness run suites/cpu-standard.toml
#      --track compression --plugin compressor=...`, then `harness submit`;
#   3. the operator reproduces both bundles (`harness reproduce --key`);
#   4. `harness report` of the two bundles with the signed records.
# It prints, per flow, each build's rank and operator figures, whether the
# two trained bit for bit alike, and whether they share a rank.
# Usage: bench/rank_flows.sh OUT [N=5]   (harness from $HARNESS_BIN, default
# target/release/harness; run through ./x env so libtorch is found)
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
OUT=$(realpath -m "$1"); N=${2:-5}
mkdir -p "$OUT"
# One build for every flow, submitter's and operator's alike (a bundle
# reproduces only with the build that made it): a copy, which a rebuild of
# the checkout while the flows run cannot change.
[ -x "$OUT/harness" ] || cp "${HARNESS_BIN:-target/release/harness}" "$OUT/harness"
BIN=$OUT/harness
"$BIN" env > "$OUT/env.txt"
[ -e "$OUT/operator.key" ] || "$BIN" keygen "$OUT/operator.key" > /dev/null
log() { echo "$(date -u +%H:%M:%S) $*" | tee -a "$OUT/flows.log"; }

for f in $(seq 1 "$N"); do
  F=$OUT/flow$f
  if [ -e "$F/board/LEADERBOARD.md" ]; then log "flow $f: done before"; continue; fi
  rm -rf "$F"; mkdir -p "$F"
  log "flow $f: plugins"
  "$BIN" plugin new compressor topk-rs --dir "$F" --sdk "$REPO/sdk" > /dev/null
  sed 's/{{name}}/topk-rs/g' bench/flows/topk.rs > "$F/topk-rs/src/lib.rs"
  (cd "$F/topk-rs" && cargo build -q --release --target wasm32-wasip2) > "$F/build-rs.txt" 2>&1
  "$BIN" plugin new compressor topk-py --dir "$F" --lang python > /dev/null
  sed 's/{{name}}/topk-py/g' bench/flows/app.py > "$F/topk-py/app.py"
  (cd "$F/topk-py" && ./build.sh) > "$F/build-py.txt" 2>&1
  for b in rs py; do
    wasm=$F/topk-rs/target/wasm32-wasip2/release/topk_rs.wasm
    [ $b = py ] && wasm=$F/topk-py/topk-py.wasm
    log "flow $f: run $b (load $(cut -d' ' -f1 /proc/loadavg))"
    "$BIN" run suites/cpu-standard.toml --track compression --plugin "compressor=$wasm" \
      --out "$F/$b.json" -q > "$F/run-$b.txt" 2>&1
    "$BIN" submit "$F/$b.json" --out "$F/$b.bundle" > "$F/submit-$b.txt" 2>&1
  done
  log "flow $f: reproduce"
  "$BIN" reproduce "$F/rs.bundle" "$F/py.bundle" --key "$OUT/operator.key" --out "$F/repro" -q > "$F/reproduce.txt" 2>&1 || true
  "$BIN" report "$F/rs.bundle" "$F/py.bundle" --out-dir "$F/board" \
    --reproductions "$F/repro" --public-key "$OUT/operator.key.pub" > "$F/report.txt" 2>&1
  log "flow $f: done"
done
python3 bench/rank_flows.py "$OUT" "$N" | tee "$OUT/table.md"
