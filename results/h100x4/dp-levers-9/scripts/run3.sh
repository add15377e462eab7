#!/usr/bin/env bash
# The late gather (default on) against HARNESS_LATE_GATHER=0, with and without the symmetric scatter, twice.
set -uo pipefail
python3 .carry/gpu/unpack.py >/dev/null
source bench/gpu_env.sh
W=$OUT/w; mkdir -p $W
nvidia-smi --query-gpu=index,name,pci.bus_id --format=csv > $W/gpus.csv
L0=HARNESS_LATE_GATHER=0; S=HARNESS_SYM_SCATTER=1
t0=$(date +%s)
for p in 1.3b gpt2-124m; do
OUT=$W/r bench/scaling_levers.sh $p 4 "one ddp ddp+$L0 ddp+$S ddp+$L0+$S ddp+R=2 ddp+$L0+R=2 ddp+$S+R=2 zero1 one+R=2" > $W/l-$p.txt 2>> $W/times.txt
done
echo "levers $(( $(date +%s) - t0 )) s" >> $W/times.txt
grep -h "comm .* rank 0 nranks 4\|Split\|split" $W/r/levers-1.3b/ddp.nccl/rank0*.log 2>/dev/null | cut -c1-200 | head -5 > $W/nccl-split.txt
cd $W && tar czf $OUT/run3.tgz . && cd - >/dev/null
tail -1 $W/times.txt; cat $W/nccl-split.txt; for p in 1.3b gpt2-124m; do tail -11 $W/l-$p.txt | cut -c1-36,48-58,73-90,120-170; done
