# stop 36 call 2: the encoder with regression inputs drawn on the device: fused against libtorch (gpu_kernels.sh), and the host pipeline for comparison.
source .carry/prep.sh
T0=$(date +%s)
./.carry/harness-tests --test-threads=1 data:: > $OUT/unit.txt 2>&1; grep -E "test result|FAILED|panicked" $OUT/unit.txt | head -4
mkdir -p $OUT/e; SUITE=suites/gpu-kernels-encoder.toml OUT=$OUT/e timeout 300 bash bench/gpu_kernels.sh > $OUT/e/summary.txt 2>&1; tail -16 $OUT/e/summary.txt
.carry/harness env > $OUT/e/env.txt 2>&1
echo "t=$(( $(date +%s)-T0 )) encoder"
sed 's/noise = 0.3 }/noise = 0.3, pipeline = "host" }/' suites/gpu-kernels-encoder.toml > $OUT/e/host.toml
.carry/harness run $OUT/e/host.toml --out $OUT/e/host-fused.json --quiet > $OUT/e/host-fused.txt 2>&1; tail -5 $OUT/e/host-fused.txt
HARNESS_CUDA_GRAPH=1 .carry/harness run suites/gpu-kernels-encoder.toml --out $OUT/e/graph-fused.json --quiet > $OUT/e/graph-fused.txt 2>&1; tail -5 $OUT/e/graph-fused.txt
python3 - $OUT/e <<'PY'
import json,sys,os
d=sys.argv[1]
print("%-8s %-30s %10s %8s %8s %8s %8s"%("run","workload","tok/s","step p50","data","fwd","bwd"))
for f in ["fused","libtorch","host-fused","graph-fused"]:
    p=os.path.join(d,f+".json")
    if not os.path.exists(p): continue
    for e in json.load(open(p))["entries"]:
        m=e["metrics"]; ph=m["phases"]
        g=lambda k: ph.get(k,{}).get("p50_ms",float("nan"))
        print("%-8s %-30s %10.0f %8.2f %8.2f %8.2f %8.2f"%(f[:11],e["workload"][:30],m["tokens_per_s"],m["step"]["p50_ms"] if "p50_ms" in m["step"] else float("nan"),g("data"),g("forward"),g("backward")))
PY
(cd $OUT && tar czf e.tgz e && rm -rf e); echo "t=$(( $(date +%s)-T0 )) all"
