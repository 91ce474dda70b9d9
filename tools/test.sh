#!/usr/bin/env bash
# Quick start, 2 of 2: build cuvmm and run its tests. Every suite runs on the host backend; the cuda
# suite runs against the real driver where a GPU is present and reports SKIP where none is.
# Arguments go to `meson test` (e.g. --suite host, or a test name).
set -euo pipefail
cd "$(dirname "$0")/.."
. tools/deps.sh
meson setup build >/dev/null
meson test -C build --print-errorlogs "$@"
