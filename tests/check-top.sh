#!/bin/sh
# Usage: check-top.sh CUVMM_TOP TOP_CHILD
# Two processes using the library on the host backend, each with a named pool, publish into a private
# directory; cuvmm-top --once shows both (pid, pool name, MiB); once one is killed it is no longer shown,
# and --clean removes its file.
set -u
top=$1
child=$2
dir=$(mktemp -d "${TMPDIR:-/tmp}/cuvmm-top.XXXXXX")
pid1= pid2=
cleanup() {
	[ -n "$pid1" ] && kill "$pid1" 2>/dev/null
	[ -n "$pid2" ] && kill "$pid2" 2>/dev/null
	rm -rf "$dir"
}
trap cleanup EXIT INT TERM
export CUVMM_BACKEND=host CUVMM_PUBLISH_DIR="$dir"
fail=0

# Start a child and wait for its "ready" (its allocation made).
start() {
	"$child" "$1" "$2" > "$dir/$1.out" 2>&1 &
	for _ in $(seq 100); do
		grep -q ready "$dir/$1.out" && return 0
		sleep 0.1
	done
	echo "FAIL: top_child $1 did not get ready" >&2
	cat "$dir/$1.out" >&2
	exit 1
}
start alpha 6
pid1=$!
start beta 10
pid2=$!

# The snapshot taken after the allocation may lag it by up to 100 ms: look for a few seconds.
want() { # want PATTERN...: every pattern in one --once output
	for _ in $(seq 50); do
		"$top" --once --dir="$dir" > "$dir/top.out" 2> "$dir/top.err" || break
		ok=1
		for pat in "$@"; do
			grep -qE -- "$pat" "$dir/top.out" || ok=0
		done
		[ $ok -eq 1 ] && return 0
		sleep 0.1
	done
	echo "FAIL: cuvmm-top --once does not show: $*" >&2
	cat "$dir/top.out" "$dir/top.err" >&2
	fail=1
	return 1
}
want "^PID $pid1 .*top_child.*backend host" "^PID $pid2 .*top_child.*backend host" \
	"pool +alpha +0 +6\.0 MiB +6\.0 MiB" "pool +beta +0 +10\.0 MiB +10\.0 MiB" "2 contexts"

kill "$pid1"
wait "$pid1" 2>/dev/null
if want "^PID $pid2 " "1 context " && grep -qE "^PID $pid1 |alpha" "$dir/top.out"; then
	echo "FAIL: the killed process is still shown" >&2
	cat "$dir/top.out" >&2
	fail=1
fi
pid1_file=$(ls "$dir" | grep -c "^cuvmm\.$pid1\.")
[ "$pid1_file" -eq 1 ] || { echo "FAIL: the killed process left no file to clean ($pid1_file)" >&2; fail=1; }
"$top" --once --clean --dir="$dir" > /dev/null
if ls "$dir" | grep -q "^cuvmm\.$pid1\."; then
	echo "FAIL: --clean left the dead process's file" >&2
	fail=1
fi
# --pid shows one process only.
"$top" --once --pid="$pid2" --dir="$dir" > "$dir/top.out"
grep -q "^PID $pid2 " "$dir/top.out" || { echo "FAIL: --pid=$pid2 does not show it" >&2; fail=1; }

kill "$pid2"
wait "$pid2" 2>/dev/null
pid1= pid2=
[ $fail -eq 0 ] && echo "PASS: cuvmm-top shows two processes, their pools, and drops a killed one"
exit $fail
