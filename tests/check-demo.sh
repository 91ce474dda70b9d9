#!/bin/sh
# Usage: check-demo.sh SHRINK_ON_IDLE SLEEP_WAKE
# On the host backend: shrink_on_idle's table has a cache column, says "host" rather than "device", and its
# columns add up on every line (weights + kv + activations + cache held = host held, to the rounding of the
# printed figures); sleep_wake prints no GPU target. (On a GPU the same programs say "device" and print
# the target; tools/gpu-run.sh runs them there.)
set -u
tmp=$(mktemp -d "${TMPDIR:-/tmp}/cuvmm-demo.XXXXXX")
trap 'rm -rf "$tmp"' EXIT INT TERM
fail=0
export CUVMM_BACKEND=host

"$1" --quick > "$tmp/shrink" 2>&1 || { cat "$tmp/shrink" >&2; echo "FAIL: shrink_on_idle --quick" >&2; exit 1; }
grep -q '| cache  |' "$tmp/shrink" || { echo "FAIL: no cache column" >&2; fail=1; }
grep -q 'host MiB' "$tmp/shrink" || { echo "FAIL: the columns do not say host" >&2; fail=1; }
if grep -qi 'device' "$tmp/shrink"; then
	echo "FAIL: 'device' on the host backend:" >&2
	grep -i device "$tmp/shrink" >&2
	fail=1
fi
# Data lines: "  t phase | w live/held | kv live/held | act live/held | cache | host live/held | ...".
awk -F'|' '/^ *[0-9]+\.[0-9] (burst|idle|setup)/ {
	n++
	split($2, w, "/"); split($3, k, "/"); split($4, a, "/"); split($6, d, "/")
	sum = w[2] + k[2] + a[2] + $5
	# The statistics are read one after another: memory released in between leaves the objects above the
	# device, and the cache column clamped at 0; that is a race of the reads, not a missing column.
	if ($5 + 0 == 0 && sum > d[2]) next
	if (sum - d[2] > 0.35 || d[2] - sum > 0.35) { bad++; print "columns do not add up: " $0 > "/dev/stderr" }
}
END { if (n == 0) { print "no data lines" > "/dev/stderr"; exit 1 } exit bad ? 1 : 0 }' "$tmp/shrink" || fail=1

"$2" --quick > "$tmp/sleep" 2>&1 || { cat "$tmp/sleep" >&2; echo "FAIL: sleep_wake --quick" >&2; exit 1; }
if grep -qi 'target' "$tmp/sleep"; then
	echo "FAIL: sleep_wake prints the GPU's target on the host backend:" >&2
	grep -i target "$tmp/sleep" >&2
	fail=1
fi
[ $fail -eq 0 ] && echo "PASS: demo columns add up, cache shown, host named; no GPU target on the host"
exit $fail
