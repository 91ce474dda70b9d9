#!/usr/bin/env bash
# Everything that must be proven on a real GPU, in one go: build, the cuda test suite, the benchmarks and
# the examples. Written for the device machine of this project (see doc/gpu-machine.md): Check comes as .debs
# in .deps/ (carried with the call), results go to $OUT (at most 8 files come back).
#
#   tools/gpu-run.sh [STAGE...]     stages: tests bench examples torch torchbench (default: the first three)
#
# Logs: $OUT/tests.log, $OUT/bench.log, $OUT/examples.log, $OUT/torch.log, $OUT/torchbench.log; CSVs:
# trace.csv, trace-summary.csv, shrink.csv, kv.csv; torchbench.json. The cuda suite includes the PyTorch
# tests (torch-cuda); the torch stage runs an unmodified script with and without `python -m cuvmm.torch`,
# torchbench the PyTorch scenarios of bench/torch/scenarios.py ($TORCHBENCH: its options).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/cuvmm-out}
mkdir -p "$OUT"
B=${BUILD:-/tmp/cuvmm-gpu-build}
stages=${*:-tests bench examples}

if ls .deps/*.deb >/dev/null 2>&1; then
	for f in .deps/*.deb; do dpkg -x "$f" /; done
fi
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
if ! { meson setup --wipe "$B" -Ddocs=disabled >"$OUT/build.log" 2>&1 && ninja -C "$B" >>"$OUT/build.log" 2>&1; }; then
	tail -40 "$OUT/build.log"
	exit 1
fi

for s in $stages; do
	case $s in
	tests)
		meson test -C "$B" --suite cuda --suite build --print-errorlogs --num-processes 1 \
			>"$OUT/tests.log" 2>&1
		grep -E "^ *[0-9]+/[0-9]+ |^(Ok|Fail|Skipped|Timeout):" "$OUT/tests.log"
		;;
	bench)
		{
			echo "== region_bench (1 GiB)"
			"$B/bench/region_bench" --size=1G --reps=10
			echo "== trace"
			"$B/bench/trace" --csv="$OUT/trace.csv" --summary-csv="$OUT/trace-summary.csv" --quiet
			echo "== return test in 1 GiB pieces (weights-sized allocations)"
			"$B/bench/trace" --allocators=cuvmm --requests=1 --return-piece-bytes=1g --quiet | grep -A4 "Return test"
			echo "== driver calls from several threads"
			"$B/bench/driver_threads"
		} >"$OUT/bench.log" 2>&1
		tail -30 "$OUT/bench.log"
		;;
	examples)
		{
			echo "== sleep_wake"
			"$B/examples/sleep_wake"
			echo "== kv_server"
			"$B/examples/kv_server" --csv="$OUT/kv.csv"
			echo "== kv_server --compact-every=50"
			"$B/examples/kv_server" --compact-every=50
			echo "== shrink_on_idle"
			"$B/examples/shrink_on_idle" --csv="$OUT/shrink.csv"
		} >"$OUT/examples.log" 2>&1
		grep -vE "^ +[0-9.]+ (burst|idle)" "$OUT/examples.log" | tail -60
		;;
	torch)
		{
			echo "== stock PyTorch"
			python3 examples/torch/del_model.py
			echo "== python -m cuvmm.torch (CUVMM_RELEASE_DELAY_MS=${CUVMM_RELEASE_DELAY_MS:-1000})"
			CUVMM_LIBRARY="$B/lib/libcuvmm.so" PYTHONPATH=python python3 -m cuvmm.torch examples/torch/del_model.py
		} >"$OUT/torch.log" 2>&1
		cat "$OUT/torch.log"
		;;
	torchbench)
		# shellcheck disable=SC2086
		CUVMM_LIBRARY="$B/lib/libcuvmm.so" PYTHONPATH=python PYTHONUNBUFFERED=1 \
			python3 bench/torch/scenarios.py --out="$OUT/torchbench.json" ${TORCHBENCH:-} \
			>"$OUT/torchbench.log" 2>&1
		cat "$OUT/torchbench.log"
		;;
	esac
done
