#!/usr/bin/env bash
# Checkpoints in two tiers against the synchronous path, on one GPU, in one
# call: the disk's own sequential write (fsync) and direct read, then
# suites/gpu-checkpoint-tiers.toml (stall per checkpoint, persist speed,
# slowdown of the steps overlapping a persist, restores from memory and
# disk, goodput under seeded failures). Writes $OUT/checkpoint-tiers.tar.gz
# and prints a table last. Needs .carry/ (binary and plugins, see
# docs/benchmarks.md); checkpoints go under $WORK (same disk as the dd test).
set -uo pipefail
cd "$(dirname "$0")/.."
source bench/gpu_env.sh
WORK=${WORK:-/tmp/ckpt-tiers}; rm -rf "$WORK"; mkdir -p "$WORK"
"$BIN" env > "$WORK/env.txt" 2>&1
df -h "$WORK" > "$WORK/disk.txt" 2>&1
# The disk: 1.5 GB written sequentially with fsync, then read back bypassing
# the page cache.
dd if=/dev/zero of="$WORK/dd.bin" bs=16M count=96 conv=fsync 2> "$WORK/dd-write.txt"
dd if="$WORK/dd.bin" of=/dev/null bs=16M iflag=direct 2> "$WORK/dd-read.txt"
rm -f "$WORK/dd.bin"
# The checkpoint reader against the disk: a 1.5 GB checkpoint written and
# read back each way (harness bench checkpoint-read), then the same files
# read by dd. The CPU's SHA extensions decide how fast hashing can go.
grep -o -w -m1 sha_ni /proc/cpuinfo > "$WORK/cpu-sha.txt" || echo "no sha_ni" > "$WORK/cpu-sha.txt"
"$BIN" bench checkpoint-read "$WORK" --gb 1.5 --rounds 3 --keep > "$WORK/checkpoint-read.txt" 2> "$WORK/checkpoint-read.err"
KEPT=$(sed -n 's/^kept the checkpoint: //p' "$WORK/checkpoint-read.err")
if [ -n "$KEPT" ]; then
  for f in "$KEPT"/*.safetensors; do
    dd if="$f" of=/dev/null bs=16M iflag=direct 2>&1 | tail -1 | sed "s|^|$(basename "$f"): |" >> "$WORK/dd-read-checkpoint.txt"
  done
  rm -rf "$(dirname "$KEPT")"
fi
"$BIN" run suites/gpu-checkpoint-tiers.toml --out "$WORK/tiers.json" > "$WORK/run.txt" 2>&1
echo "harness run: rc=$?" >> "$WORK/run.txt"
tar -C "$WORK" -czf "$OUT/checkpoint-tiers.tar.gz" --exclude='*.checkpoints' . 2>/dev/null
tail -3 "$WORK/run.txt"
echo "disk write (fsync): $(tail -1 "$WORK/dd-write.txt")"
echo "disk read (direct): $(tail -1 "$WORK/dd-read.txt")"
echo "dd of the bench's checkpoint files (direct):"; cat "$WORK/dd-read-checkpoint.txt"
echo "cpu: $(cat "$WORK/cpu-sha.txt")"; cat "$WORK/checkpoint-read.txt"
python3 bench/checkpoint_table.py "$WORK/tiers.json"
