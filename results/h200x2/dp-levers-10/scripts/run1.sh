#!/usr/bin/env bash
# 2 GPUs: the CUDA unit tests, then PRESET's DDP (default and HARNESS_SYM_SCATTER=0), ZeRO-1, ZeRO-2 (this build),
# and ZeRO-2 at 99a388d (before the fix of ZeRO-2's peak), interleaved twice.
set -uo pipefail
P=${1:?preset}; T=${2:-1}
python3 .carry/gpu/unpack.py >/dev/null
source bench/gpu_env.sh
W=$OUT/w; mkdir -p $W
nvidia-smi --query-gpu=index,name,pci.bus_id,clocks.max.sm --format=csv > $W/gpus.csv
nvidia-smi topo -m > $W/topo.txt 2>&1
python3 -c "import torch; print(torch.__version__, torch.cuda.nccl.version())" > $W/versions.txt 2>&1
if [ "$T" = 1 ]; then
  (cd .carry/tests && ./kernels cuda_ --test-threads=1 && ./train cuda_ --test-threads=1) > $W/cuda-tests.txt 2>&1
  grep -E "^test result|FAILED|panicked" $W/cuda-tests.txt
fi
S0=HARNESS_SYM_SCATTER=0
t0=$(date +%s)
OUT=$W/r ROUNDS=2 bench/scaling_levers.sh $P 2 "one ddp ddp+$S0 zero1 zero2" > $W/l-$P.txt 2>> $W/times.txt
OUT=$W/old HARNESS_BIN=.carry/harness-before bench/scaling_levers.sh $P 2 "one zero2" > $W/old-$P.txt 2>> $W/times.txt
echo "total $(( $(date +%s) - t0 )) s" >> $W/times.txt
cd $W && tar czf $OUT/run-$P.tgz . && cd - >/dev/null
grep -E "^total" $W/times.txt
tail -14 $W/l-$P.txt | cut -c1-110
grep -E "^(variant|one|zero)" $W/old-$P.txt | cut -c1-110
