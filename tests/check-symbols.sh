#!/bin/sh
# Usage: check-symbols.sh LIBCUVMM_SO [CUVMM_H]
# Fails when libcuvmm.so exports a symbol without the cuvmm_ prefix, when a function the header declares
# with CUVMM_API is not exported, or when the library links libcuda (the driver is loaded at run time).
set -eu

lib=$1
header=${2:-}
status=0

# Defined dynamic symbols, without version suffixes (cuvmm_foo@@CUVMM_0) and without the version node
# itself (type A).
exported=$(nm -D --defined-only "$lib" | awk '$2 != "A" { sub(/@.*/, "", $3); print $3 }' | sort -u)

if [ -z "$exported" ]; then
	echo "FAIL: $lib exports no symbols" >&2
	exit 1
fi

leaked=$(printf '%s\n' "$exported" | grep -v '^cuvmm_' || true)
if [ -n "$leaked" ]; then
	echo "FAIL: symbols exported without the cuvmm_ prefix:" >&2
	printf '  %s\n' $leaked >&2
	status=1
fi

if [ -n "$header" ]; then
	# Every "CUVMM_API <type> <name>(" in the header, the name taken as the word before the parenthesis.
	declared=$(sed -n 's/^CUVMM_API[^(]*[^A-Za-z0-9_(]\([A-Za-z_][A-Za-z0-9_]*\)(.*/\1/p' "$header" | sort -u)
	if [ -z "$declared" ]; then
		echo "FAIL: no CUVMM_API declarations found in $header" >&2
		status=1
	fi
	missing=$(printf '%s\n' "$declared" | while read -r f; do
		printf '%s\n' "$exported" | grep -qx "$f" || echo "$f"
	done)
	if [ -n "$missing" ]; then
		echo "FAIL: declared in $(basename "$header") but not exported:" >&2
		printf '  %s\n' $missing >&2
		status=1
	fi
fi

if readelf -d "$lib" | grep 'NEEDED' | grep -q 'libcuda\.'; then
	echo "FAIL: $lib links libcuda; the driver must be loaded at run time" >&2
	status=1
fi

if [ "$status" -eq 0 ]; then
	echo "ok: $(printf '%s\n' "$exported" | wc -l) symbols exported, all cuvmm_*, no libcuda"
fi
exit "$status"
