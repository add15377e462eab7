#!/usr/bin/env bash
# Experiment: NCCL's symmetric reduce-scatter (sum + division) against the ring average.
set -uo pipefail
python3 .carry/gpu/unpack.py >/dev/null
source bench/gpu_env.sh
W=$OUT/w; mkdir -p $W
nvidia-smi --query-gpu=index,name,pci.bus_id,clocks.max.sm,power.limit --format=csv > $W/gpus.csv
( cd .carry/tests && ./kernels cuda_ --test-threads=1 > $W/kernels-tests.txt 2>&1; echo "kernels tests rc=$?" >> $W/kernels-tests.txt )
tail -3 $W/kernels-tests.txt
S=HARNESS_SYM_SCATTER=1
t0=$(date +%s)
OUT=$W/r bench/scaling_levers.sh 1.3b 4 "one ddp ddp+$S ddp+$S+NCCL_SYM_CTAS=8 ddp+$S+NCCL_SYM_CTAS=16 ddp+$S+NCCL_SYM_KERNEL=ReduceScatter_LD ddp ddp+$S zero1" > $W/l-1.3b.txt 2> $W/times.txt
OUT=$W/r bench/scaling_levers.sh gpt2-124m 4 "one ddp ddp+$S ddp+$S+NCCL_SYM_CTAS=8 ddp+$S+NCCL_SYM_CTAS=16 ddp ddp+$S zero1" > $W/l-124m.txt 2>> $W/times.txt
echo "levers $(( $(date +%s) - t0 )) s" >> $W/times.txt
python3 - <<'PY' > $W/ops.txt
import json,glob,os
for f in sorted(glob.glob(os.environ["OUT"]+"/w/r/levers-*/*.json")):
    try: d=json.load(open(f))
    except Exception as e: print(f, e); continue
    es=d.get("entries") or [d]
    for e in es:
        m=e.get("metrics") or {}
        ops=m.get("collective_ops") or {}
        s={k:(round(v.get("busbw_gbs",0) or 0,1) if isinstance(v,dict) else v) for k,v in ops.items()} if isinstance(ops,dict) else ops
        print(os.path.basename(os.path.dirname(f)), os.path.basename(f), s)
PY
cd $W && tar czf $OUT/run1.tgz . && cd - >/dev/null
cat $W/times.txt | tail -3; cat $W/l-1.3b.txt | tail -14; cat $W/l-124m.txt | tail -12
