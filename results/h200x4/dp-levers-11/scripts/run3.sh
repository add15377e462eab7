#!/usr/bin/env bash
# bench/scaling.sh at f66443b on 4 GPUs: 1 and 4 GPUs, both presets, against PyTorch DDP + torch.compile.
set -uo pipefail
python3 .carry/gpu/unpack.py >/dev/null
source bench/gpu_env.sh
W=$OUT/w; mkdir -p $W
nvidia-smi --query-gpu=index,name,pci.bus_id --format=csv > $W/gpus.csv
t0=$(date +%s)
OUT=$W/s bench/scaling.sh gpt2-124m "1 4" > $W/table-gpt2-124m.txt 2>&1
echo "124m $(( $(date +%s) - t0 )) s" >> $W/times.txt
OUT=$W/s bench/scaling.sh 1.3b "1 4" > $W/table-1.3b.txt 2>&1
echo "scaling $(( $(date +%s) - t0 )) s" >> $W/times.txt
cd $W && tar czf $OUT/run3.tgz . && cd - >/dev/null
cat $W/times.txt; tail -9 $W/table-gpt2-124m.txt; tail -9 $W/table-1.3b.txt
