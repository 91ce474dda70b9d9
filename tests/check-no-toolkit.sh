#!/bin/sh
# Usage: check-no-toolkit.sh BUILDDIR SOURCE_ROOT
# A consumer on a machine without the CUDA toolkit headers: installs BUILDDIR into a scratch DESTDIR, then,
# in a private mount namespace where /usr/local/cuda, $CUDA_HOME and /usr/include/cuda.h are hidden (an
# empty tmpfs or /dev/null mounted over them), proves cuda.h cannot be found and builds tests/outside.c with
#     ${CC:-cc} -std=c99 -pedantic -Wall -Wextra -Werror $(pkg-config --cflags --libs cuvmm)
# and runs it on the host backend. Needs root or unprivileged user namespaces (unshare); CI runs it.
set -eu

builddir=$(cd "$1" && pwd)
srcroot=$(cd "$2" && pwd)

if [ "${CUVMM_IN_NS:-}" != 1 ]; then
	tmp=$(mktemp -d "${TMPDIR:-/tmp}/cuvmm-notk.XXXXXX")
	trap 'rm -rf "$tmp"' EXIT INT TERM
	${MESON:-meson} install -C "$builddir" --destdir "$tmp/root" --no-rebuild > "$tmp/install.log" 2>&1 || {
		cat "$tmp/install.log" >&2
		echo "FAIL: meson install" >&2
		exit 1
	}
	userns=
	[ "$(id -u)" -eq 0 ] || userns=--map-root-user
	# shellcheck disable=SC2086
	CUVMM_IN_NS=1 CUVMM_NOTK_TMP=$tmp unshare --mount $userns sh "$0" "$builddir" "$srcroot"
	exit $?
fi

# In the namespace: mounts made here vanish with it.
tmp=$CUVMM_NOTK_TMP
mount --make-rprivate / 2>/dev/null || true
for d in /usr/local/cuda /usr/local/cuda/include "${CUDA_HOME:-}" "${CUDA_HOME:+$CUDA_HOME/include}"; do
	[ -n "$d" ] && [ -d "$d" ] && mount -t tmpfs none "$d"
done
[ -e /usr/include/cuda.h ] && mount --bind /dev/null /usr/include/cuda.h
unset CPATH C_INCLUDE_PATH CPLUS_INCLUDE_PATH
cc_cmd=${CC:-cc}
if echo '#include <cuda.h>' | $cc_cmd -E -x c - > /dev/null 2>&1; then
	echo "FAIL: cuda.h is still reachable; nothing was proven" >&2
	exit 1
fi
echo "cuda.h hidden: '#include <cuda.h>' does not compile"

pc=$(find "$tmp/root" -name cuvmm.pc | head -n 1)
pcdir=$(dirname "$pc")
prefix=$(PKG_CONFIG_PATH=$pcdir pkg-config --variable=prefix cuvmm)
flags=$(env -u PKG_CONFIG_SYSROOT_DIR PKG_CONFIG_PATH="$pcdir" PKG_CONFIG_LIBDIR="$pcdir" \
	pkg-config --define-variable=prefix="$tmp/root$prefix" --cflags --libs cuvmm)
libdir=$(env PKG_CONFIG_PATH="$pcdir" PKG_CONFIG_LIBDIR="$pcdir" \
	pkg-config --define-variable=prefix="$tmp/root$prefix" --variable=libdir cuvmm)
echo "$cc_cmd -std=c99 -pedantic -Wall -Wextra -Werror outside.c $flags"
# shellcheck disable=SC2086
$cc_cmd -std=c99 -pedantic -Wall -Wextra -Werror -o "$tmp/outside" "$srcroot/tests/outside.c" $flags
LD_LIBRARY_PATH=$libdir CUVMM_BACKEND=host "$tmp/outside" > "$tmp/run.log" 2>&1 || {
	cat "$tmp/run.log" >&2
	echo "FAIL: the consumer built without the toolkit does not run" >&2
	exit 1
}
echo "PASS: consumer built and ran without the CUDA toolkit headers"
