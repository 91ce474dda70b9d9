#!/usr/bin/env bash
# ThreadSanitizer: build with clang -fsanitize=thread, run a chosen subset of the host suite, then the
# multithreaded stress of test_reliability for a longer time. No suppressions: any report fails.
#   tests/tsan.sh [BUILDDIR]       default build-tsan; $CUVMM_STRESS_MS: stress duration (default 20000)
#
# Subset, for time (build, subset and stress take about 3 minutes on 2 cores): test_reliability (double
# faults, the inject-fault race, the statistics snapshot under concurrency, the stress), test_region
# (fences, trims racing the background thread), test_kv (map-ahead), test_ctx, test_errors, test_phys,
# test_capture (threads allocating under capture beside others, the graph registry), test_torch_shim,
# test_publish (snapshots by the background thread and by library calls) and outside. Left out: test_pool
# (over 90 s without TSan; its threads are covered by the stress) and test_sleep (127 s under TSan, clean
# when last run in full).
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
build=${1:-build-tsan}
cd "$root"

# TSan (clang 14) needs its fixed memory layout: on kernels with more ASLR entropy (vm.mmap_rnd_bits > 28)
# it dies with "unexpected memory mapping". Probe once; if a plain TSan program fails, run every test
# with ASLR off (setarch -R), which brings the layout back.
probe_dir=$(mktemp -d)
trap 'rm -rf "$probe_dir"' EXIT
printf '#include <pthread.h>\nstatic void *f(void *a) { return a; }\nint main(void) { pthread_t t; pthread_create(&t, 0, f, 0); return pthread_join(t, 0); }\n' \
	>"$probe_dir/p.c"
${CC:-clang} -fsanitize=thread "$probe_dir/p.c" -o "$probe_dir/p"
wrap=()
run=()
if ! "$probe_dir/p" >/dev/null 2>&1; then
	if setarch "$(uname -m)" -R "$probe_dir/p" >/dev/null 2>&1; then
		wrap=(--wrapper "setarch $(uname -m) -R")
		run=(setarch "$(uname -m)" -R)
		echo "tsan: running with ASLR off (setarch -R); vm.mmap_rnd_bits=$(cat /proc/sys/vm/mmap_rnd_bits 2>/dev/null)"
	else
		echo "tsan: ThreadSanitizer cannot run on this machine, even with ASLR off" >&2
		exit 1
	fi
fi

rm -rf "$build"
CC=clang CXX=clang++ meson setup "$build" -Db_sanitize=thread -Db_lundef=false \
	-Dtests=enabled -Ddocs=disabled -Dbench=disabled -Dexamples=disabled -Dpython=disabled >/dev/null
ninja -C "$build" >/dev/null

export TSAN_OPTIONS="halt_on_error=1 second_deadlock_stack=1 ${TSAN_OPTIONS:-}"
meson test -C "$build" --print-errorlogs --timeout-multiplier 3 "${wrap[@]}" \
	test_reliability-host test_region-host test_kv-host test_ctx-host test_errors-host test_phys-host \
	test_capture-host test_torch_shim-host test_publish-host outside-host

ms=${CUVMM_STRESS_MS:-20000}
echo "tsan: stress (test_reliability, case stress) for ${ms} ms"
CUVMM_BACKEND=host CK_RUN_CASE=stress CUVMM_STRESS_MS=$ms CK_DEFAULT_TIMEOUT=600 \
	"${run[@]}" "$build/tests/test_reliability"
echo "tsan: clean"
