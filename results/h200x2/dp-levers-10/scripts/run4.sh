#!/usr/bin/env bash
# 2 GPUs at ed0d318: the CUDA unit tests; for both presets DDP (default and HARNESS_SYM_SCATTER=0), ZeRO-1 and ZeRO-2,
# interleaved twice, and ZeRO-2 at 99a388d (before the fix of its peak).
set -uo pipefail
python3 .carry/gpu/unpack.py >/dev/null
source bench/gpu_env.sh
W=$OUT/w; mkdir -p $W
nvidia-smi --query-gpu=index,name,pci.bus_id,clocks.max.sm --format=csv > $W/gpus.csv
nvidia-smi topo -m > $W/topo.txt 2>&1
(cd .carry/tests && ./kernels cuda_ --test-threads=1 && ./train cuda_ --test-threads=1) > $W/cuda-tests.txt 2>&1
grep -E "^test result|FAILED|panicked" $W/cuda-tests.txt
S0=HARNESS_SYM_SCATTER=0
for P in 1.3b gpt2-124m; do
t0=$(date +%s)
OUT=$W/r ROUNDS=2 bench/scaling_levers.sh $P 2 "one ddp ddp+$S0 zero1 zero2" > $W/l-$P.txt 2>> $W/times.txt
OUT=$W/old HARNESS_BIN=.carry/harness-before bench/scaling_levers.sh $P 2 "zero2" > $W/old-$P.txt 2>> $W/times.txt
echo "$P total $(( $(date +%s) - t0 )) s" >> $W/times.txt
done
cd $W && tar czf $OUT/run4.tgz . && cd - >/dev/null
grep total $W/times.txt
for P in 1.3b gpt2-124m; do echo "== $P"; tail -5 $W/l-$P.txt | cut -c1-80; grep -E "^(variant|one |zero|ddp)" $W/l-$P.txt | cut -c1-105 | sed -n 1,11p; grep -E "^zero2" $W/old-$P.txt | cut -c1-105; done
