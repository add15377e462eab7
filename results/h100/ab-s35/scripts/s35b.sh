# stop 35 call 2 (H100): CUDA unit tests; warp-per-row LayerNorm backward A/B (HARNESS_LN_BWD_WARP=0), alternating; graph stamps; trace.
source .carry/prep.sh
T0=$(date +%s)
./.carry/harness-tests --test-threads=1 cuda > $OUT/unit.txt 2>&1; grep -E "test result|FAILED|panicked" $OUT/unit.txt | head -8
.carry/harness env > $OUT/env.txt 2>&1
mkdir -p $OUT/ab
for r in 1 2 3; do
  timeout 90 .carry/harness run .carry/ab124.toml --out $OUT/ab/harness-new-$r.json --quiet > $OUT/ab/harness-new-$r.txt 2>&1 || tail -5 $OUT/ab/harness-new-$r.txt
  HARNESS_LN_BWD_WARP=0 timeout 90 .carry/harness run .carry/ab124.toml --out $OUT/ab/harness-old-$r.json --quiet > $OUT/ab/harness-old-$r.txt 2>&1 || tail -5 $OUT/ab/harness-old-$r.txt
done
echo "t=$(( $(date +%s)-T0 )) ab"
HARNESS_GRAPH_STAMPS=1 timeout 90 .carry/harness run .carry/ab124.toml --out $OUT/stamps.json --quiet > $OUT/stamps.txt 2>&1; grep "mean of 20" $OUT/stamps.txt | tail -3; rm -f $OUT/stamps.json
mkdir -p $OUT/t; HARNESS_CUDA_GRAPH=1 timeout 90 .carry/harness run suites/gpu-trace.toml --trace --out $OUT/t/trace-graph1.json > $OUT/t/run-graph1.txt 2>&1; python3 bench/trace_summary.py $OUT/t/trace-graph1.trace/gpt2-124m-bf16*.json --top 45 > $OUT/t/summary-124m-graph1.txt 2>&1; python3 bench/trace_summary.py $OUT/t/trace-graph1.trace/gpt-1.3b*.json --top 30 > $OUT/t/summary-1.3b-graph1.txt 2>&1; gzip $OUT/t/trace-graph1.trace/*.json
grep -E "^GPU|add_ln|add_partials" $OUT/t/summary-124m-graph1.txt
echo "t=$(( $(date +%s)-T0 )) trace"
cd $OUT && tar czf ab.tgz ab t && rm -rf ab t && cd - >/dev/null
python3 bench/summarize.py /dev/null 2>/dev/null; mkdir -p /tmp/ab && tar -C /tmp -xzf $OUT/ab.tgz && python3 bench/summarize.py /tmp/ab gpt2-124m-bf16 2>&1 | tail -8
