# stop 35 call 3 (H100): LayerNorm backward variants: unit tests (default reg128, smem128), A/B of 6 variants alternating, a traced step of each.
source .carry/prep.sh
T0=$(date +%s)
for v in reg128 smem128; do HARNESS_LN_BWD_PROBE=$v ./.carry/harness-tests --test-threads=1 cuda > $OUT/unit-$v.txt 2>&1; grep -E "test result|FAILED|panicked" $OUT/unit-$v.txt | head -4; done
grep "add_ln_bwd.*6:" $OUT/unit-*.txt | head
.carry/harness env > $OUT/env.txt 2>&1
mkdir -p $OUT/ab $OUT/t
V="old reg256 reg128 smem128 reg64 smem64"
run() { if [ $1 = old ]; then HARNESS_LN_BWD_WARP=0 "${@:2}"; else HARNESS_LN_BWD_PROBE=$1 "${@:2}"; fi; }
for r in 1 2; do for v in $V; do
  run $v timeout 90 .carry/harness run .carry/ab124.toml --out $OUT/ab/harness-$v-$r.json --quiet > $OUT/ab/harness-$v-$r.txt 2>&1 || tail -5 $OUT/ab/harness-$v-$r.txt
done; done
echo "t=$(( $(date +%s)-T0 )) ab"
for v in $V; do
  run $v timeout 90 .carry/harness run .carry/trace124.toml --trace --out $OUT/t/trace-$v.json > $OUT/t/run-$v.txt 2>&1; python3 bench/trace_summary.py $OUT/t/trace-$v.trace/gpt2-124m-bf16*.json --top 45 > $OUT/t/summary-$v.txt 2>&1; gzip $OUT/t/trace-$v.trace/*.json
  echo "$v: $(grep -E '^GPU' $OUT/t/summary-$v.txt) | $(grep -E '^add_ln_bwd' $OUT/t/summary-$v.txt | awk '{print $1, $3}') | partials $(grep -E '^add_partials' $OUT/t/summary-$v.txt | awk '{print $3}')"
done
echo "t=$(( $(date +%s)-T0 )) trace"
cd $OUT && tar czf ab.tgz ab t && cd - >/dev/null
python3 bench/summarize.py $OUT/ab gpt2-124m-bf16 2>&1 | grep -v "device ms" | tail -14
rm -rf $OUT/ab $OUT/t
