#!/usr/bin/env bash
# 4 GPUs at f66443b: each GPU alone, DDP (as shipped, and with CUDA_DEVICE_MAX_CONNECTIONS=1 and =32), ZeRO-1, ZeRO-2,
# both presets, interleaved twice.
set -uo pipefail
python3 .carry/gpu/unpack.py >/dev/null
source bench/gpu_env.sh
W=$OUT/w; mkdir -p $W
nvidia-smi --query-gpu=index,name,pci.bus_id,clocks.max.sm --format=csv > $W/gpus.csv
nvidia-smi topo -m > $W/topo.txt 2>&1
cat $W/gpus.csv
C=CUDA_DEVICE_MAX_CONNECTIONS
for P in 1.3b gpt2-124m; do
t0=$(date +%s)
OUT=$W/r ROUNDS=2 bench/scaling_levers.sh $P 4 "one one-g1 one-g2 one-g3 ddp ddp+$C=1 ddp+$C=32 zero1 zero2" > $W/l-$P.txt 2>> $W/times.txt
echo "$P total $(( $(date +%s) - t0 )) s" >> $W/times.txt
done
cd $W && tar czf $OUT/run1.tgz . && cd - >/dev/null
grep total $W/times.txt
for P in 1.3b gpt2-124m; do echo "== $P"; grep -A12 "over 2 rounds" $W/l-$P.txt | cut -c1-100; done
