# stop 35: bench/gpu_kernels.sh (fused against libtorch layers, and fp32) on the final build.
source .carry/prep.sh
T0=$(date +%s)
mkdir -p $OUT/k; OUT=$OUT/k timeout 560 bash bench/gpu_kernels.sh > $OUT/k/summary.txt 2>&1; tail -14 $OUT/k/summary.txt
.carry/harness env > $OUT/k/env.txt 2>&1
(cd $OUT && tar czf k.tgz k && rm -rf k); echo "t=$(( $(date +%s)-T0 )) kernels"
