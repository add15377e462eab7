# stop 36 final build: CUDA unit tests, GPT-2 124M against PyTorch eager/compile (bench/gpu_vs_pytorch.sh), one encoder run.
source .carry/prep.sh
T0=$(date +%s)
./.carry/harness-tests --test-threads=1 cuda > $OUT/unit.txt 2>&1; grep -E "test result|FAILED|panicked" $OUT/unit.txt | head -4
mkdir -p $OUT/g; OUT=$OUT/g timeout 300 bash bench/gpu_vs_pytorch.sh > $OUT/g/summary.txt 2>&1; tail -4 $OUT/g/summary.txt; grep gpt2-124m $OUT/g/summary.txt | tail -2
.carry/harness run suites/gpu-kernels-encoder.toml --out $OUT/g/enc.json --quiet > $OUT/g/enc.txt 2>&1; grep encoder $OUT/g/enc.txt | tail -2
rm -f $OUT/g/*.log; gzip -9 $OUT/g/*.json; (cd $OUT && tar czf g.tgz g && rm -rf g); echo "t=$(( $(date +%s)-T0 ))"
