# stop 34 call 10 (H100): 1.3B peak memory with each of the fused paths turned off, graphs on and off.
source .carry/prep.sh >/dev/null
mkdir -p $OUT/m
run() { n=$1; shift; env "$@" timeout 120 .carry/harness run suites/gpu1-1.3b.toml --out $OUT/m/harness-$n.json --quiet > $OUT/m/$n.txt 2>&1 || tail -3 $OUT/m/$n.txt; }
run all
run noadam HARNESS_FUSED_ADAMW=0
run noembed HARNESS_FUSED_EMBED=0
run nomlp HARNESS_FUSED_MLP=0
run nolt HARNESS_LT_MATMULS=0
run none HARNESS_LT_MATMULS=0 HARNESS_FUSED_MLP=0 HARNESS_FUSED_EMBED=0
run nograph HARNESS_CUDA_GRAPH=0
python3 - $OUT/m <<'P'
import json,glob,sys
for p in sorted(glob.glob(sys.argv[1]+'/harness-*.json')):
    for e in json.load(open(p))['entries']:
        m=e.get('metrics') or {}; mem=m.get('memory',{})
        print(f"{p.split('/')[-1]:24s} {e['status']} tok/s {m.get('tokens_per_s',0):8.0f} peak_dev {mem.get('peak_device_allocated_bytes',0)/2**30:.4f} peak_step {(mem.get('peak_step_allocated_bytes') or 0)/2**30:.4f} reserved {(mem.get('peak_device_reserved_bytes') or 0)/2**30:.3f}")
P
cd $OUT && tar czf m.tgz m && rm -rf m
