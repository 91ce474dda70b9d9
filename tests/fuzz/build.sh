#!/usr/bin/env bash
# Build the libFuzzer harness: tests/fuzz/build.sh OUTDIR. clang 14 with libclang-rt-14-dev; the library's
# sources are compiled in with the harness, instrumented (ASan + UBSan + coverage), without meson, so the
# harness needs nothing from the build files. Needs cuda.h (CUDA_HOME or /usr/local/cuda) as the library does.
set -euo pipefail

out=${1:?usage: build.sh OUTDIR}
root=$(cd "$(dirname "$0")/../.." && pwd)
cuda_inc=${CUDA_HOME:-/usr/local/cuda}/include
mkdir -p "$out"
${CC:-clang} -g -O1 -std=c11 -D_GNU_SOURCE -fno-omit-frame-pointer \
	-fsanitize=fuzzer,address,undefined -fno-sanitize-recover=undefined \
	-I"$root/include" -I"$root/lib" -isystem "$cuda_inc" \
	"$root"/lib/*.c "$root/tests/fuzz/fuzz_ops.c" \
	-o "$out/fuzz_ops" -ldl -lpthread
echo "$out/fuzz_ops"
