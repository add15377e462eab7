#!/usr/bin/env bash
# Enters reference plugins into tracks of a standard suite as a third party
# would (`harness run SUITE --track T --plugin KIND=PATH --gpus N`), then
# bundles (`harness submit`) and verifies (`harness verify`) each result.
#
#   bench/standard_tracks.sh SUITE TRACK=KIND=PLUGIN[@GPUS] ...
#   e.g. bench/standard_tracks.sh suites/h200.toml checkpointing=checkpoint-policy=every-n.wasm@1
#
# PLUGIN is a file under target/plugins (or a path). Writes
# $OUT/<track>.tar.gz (result, log, bundle) and prints a table last. Needs
# $HARNESS_BIN (default .carry/harness); checkpoints go under $WORK.
set -uo pipefail
cd "$(dirname "$0")/.."
source bench/gpu_env.sh
suite=$1; shift
WORK=${WORK:-/tmp/standard-tracks}; mkdir -p "$WORK"
"$BIN" env > "$OUT/env.txt" 2>&1
rows=()
for spec in "$@"; do
  track=${spec%%=*}; rest=${spec#*=}; kind=${rest%%=*}; plugin=${rest#*=}
  gpus=1; [[ $plugin == *@* ]] && { gpus=${plugin##*@}; plugin=${plugin%@*}; }
  [ -f "$plugin" ] || plugin=target/plugins/$plugin
  d=$WORK/$track; rm -rf "$d"; mkdir -p "$d"
  start=$(date +%s)
  "$BIN" run "$suite" --track "$track" --plugin "$kind=$(realpath "$plugin")" --gpus "$gpus" \
    --out "$d/$track.json" --quiet > "$d/$track.txt" 2>&1
  rc=$?; took=$(( $(date +%s) - start ))
  "$BIN" submit "$d/$track.json" --out "$d/$track.bundle" > "$d/verify.txt" 2>&1
  vrc=$?
  tar -C "$d" -czf "$OUT/$track.tar.gz" --exclude='*.checkpoints' "$track.json" "$track.log" "$track.txt" verify.txt "$track.bundle" 2>/dev/null
  rows+=("$track $gpus ${took}s run=$rc verify=$vrc $(tail -1 "$d/verify.txt")")
done
printf '%s\n' "${rows[@]}"
