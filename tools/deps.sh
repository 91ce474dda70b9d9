#!/usr/bin/env bash
# Install what building and testing cuvmm needs, if it is missing (Debian/Ubuntu). Sourced by demo.sh and
# test.sh; safe to run again. The CUDA toolkit headers (cuda.h) must already be there: $CUDA_HOME
# or /usr/local/cuda; no GPU and no CUDA driver are needed to build or to run the host backend.
set -euo pipefail

need=()
command -v meson >/dev/null 2>&1 || need+=(meson)
command -v ninja >/dev/null 2>&1 || need+=(ninja-build)
command -v pkg-config >/dev/null 2>&1 || need+=(pkg-config)
command -v cc >/dev/null 2>&1 || need+=(gcc)
pkg-config --exists check 2>/dev/null || need+=(check libsubunit-dev)
if [ "${CUVMM_WANT_DOCS:-0}" = 1 ]; then
	command -v doxygen >/dev/null 2>&1 || need+=(doxygen)
fi
if [ ${#need[@]} -gt 0 ]; then
	echo "cuvmm: installing ${need[*]}" >&2
	sudo=
	[ "$(id -u)" -eq 0 ] || sudo=sudo
	export DEBIAN_FRONTEND=noninteractive
	$sudo apt-get update -qq
	$sudo apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
fi
# The same search as meson.build: $CUDA_HOME first, then /usr/local/cuda, then the system's.
if [ ! -f "${CUDA_HOME:-/nonexistent}/include/cuda.h" ] && [ ! -f /usr/local/cuda/include/cuda.h ] &&
	[ ! -f /usr/include/cuda.h ]; then
	echo "cuvmm: cuda.h not found: install the CUDA toolkit headers (or set CUDA_HOME)" >&2
	exit 1
fi
