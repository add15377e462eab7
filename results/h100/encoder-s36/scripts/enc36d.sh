# stop 36 call 4: CUDA unit tests; the encoder with the ReLU MLP node: fused vs libtorch (traced), each fused part switched off in turn (A/B, two rounds), and vs PyTorch eager/compile at 32x128 and 64x512.
source .carry/prep.sh
T0=$(date +%s)
./.carry/harness-tests --test-threads=1 cuda > $OUT/unit.txt 2>&1; grep -E "test result|FAILED|panicked" $OUT/unit.txt | head -8; grep -i "no relu\|no gelu" $OUT/unit.txt
echo "t=$(( $(date +%s)-T0 )) unit"
mkdir -p $OUT/e; SUITE=suites/gpu-kernels-encoder.toml TRACE=1 OUT=$OUT/e timeout 300 bash bench/gpu_kernels.sh > $OUT/e/summary.txt 2>&1; tail -12 $OUT/e/summary.txt
.carry/harness env > $OUT/e/env.txt 2>&1
for f in $OUT/e/traced-*.trace/*.txt; do echo "== $f"; sed -n 1,45p $f; done > $OUT/e/traces-head.txt
rm -f $OUT/e/*.log; (cd $OUT && tar czf e.tgz e && rm -rf e); echo "t=$(( $(date +%s)-T0 )) encoder kernels"
mkdir -p $OUT/ab; sed 's/^kernels = "fused"/kernels = "libtorch"/' suites/gpu-kernels-encoder.toml > $OUT/ab/libtorch.toml
ab() { # NAME ENV...
  local n=$1; shift; env "$@" .carry/harness run ${SUITE_AB:-suites/gpu-kernels-encoder.toml} --out $OUT/ab/$n.json --quiet > $OUT/ab/$n.txt 2>&1 || tail -3 $OUT/ab/$n.txt; }
for r in 1 2; do
  ab all-$r X=1; ab no-mlp-$r HARNESS_FUSED_MLP=0; ab no-post-norm-$r HARNESS_FUSED_POST_NORM=0; ab no-qkv-$r HARNESS_FUSED_QKV=0
  SUITE_AB=$OUT/ab/libtorch.toml ab libtorch-$r X=1
done
python3 - $OUT/ab <<'PY'
import json,sys,glob,os,collections
d=sys.argv[1]; t=collections.defaultdict(dict)
for p in sorted(glob.glob(d+"/*.json")):
    n=os.path.basename(p)[:-5]
    for e in json.load(open(p))["entries"]:
        t[e["workload"]][n]=e["metrics"]["tokens_per_s"]
for w,v in t.items():
    base=(v["all-1"]+v["all-2"])/2
    print(w)
    for cfg in ["all","no-mlp","no-post-norm","no-qkv","libtorch"]:
        a,b=v[cfg+"-1"],v[cfg+"-2"]
        print("  %-14s %10.0f %10.0f  all/this %.3f"%(cfg,a,b,base/((a+b)/2)))
PY
(cd $OUT && tar czf ab.tgz ab && rm -rf ab); echo "t=$(( $(date +%s)-T0 )) ab"
for w in "32 128 encoder-claims5-bf16" "64 512 encoder-claims5-bf16-64x512"; do set -- $w
  mkdir -p $OUT/p$1; SUITE=suites/gpu-kernels-encoder.toml PYBENCH=bench/pytorch_encoder.py PYARGS="--batch $1 --seq-len $2" WORKLOAD=$3 OUT=$OUT/p$1 timeout 240 bash bench/gpu_vs_pytorch.sh > $OUT/p$1/summary.txt 2>&1; tail -3 $OUT/p$1/summary.txt; grep "$3/" $OUT/p$1/summary.txt | tail -2
done
(cd $OUT && tar czf p.tgz p32 p64 && rm -rf p32 p64); echo "t=$(( $(date +%s)-T0 )) encoder vs pytorch"
