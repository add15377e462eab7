#!/usr/bin/env bash
# The symmetric scatter as the default against HARNESS_SYM_SCATTER=0, three times each, interleaved.
set -uo pipefail
python3 .carry/gpu/unpack.py >/dev/null
source bench/gpu_env.sh
W=$OUT/w; mkdir -p $W
nvidia-smi --query-gpu=index,name,pci.bus_id --format=csv > $W/gpus.csv
nvidia-smi > $W/nvidia-smi.txt
( cd .carry/tests && ./kernels cuda_ --test-threads=1 > $W/kernels-tests.txt 2>&1; echo "kernels tests rc=$?" >> $W/kernels-tests.txt )
S0=HARNESS_SYM_SCATTER=0
t0=$(date +%s)
for p in 1.3b gpt2-124m; do
OUT=$W/r bench/scaling_levers.sh $p 4 "one ddp ddp+$S0 ddp+R=2 ddp+$S0+R=2 ddp+R=3 ddp+$S0+R=3 zero1 one+R=2" > $W/l-$p.txt 2>> $W/times.txt
done
echo "levers $(( $(date +%s) - t0 )) s" >> $W/times.txt
cd $W && tar czf $OUT/run4.tgz . && cd - >/dev/null
grep "test result\|rc=" $W/kernels-tests.txt; tail -1 $W/times.txt; for p in 1.3b gpt2-124m; do tail -10 $W/l-$p.txt | cut -c1-30,46-70,80-90; done
