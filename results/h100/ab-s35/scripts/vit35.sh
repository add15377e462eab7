# stop 35: ViT-B/16 with the q, k, v node: CUDA unit tests; bench/gpu_kernels.sh on suites/gpu-kernels-vit.toml; the fused suite again with HARNESS_FUSED_QKV=0 (same call).
source .carry/prep.sh
T0=$(date +%s)
./.carry/harness-tests --test-threads=1 cuda > $OUT/unit.txt 2>&1; grep -E "test result|FAILED|panicked" $OUT/unit.txt | head -8
mkdir -p $OUT/v; SUITE=suites/gpu-kernels-vit.toml OUT=$OUT/v timeout 330 bash bench/gpu_kernels.sh > $OUT/v/summary.txt 2>&1; tail -6 $OUT/v/summary.txt
echo "t=$(( $(date +%s)-T0 )) kernels"
HARNESS_FUSED_QKV=0 timeout 80 .carry/harness run suites/gpu-kernels-vit.toml --out $OUT/v/fused-noqkv.json --quiet > $OUT/v/fused-noqkv.txt 2>&1 || tail -3 $OUT/v/fused-noqkv.txt
python3 - $OUT/v <<'PY'
import json,sys
d=sys.argv[1]
for n in ['fused','fused-noqkv','libtorch']:
    try:
        e=json.load(open(f'{d}/{n}.json'))['entries'][0]; m=e['metrics']
        print(n, round(m['tokens_per_s']), 'peak GiB', round(m['memory']['peak_device_allocated_bytes']/2**30,2))
    except Exception as x: print(n, 'missing', x)
PY
.carry/harness env > $OUT/v/env.txt 2>&1
(cd $OUT && tar czf v.tgz v && rm -rf v); echo "t=$(( $(date +%s)-T0 )) done"
