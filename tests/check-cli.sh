#!/bin/sh
# Usage: check-cli.sh PROGRAM SOURCE [BAD_ARGUMENT...]
# The command-line conventions of the examples and benchmarks (examples/cli.h):
#   - PROGRAM --help exits 0, prints "Usage:" on stdout and nothing on stderr, and describes every long
#     option of SOURCE's option table ({"name", ...} entries);
#   - an unknown option and a stray argument exit 2;
#   - each BAD_ARGUMENT (e.g. --layers=0) exits 2 with an error on stderr that names the option and value,
#     before doing any work (nothing on stdout).
set -u

prog=$1
src=$2
shift 2
name=$(basename "$prog")
tmp=$(mktemp -d "${TMPDIR:-/tmp}/cuvmm-cli.XXXXXX")
trap 'rm -rf "$tmp"' EXIT INT TERM
fail=0

"$prog" --help > "$tmp/out" 2> "$tmp/err"
rc=$?
if [ $rc -ne 0 ] || ! grep -q '^Usage:' "$tmp/out" || [ -s "$tmp/err" ]; then
	echo "FAIL: $name --help: rc $rc (want 0), help on stdout, nothing on stderr" >&2
	cat "$tmp/out" "$tmp/err" >&2
	fail=1
fi
# Every long option in the source's option table is described in the help.
for opt in $(sed -n 's/.*{"\([a-z][a-z0-9-]*\)", *\(no\|required\|optional\)_argument.*/\1/p' "$src"); do
	if ! grep -q -- "--$opt" "$tmp/out"; then
		echo "FAIL: $name --help does not describe --$opt" >&2
		fail=1
	fi
done

check_usage_error() {
	"$prog" "$@" > "$tmp/out" 2> "$tmp/err"
	rc=$?
	if [ $rc -ne 2 ]; then
		echo "FAIL: $name $*: rc $rc, want 2" >&2
		cat "$tmp/out" "$tmp/err" >&2
		fail=1
	elif [ -s "$tmp/out" ]; then
		echo "FAIL: $name $*: printed on stdout before refusing the argument" >&2
		cat "$tmp/out" >&2
		fail=1
	fi
}
check_usage_error --no-such-option
check_usage_error stray-argument
for bad in "$@"; do
	check_usage_error "$bad"
	value=${bad#*=}
	if [ $rc -eq 2 ] && ! grep -qF -- "$value" "$tmp/err"; then
		echo "FAIL: $name $bad: the error does not name the value '$value'" >&2
		cat "$tmp/err" >&2
		fail=1
	fi
done
[ $fail -eq 0 ] && echo "PASS: $name: --help, unknown option, stray argument and $# bad values"
exit $fail
