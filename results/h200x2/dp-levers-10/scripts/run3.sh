#!/usr/bin/env bash
# Where ZeRO-2's reported peak comes from: allocator memory at each phase, the harness's own per-step resets only.
set -uo pipefail
python3 .carry/gpu/unpack.py >/dev/null
source bench/gpu_env.sh
W=$OUT/w; mkdir -p $W
M=HARNESS_MEMLOG=1
OUT=$W/m bench/scaling_levers.sh 1.3b 2 "zero2+$M zero1+$M+HARNESS_SYM_SCATTER=0" > $W/l.txt 2>> $W/times.txt
cd $W && tar czf $OUT/run3.tgz . && cd - >/dev/null
for f in $W/m/levers-1.3b/*.txt; do echo "== $f"; grep MEMLOG "$f" | sed -n 20,40p; grep MEMLOG "$f" | tail -12; done
tail -4 $W/l.txt | cut -c1-110
