# stop 34 call 12 (H100): cuBLASLt workspace cap experiment (HARNESS_LT_WORKSPACE=0) against the default, alternating; traces of both.
source .carry/prep.sh >/dev/null
mkdir -p $OUT/ab $OUT/t0 $OUT/t1
for r in 1 2; do
  timeout 90 .carry/harness run .carry/ab124.toml --out $OUT/ab/harness-new-$r.json --quiet > $OUT/ab/new-$r.txt 2>&1 || tail -5 $OUT/ab/new-$r.txt
  HARNESS_LT_WORKSPACE=0 timeout 90 .carry/harness run .carry/ab124.toml --out $OUT/ab/harness-ws0-$r.json --quiet > $OUT/ab/ws0-$r.txt 2>&1 || tail -5 $OUT/ab/ws0-$r.txt
done
HARNESS_LT_WORKSPACE=0 HARNESS_CUDA_GRAPH=1 timeout 90 .carry/harness run suites/gpu-trace.toml --trace --out $OUT/t0/trace.json > $OUT/t0/run.txt 2>&1; python3 bench/trace_summary.py $OUT/t0/trace.trace/gpt2-124m-bf16*.json --top 45 > $OUT/t0/summary-124m.txt 2>&1; sed -n 6,7p $OUT/t0/summary-124m.txt; grep -i memset $OUT/t0/summary-124m.txt
python3 bench/summarize.py $OUT/ab gpt2-124m-bf16 2>&1 | tail -5
cd $OUT && tar czf all.tgz ab t0 && rm -rf ab t0 t1
