# stop 36: the session's first build (3af1e4d) against the last (e1c2d7f), GPT-2 124M, one call (bench/compare_builds.sh, COMPILE=0).
source .carry/prep.sh
zcat .carry/gz/harness-old.gz > .carry/harness-old && chmod +x .carry/harness-old
mkdir -p $OUT/c; OUT=$OUT/c COMPILE=0 timeout 420 bash bench/compare_builds.sh .carry/harness-old .carry/harness > $OUT/c/summary.txt 2>&1; tail -8 $OUT/c/summary.txt
rm -f $OUT/c/*.log; gzip -9 $OUT/c/*.json; (cd $OUT && tar czf c.tgz c && rm -rf c)
