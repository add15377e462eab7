# stop 35 call 4 (H100): CUDA unit tests; A/B: new (LN backward warp + PDL), HARNESS_PDL=0, both off (the c610449 path), alternating; trace of new.
source .carry/prep.sh
T0=$(date +%s)
./.carry/harness-tests --test-threads=1 cuda > $OUT/unit.txt 2>&1; grep -E "test result|FAILED|panicked" $OUT/unit.txt | head -8
HARNESS_PDL=0 ./.carry/harness-tests --test-threads=1 cuda > $OUT/unit-nopdl.txt 2>&1; grep -E "test result|FAILED|panicked" $OUT/unit-nopdl.txt | head -4
.carry/harness env > $OUT/env.txt 2>&1
mkdir -p $OUT/ab $OUT/t
run() { case $1 in new) "${@:2}";; nopdl) HARNESS_PDL=0 "${@:2}";; old) HARNESS_PDL=0 HARNESS_LN_BWD_WARP=0 "${@:2}";; esac; }
for r in 1 2 3; do for v in new nopdl old; do
  run $v timeout 90 .carry/harness run .carry/ab124.toml --out $OUT/ab/harness-$v-$r.json --quiet > $OUT/ab/harness-$v-$r.txt 2>&1 || tail -5 $OUT/ab/harness-$v-$r.txt
done; done
echo "t=$(( $(date +%s)-T0 )) ab"
for v in new old; do
  run $v timeout 90 .carry/harness run .carry/trace124.toml --trace --out $OUT/t/trace-$v.json > $OUT/t/run-$v.txt 2>&1; python3 bench/trace_summary.py $OUT/t/trace-$v.trace/gpt2-124m-bf16*.json --top 45 > $OUT/t/summary-$v.txt 2>&1; gzip $OUT/t/trace-$v.trace/*.json
  echo "$v: $(grep -E '^GPU' $OUT/t/summary-$v.txt) | $(grep -E '^add_ln_bwd' $OUT/t/summary-$v.txt | awk '{print $1, $3}') | partials $(grep -E '^add_partials' $OUT/t/summary-$v.txt | awk '{print $3}')"
done
echo "t=$(( $(date +%s)-T0 )) trace"
cd $OUT && tar czf ab.tgz ab t && cd - >/dev/null
python3 bench/summarize.py $OUT/ab gpt2-124m-bf16 2>&1 | grep -v "device ms" | tail -10
for v in new nopdl old; do python3 - $OUT/ab $v <<'PY'
import json,glob,sys
d,v=sys.argv[1:3]
t=[json.load(open(p))['entries'][0]['metrics']['tokens_per_s'] for p in sorted(glob.glob(f'{d}/harness-{v}-*.json'))]
print(v, 'mean tokens/s', round(sum(t)/len(t)), [round(x) for x in t])
PY
done
rm -rf $OUT/ab $OUT/t
