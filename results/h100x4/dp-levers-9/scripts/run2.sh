#!/usr/bin/env bash
# Diagnostic: DDP with its gradient communication left out (all / the gather / the scatter).
set -uo pipefail
python3 .carry/gpu/unpack.py >/dev/null
source bench/gpu_env.sh
W=$OUT/w; mkdir -p $W
nvidia-smi --query-gpu=index,name,pci.bus_id --format=csv > $W/gpus.csv
export HARNESS_REPLICA_CHECK_EVERY=0
X=HARNESS_EXP_NO_GRAD_COMM
t0=$(date +%s)
for p in 1.3b gpt2-124m; do
OUT=$W/r bench/scaling_levers.sh $p 4 "one ddp ddp+$X=all ddp+$X=ag ddp+$X=rs ddp+HARNESS_SYM_SCATTER=1 zero1 one+R=2" > $W/l-$p.txt 2>> $W/times.txt
done
echo "levers $(( $(date +%s) - t0 )) s" >> $W/times.txt
cd $W && tar czf $OUT/run2.tgz . && cd - >/dev/null
tail -1 $W/times.txt; for p in 1.3b gpt2-124m; do tail -9 $W/l-$p.txt | cut -c1-40,58-66,74-84,110-160; done
