# stop 36 call 1: CUDA unit tests; the encoder family fused against libtorch (gpu_kernels.sh, traced).
source .carry/prep.sh
T0=$(date +%s)
./.carry/harness-tests --test-threads=1 cuda > $OUT/unit.txt 2>&1; grep -E "test result|FAILED|panicked" $OUT/unit.txt | head -8
echo "t=$(( $(date +%s)-T0 )) unit"
mkdir -p $OUT/e; SUITE=suites/gpu-kernels-encoder.toml TRACE=1 OUT=$OUT/e timeout 420 bash bench/gpu_kernels.sh > $OUT/e/summary.txt 2>&1; tail -16 $OUT/e/summary.txt
.carry/harness env > $OUT/e/env.txt 2>&1
for f in $OUT/e/traced-*.trace/*.txt; do echo "== $f"; sed -n 1,40p $f; done > $OUT/e/traces-head.txt
(cd $OUT && tar czf e.tgz e && rm -rf e); echo "t=$(( $(date +%s)-T0 )) encoder"
