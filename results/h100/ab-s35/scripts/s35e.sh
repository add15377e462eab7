# stop 35 call 5 (H100): CUDA unit tests; A/B: new (qkv node + LN backward warp + PDL), HARNESS_FUSED_QKV=0, all three off (the c610449 path), HARNESS_LT_WS=0 (probe), alternating; traces.
source .carry/prep.sh
T0=$(date +%s)
./.carry/harness-tests --test-threads=1 cuda > $OUT/unit.txt 2>&1; grep -E "test result|FAILED|panicked" $OUT/unit.txt | head -8
.carry/harness env > $OUT/env.txt 2>&1
mkdir -p $OUT/ab $OUT/t
run() { case $1 in new) "${@:2}";; noqkv) HARNESS_FUSED_QKV=0 "${@:2}";; old) HARNESS_FUSED_QKV=0 HARNESS_PDL=0 HARNESS_LN_BWD_WARP=0 "${@:2}";; ws0) HARNESS_LT_WS=0 "${@:2}";; esac; }
for r in 1 2 3; do for v in new noqkv old ws0; do
  run $v timeout 90 .carry/harness run .carry/ab124.toml --out $OUT/ab/harness-$v-$r.json --quiet > $OUT/ab/harness-$v-$r.txt 2>&1 || tail -5 $OUT/ab/harness-$v-$r.txt
done; done
echo "t=$(( $(date +%s)-T0 )) ab"
for v in new old ws0; do
  run $v timeout 90 .carry/harness run .carry/trace124.toml --trace --out $OUT/t/trace-$v.json > $OUT/t/run-$v.txt 2>&1; python3 bench/trace_summary.py $OUT/t/trace-$v.trace/gpt2-124m-bf16*.json --top 50 > $OUT/t/summary-$v.txt 2>&1; gzip $OUT/t/trace-$v.trace/*.json
  echo "$v: $(grep -E '^GPU' $OUT/t/summary-$v.txt) | $(grep -E '^(pack_qkv|col_sums|void at::native::.anonymous namespace.::CatArray|Memset)' $OUT/t/summary-$v.txt | awk '{print $1, $(NF-2), $(NF-1)}' | tr '\n' ' ')"
done
echo "t=$(( $(date +%s)-T0 )) trace"
cd $OUT && tar czf ab.tgz ab t && cd - >/dev/null
for v in new noqkv old ws0; do python3 - $OUT/ab $v <<'PY'
import json,glob,sys
d,v=sys.argv[1:3]
t=[]
for p in sorted(glob.glob(f'{d}/harness-{v}-*.json')):
    e=json.load(open(p))['entries'][0]
    t.append(e['metrics']['tokens_per_s'] if e['status']=='ok' else 0)
print(v, 'mean tokens/s', round(sum(t)/len(t)), [round(x) for x in t], 'MFU', round(100*json.load(open(p))['entries'][0]['metrics'].get('mfu',0),2))
PY
done
rm -rf $OUT/ab $OUT/t
