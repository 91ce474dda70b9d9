#!/usr/bin/env bash
# Quick start, 1 of 2: build cuvmm and run the shrink-on-idle demo, on the GPU when there is one, else on
# the host backend (it says which). Arguments go to the demo (try --help).
set -euo pipefail
cd "$(dirname "$0")/.."
. tools/deps.sh
meson setup build >/dev/null
meson compile -C build >/dev/null
exec build/examples/shrink_on_idle "$@"
