#!/usr/bin/env bash
# Enters reference plugins into tracks of a standard suite as a third party
# would (`harness run SUITE --track T --plugin KIND=PATH --gpus N`), then
# bundles (`harness submit`) and verifies (`harness verify`) each result.
#
#   bench/standard_tracks.sh SUITE TRACK=KIND=PLUGIN[@GPUS][,KEY=VALUE...] ...
#   e.g. bench/standard_tracks.sh suites/h200.toml checkpointing=checkpoint-policy=every-n.wasm@1,every=10,keep=2
#
# PLUGIN is a file under target/plugins (or a path); KEY=VALUE pairs go to
# --plugin-config. Writes $OUT/<track>-<plugin>.tar.gz (result, log, bundle)
# and prints a table last. Needs $HARNESS_BIN (default .carry/harness);
# checkpoints go under $WORK.
set -uo pipefail
cd "$(dirname "$0")/.."
source bench/gpu_env.sh
suite=$1; shift
WORK=${WORK:-/tmp/standard-tracks}; mkdir -p "$WORK"
"$BIN" env > "$OUT/env.txt" 2>&1
rows=()
for spec in "$@"; do
  track=${spec%%=*}; rest=${spec#*=}; kind=${rest%%=*}; rest=${rest#*=}
  IFS=, read -r plugin pairs <<< "$rest"
  gpus=1; [[ $plugin == *@* ]] && { gpus=${plugin##*@}; plugin=${plugin%@*}; }
  [ -f "$plugin" ] || plugin=target/plugins/$plugin
  config=(); IFS=, read -ra kvs <<< "${pairs:-}"
  for kv in "${kvs[@]}"; do config+=(--plugin-config "$kv"); done
  name=$track-$(basename "${plugin%.*}")
  d=$WORK/$name; rm -rf "$d"; mkdir -p "$d"
  start=$(date +%s)
  "$BIN" run "$suite" --track "$track" --plugin "$kind=$(realpath "$plugin")" "${config[@]}" --gpus "$gpus" \
    --out "$d/$name.json" --quiet > "$d/$name.txt" 2>&1
  rc=$?; took=$(( $(date +%s) - start ))
  "$BIN" submit "$d/$name.json" --out "$d/$name.bundle" > "$d/verify.txt" 2>&1
  vrc=$?
  tar -C "$d" -czf "$OUT/$name.tar.gz" --exclude='*.checkpoints' "$name.json" "$name.log" "$name.txt" verify.txt "$name.bundle" 2>/dev/null
  rows+=("$name $gpus ${took}s run=$rc verify=$vrc $(tail -1 "$d/verify.txt")")
done
printf '%s\n' "${rows[@]}"
