export XLA_PYTHON_CLIENT_PREALLOCATE=false
T0=$SECONDS
timeout 470 python3 -m pytest -q -n 14 -p no:cacheprovider tests --durations=25 --junitxml=$OUT/junit.xml > $OUT/full.log 2>&1
echo "rc $? at $((SECONDS-T0)) s"
tail -3 $OUT/full.log
grep -E "^(FAILED|ERROR)" $OUT/full.log | head -40
