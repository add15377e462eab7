#!/usr/bin/env bash
# ZeRO-1's gradient buffers in symmetric memory, reduce-scattered in place (NCCL's symmetric kernel), against HARNESS_SYM_SCATTER=0.
set -uo pipefail
python3 .carry/gpu/unpack.py >/dev/null
source bench/gpu_env.sh
W=$OUT/w; mkdir -p $W
nvidia-smi --query-gpu=index,name,pci.bus_id --format=csv > $W/gpus.csv
S0=HARNESS_SYM_SCATTER=0
for p in gpt2-124m 1.3b; do
OUT=$W/r bench/scaling_levers.sh $p 4 "one zero1 zero1+$S0 zero1+R=2 zero1+$S0+R=2 ddp" > $W/l-$p.txt 2>> $W/times.txt
tail -7 $W/l-$p.txt | cut -c1-24,36-120
done
cd $W && tar czf $OUT/run6.tgz . && cd - >/dev/null
