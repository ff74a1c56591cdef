export XLA_PYTHON_CLIENT_PREALLOCATE=false
T0=$SECONDS
timeout 390 python3 -m pytest -v -n 14 -p no:cacheprovider tests --ignore=tests/test_mla_kernel.py --ignore=tests/test_randomized_mla.py --ignore=tests/test_mla_fp8_cache.py > $OUT/full.log 2>&1
echo "rc $? at $((SECONDS-T0)) s"
grep -cE " PASSED" $OUT/full.log; grep -cE " SKIPPED" $OUT/full.log
grep -E " (FAILED|ERROR)" $OUT/full.log | sed 's/.*\] //' | head -40
tail -2 $OUT/full.log
