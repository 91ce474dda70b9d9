#!/bin/sh
# Usage: check-subproject.sh SOURCE_ROOT
# cuvmm as a meson subproject builds the library alone by default: a scratch parent project that uses
# dependency('cuvmm', fallback: ['cuvmm', 'cuvmm_dep']) configures with no cuvmm test registered, builds at
# most a handful of cuvmm targets (the library; no tests, examples, benchmarks or Doxygen), and its own
# program, compiled as C99 -pedantic -Werror without any CUDA path, links and runs on the host backend.
# CI runs it.
set -eu

srcroot=$(cd "$1" && pwd)
tmp=$(mktemp -d "${TMPDIR:-/tmp}/cuvmm-sub.XXXXXX")
trap 'rm -rf "$tmp"' EXIT INT TERM

mkdir -p "$tmp/parent/subprojects"
ln -s "$srcroot" "$tmp/parent/subprojects/cuvmm"
cp "$srcroot/tests/outside.c" "$tmp/parent/app.c"
cat > "$tmp/parent/meson.build" <<'MESON'
project('parent', 'c', meson_version: '>= 1.0.0')
cuvmm_dep = dependency('cuvmm', fallback: ['cuvmm', 'cuvmm_dep'])
app = executable('app', 'app.c', dependencies: cuvmm_dep, c_args: ['-std=c99', '-pedantic', '-Werror'])
test('app', app, env: ['CUVMM_BACKEND=host'])
MESON

${MESON:-meson} setup "$tmp/build" "$tmp/parent" > "$tmp/setup.log" 2>&1 || {
	cat "$tmp/setup.log" >&2
	echo "FAIL: meson setup of a parent project" >&2
	exit 1
}
ntests=$(${MESON:-meson} introspect --tests "$tmp/build" | grep -o '"name": *"[^"]*"' | wc -l)
ntargets=$(${MESON:-meson} introspect --targets "$tmp/build" | grep -o '"subproject": *"cuvmm"' | wc -l)
echo "as a subproject: $ntargets cuvmm targets, $ntests tests in all (the parent's own: 1)"
if [ "$ntests" -ne 1 ]; then
	${MESON:-meson} introspect --tests "$tmp/build" | grep -o '"name": *"[^"]*"' >&2
	echo "FAIL: cuvmm's tests joined the parent's meson test" >&2
	exit 1
fi
if [ "$ntargets" -gt 4 ]; then
	echo "FAIL: cuvmm builds $ntargets targets as a subproject; the library alone is 2-4" >&2
	exit 1
fi
ninja -C "$tmp/build" > "$tmp/build.log" 2>&1 || {
	cat "$tmp/build.log" >&2
	echo "FAIL: the parent does not build" >&2
	exit 1
}
${MESON:-meson} test -C "$tmp/build" --print-errorlogs > "$tmp/test.log" 2>&1 || {
	cat "$tmp/test.log" >&2
	echo "FAIL: the parent's program does not run" >&2
	exit 1
}
echo "PASS: cuvmm as a subproject builds the library alone; the parent's program builds and runs"
