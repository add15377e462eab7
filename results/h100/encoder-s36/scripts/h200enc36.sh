# stop 36: the encoder against PyTorch eager/compile on an H200 (same build as call 5 plus the folds of caaa625), with the CUDA unit tests.
source .carry/prep.sh
T0=$(date +%s)
./.carry/harness-tests --test-threads=1 cuda > $OUT/unit.txt 2>&1; grep -E "test result|FAILED|panicked" $OUT/unit.txt | head -4
for w in "64 512 encoder-claims5-bf16-64x512" "32 128 encoder-claims5-bf16"; do set -- $w
  mkdir -p $OUT/p$1; SUITE=suites/gpu-kernels-encoder.toml PYBENCH=bench/pytorch_encoder.py PYARGS="--batch $1 --seq-len $2" WORKLOAD=$3 OUT=$OUT/p$1 timeout 240 bash bench/gpu_vs_pytorch.sh > $OUT/p$1/summary.txt 2>&1; tail -3 $OUT/p$1/summary.txt; grep "$3/" $OUT/p$1/summary.txt | tail -2
done
for d in p32 p64; do gzip -9 $OUT/$d/*.json; done
(cd $OUT && tar czf p.tgz p32 p64 && rm -rf p32 p64); echo "t=$(( $(date +%s)-T0 )) encoder vs pytorch"
