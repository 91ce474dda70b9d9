#!/usr/bin/env bash
# Build the fuzz harness, replay the kept crash inputs (tests/fuzz/regressions), then fuzz for a fixed
# time from the seed corpus (tests/fuzz/corpus). Fails on any finding; the input is left in
# OUTDIR/artifacts (add it to tests/fuzz/regressions once fixed).
#   tests/fuzz/run.sh [OUTDIR [SECONDS]]     defaults: build-fuzz, $FUZZ_SECONDS or 150
set -euo pipefail

root=$(cd "$(dirname "$0")/../.." && pwd)
out=${1:-build-fuzz}
secs=${2:-${FUZZ_SECONDS:-150}}
jobs=${FUZZ_JOBS:-1}

"$root/tests/fuzz/build.sh" "$out" >/dev/null
export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=1}:abort_on_error=0
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-halt_on_error=1:print_stacktrace=1}
rm -rf "$out/artifacts" "$out/corpus"
mkdir -p "$out/artifacts" "$out/corpus"

echo "fuzz: replaying $(ls "$root/tests/fuzz/regressions" | wc -l) kept crash inputs"
"$out/fuzz_ops" -runs=1 "$root"/tests/fuzz/regressions/* 2>&1 | tail -n 3

echo "fuzz: ${secs}s from $(ls "$root/tests/fuzz/corpus" | wc -l) seeds, $jobs job(s)"
# New inputs go to a scratch corpus, never into the repository's seeds.
set +e
"$out/fuzz_ops" -max_total_time="$secs" -max_len=600 -timeout=20 -rss_limit_mb=2048 \
	-print_final_stats=1 -artifact_prefix="$out/artifacts/" \
	${FUZZ_JOBS:+-fork="$jobs"} "$out/corpus" "$root/tests/fuzz/corpus" >"$out/fuzz.log" 2>&1
rc=$?
set -e
grep -E '^(stat::number_of_executed_units|stat::peak_rss_mb|Done)' "$out/fuzz.log" || true
if [ "$rc" -ne 0 ] || [ -n "$(ls -A "$out/artifacts")" ]; then
	grep -E '^(fuzz_ops:|==[0-9]+==ERROR|SUMMARY)' "$out/fuzz.log" | head -n 20 >&2 || true
	echo "fuzz: FINDING (exit $rc); inputs in $out/artifacts:" >&2
	ls -l "$out/artifacts" >&2
	exit 1
fi
echo "fuzz: no finding"
