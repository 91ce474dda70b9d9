#!/bin/sh
# Usage: check-cuda-home.sh SOURCE_ROOT
# $CUDA_HOME is honoured before /usr/local/cuda: configures SOURCE_ROOT with CUDA_HOME pointing at a copy
# of the toolkit's include directory and checks that meson picked that copy. Needs cuda.h somewhere to
# copy (CUDA_SRC_INCLUDE, default /usr/local/cuda/include). CI runs it.
set -eu

srcroot=$(cd "$1" && pwd)
from=${CUDA_SRC_INCLUDE:-/usr/local/cuda/include}
tmp=$(mktemp -d "${TMPDIR:-/tmp}/cuvmm-cudahome.XXXXXX")
trap 'rm -rf "$tmp"' EXIT INT TERM

mkdir -p "$tmp/cuda/include"
cp "$from"/cuda.h "$tmp/cuda/include/"
CUDA_HOME=$tmp/cuda ${MESON:-meson} setup "$tmp/build" "$srcroot" -Dtests=disabled -Ddocs=disabled \
	-Dexamples=disabled -Dbench=disabled > "$tmp/setup.log" 2>&1 || {
	cat "$tmp/setup.log" >&2
	echo "FAIL: meson setup with CUDA_HOME=$tmp/cuda" >&2
	exit 1
}
if ! grep -Eq "CUDA headers *: $tmp/cuda/include\$" "$tmp/setup.log"; then
	grep "CUDA headers" "$tmp/setup.log" >&2 || true
	echo "FAIL: meson did not take cuda.h from \$CUDA_HOME/include" >&2
	exit 1
fi
echo "PASS: CUDA_HOME=$tmp/cuda chosen over /usr/local/cuda"
