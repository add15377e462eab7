#!/usr/bin/env bash
# A GPU board ranked on the operator's figures (docs/rules.md,
# "Reproduction"), in two device calls:
#   bench/board_gpu.sh claims SUITE GPUS NAME:TRACK:KIND=ARTIFACT...
#     each plugin entered in its track (`harness run --track --plugin`) and
#     bundled (`harness submit`): $OUT/claims.tar.gz holds the bundles;
#   bench/board_gpu.sh reproduce KEY CLAIMS.tar.gz
#     every bundle reproduced once by the operator (`harness reproduce
#     --key KEY`): $OUT/reproductions.tar.gz holds the signed records and
#     the reruns beside them.
# `harness report BUNDLES --reproductions RECORDS --public-key KEY.pub`
# then builds the board anywhere. (harness from .carry/harness; plugins in
# .carry/plugins.)
set -uo pipefail
cd "$(dirname "$0")/.."
source bench/gpu_env.sh
phase=$1; shift
"$BIN" env > "$OUT/env-$phase.txt" 2>&1
case "$phase" in
  claims)
    S=$1 G=$2; shift 2
    mkdir -p "$OUT/claims"
    for spec in "$@"; do
      IFS=: read -r name track plugin <<< "$spec"
      start=$SECONDS
      "$BIN" run "$S" --track "$track" --gpus "$G" --plugin "$plugin" --out "$OUT/claims/$name.json" -q > "$OUT/claims/$name.txt" 2>&1
      echo "$name: run exit $? in $((SECONDS - start)) s"
      "$BIN" submit "$OUT/claims/$name.json" --out "$OUT/claims/$name.bundle" > "$OUT/claims/$name.submit.txt" 2>&1
      echo "$name: submit exit $?: $(tail -n 1 "$OUT/claims/$name.submit.txt")"
    done
    tar -C "$OUT" -czf "$OUT/claims.tar.gz" claims ;;
  reproduce)
    KEY=$1 CLAIMS=$2
    tar -C "$OUT" -xzf "$CLAIMS"
    start=$SECONDS
    "$BIN" reproduce "$OUT"/claims/*.bundle --key "$KEY" --out "$OUT/reproductions" -q > "$OUT/reproduce.txt" 2>&1
    echo "reproduce exit $? in $((SECONDS - start)) s"
    grep -v '^[│╞└┌├╭╰]' "$OUT/reproduce.txt" | tail -n 12
    tar -C "$OUT" -czf "$OUT/reproductions.tar.gz" --exclude='reruns' --exclude='staged' reproduce.txt reproductions ;;
  *) echo "usage: bench/board_gpu.sh claims SUITE GPUS NAME:TRACK:KIND=ARTIFACT... | reproduce KEY CLAIMS.tar.gz" >&2; exit 2 ;;
esac
