#!/usr/bin/env bash
# 4 GPUs at ed0d318: each GPU alone, DDP, ZeRO-1, ZeRO-2 (ZeRO-2's peak after a66fbaa), both presets.
set -uo pipefail
python3 .carry/gpu/unpack.py >/dev/null
source bench/gpu_env.sh
W=$OUT/w; mkdir -p $W
nvidia-smi --query-gpu=index,name,pci.bus_id --format=csv > $W/gpus.csv
for P in 1.3b gpt2-124m; do
t0=$(date +%s)
OUT=$W/r bench/scaling_levers.sh $P 4 "one one-g1 one-g2 one-g3 ddp zero1 zero2" > $W/l-$P.txt 2>> $W/times.txt
echo "$P total $(( $(date +%s) - t0 )) s" >> $W/times.txt
done
cd $W && tar czf $OUT/run6.tgz . && cd - >/dev/null
grep total $W/times.txt; cat $W/gpus.csv
for P in 1.3b gpt2-124m; do echo "== $P"; grep -E "^(variant|one|zero|ddp)" $W/l-$P.txt | cut -c1-28,36-200; tail -4 $W/l-$P.txt | cut -c1-120; done
