#!/usr/bin/env bash
# 4 GPUs at f66443b: CUDA_DEVICE_MAX_CONNECTIONS=32 (and 16) against the default 8, on 1 GPU, DDP and ZeRO-1,
# both presets, interleaved three times.
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
OUT=$W/r ROUNDS=3 bench/scaling_levers.sh $P 4 "one one+$C=32 ddp ddp+$C=32 ddp+$C=16 zero1 zero1+$C=32" > $W/l-$P.txt 2>> $W/times.txt
echo "$P total $(( $(date +%s) - t0 )) s" >> $W/times.txt
done
cd $W && tar czf $OUT/run2.tgz . && cd - >/dev/null
grep total $W/times.txt
for P in 1.3b gpt2-124m; do echo "== $P"; grep -E "^one" $W/l-$P.txt | cut -c1-75; grep -A12 "over 3 rounds" $W/l-$P.txt | cut -c1-100; done
