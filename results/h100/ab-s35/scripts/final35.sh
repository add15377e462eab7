# Final build of stop 35 on one GPU: CUDA unit tests, 124M and 1.3B vs PyTorch (graphs on), a traced step, and (KERN=1) fused against libtorch layers vs fp32 (bench/gpu_kernels.sh).
source .carry/prep.sh
T0=$(date +%s)
./.carry/harness-tests --test-threads=1 cuda > $OUT/unit.txt 2>&1; grep -E "test result|FAILED|panicked" $OUT/unit.txt | head -8
mkdir -p $OUT/p; OUT=$OUT/p timeout 240 bash bench/gpu_vs_pytorch.sh > $OUT/p/summary.txt 2>&1; tail -4 $OUT/p/summary.txt; grep gpt2-124m $OUT/p/summary.txt | tail -2
(cd $OUT && tar czf p.tgz p && rm -rf p); echo "t=$(( $(date +%s)-T0 )) 124m"
mkdir -p $OUT/t; HARNESS_CUDA_GRAPH=1 timeout 90 .carry/harness run suites/gpu-trace.toml --trace --out $OUT/t/trace-graph1.json > $OUT/t/run-graph1.txt 2>&1; python3 bench/trace_summary.py $OUT/t/trace-graph1.trace/gpt2-124m-bf16*.json --top 45 > $OUT/t/summary-124m-graph1.txt 2>&1; python3 bench/trace_summary.py $OUT/t/trace-graph1.trace/gpt-1.3b*.json --top 30 > $OUT/t/summary-1.3b-graph1.txt 2>&1; gzip $OUT/t/trace-graph1.trace/*.json; sed -n 6,7p $OUT/t/summary-124m-graph1.txt
(cd $OUT && tar czf t.tgz t && rm -rf t); echo "t=$(( $(date +%s)-T0 )) trace"
mkdir -p $OUT/b; SUITE=suites/gpu1-1.3b.toml PYARGS="--preset 1.3b --batch 8" WORKLOAD=gpt-1.3b-bf16 OUT=$OUT/b timeout 240 bash bench/gpu_vs_pytorch.sh > $OUT/b/summary.txt 2>&1; tail -4 $OUT/b/summary.txt; grep "gpt-1.3b" $OUT/b/summary.txt | tail -2
(cd $OUT && tar czf b.tgz b && rm -rf b); echo "t=$(( $(date +%s)-T0 )) 1.3b"
if [ "${KERN:-0}" = 1 ]; then
mkdir -p $OUT/k; OUT=$OUT/k timeout 400 bash bench/gpu_kernels.sh > $OUT/k/summary.txt 2>&1; tail -14 $OUT/k/summary.txt
(cd $OUT && tar czf k.tgz k && rm -rf k); echo "t=$(( $(date +%s)-T0 )) kernels"
fi
