# stop 35 call 1 (H100): CUDA unit tests; cuBLASLt candidates timed in graphs (verbose), A/B against launch-timed (HARNESS_LT_GRAPH_TIMED=0), alternating; trace.
source .carry/prep.sh
T0=$(date +%s)
./.carry/harness-tests --test-threads=1 cuda > $OUT/unit.txt 2>&1; grep -E "test result|FAILED|panicked" $OUT/unit.txt | head -8
.carry/harness env > $OUT/env.txt 2>&1
mkdir -p $OUT/ab
HARNESS_LT_VERBOSE=1 timeout 90 .carry/harness run .carry/ab124.toml --out $OUT/ab/verbose.json --quiet > $OUT/verbose.txt 2>&1 || tail -5 $OUT/verbose.txt
rm -f $OUT/ab/verbose.json
echo "t=$(( $(date +%s)-T0 )) verbose"
for r in 1 2 3; do
  timeout 90 .carry/harness run .carry/ab124.toml --out $OUT/ab/harness-new-$r.json --quiet > $OUT/ab/harness-new-$r.txt 2>&1 || tail -5 $OUT/ab/harness-new-$r.txt
  HARNESS_LT_GRAPH_TIMED=0 timeout 90 .carry/harness run .carry/ab124.toml --out $OUT/ab/harness-old-$r.json --quiet > $OUT/ab/harness-old-$r.txt 2>&1 || tail -5 $OUT/ab/harness-old-$r.txt
done
echo "t=$(( $(date +%s)-T0 )) ab"
mkdir -p $OUT/t; HARNESS_CUDA_GRAPH=1 timeout 90 .carry/harness run suites/gpu-trace.toml --trace --out $OUT/t/trace-graph1.json > $OUT/t/run-graph1.txt 2>&1; python3 bench/trace_summary.py $OUT/t/trace-graph1.trace/gpt2-124m-bf16*.json --top 45 > $OUT/t/summary-124m-graph1.txt 2>&1; python3 bench/trace_summary.py $OUT/t/trace-graph1.trace/gpt-1.3b*.json --top 30 > $OUT/t/summary-1.3b-graph1.txt 2>&1; gzip $OUT/t/trace-graph1.trace/*.json; sed -n 6,7p $OUT/t/summary-124m-graph1.txt; grep -c "" $OUT/t/summary-124m-graph1.txt
grep -E "Memset|^GPU" $OUT/t/summary-*.txt
echo "t=$(( $(date +%s)-T0 )) trace"
grep -E "nodes per call" $OUT/verbose.txt | awk '{print $6, $7}' | sort | uniq -c
python3 bench/summarize.py $OUT/ab gpt2-124m-bf16 2>&1 | tail -8
