#!/bin/sh
# Usage: check-install.sh BUILDDIR OUTSIDE_C [SOURCE_ROOT [CUDA_INCLUDE_DIR]]
# Installs BUILDDIR into a scratch DESTDIR, builds OUTSIDE_C with nothing but what
# `pkg-config --cflags --libs cuvmm` says about the installed files (as strict C99 and as C11; the .pc
# must name no CUDA path and the compiler must read no cuda.h), and runs it on the host backend.
# With SOURCE_ROOT, also builds every example out of tree the same way, as a user would (the examples
# call the driver themselves, so they add the CUDA include directory, CUDA_INCLUDE_DIR, like any CUDA
# program), and runs region_grow_shrink on the host backend.
set -eu

builddir=$1
src=$2
srcroot=${3:-}
cudainc=${4:-}
cc_cmd=${CC:-cc}

tmp=$(mktemp -d "${TMPDIR:-/tmp}/cuvmm-install.XXXXXX")
trap 'rm -rf "$tmp"' EXIT INT TERM
dest=$tmp/root

${MESON:-meson} install -C "$builddir" --destdir "$dest" --no-rebuild > "$tmp/install.log" 2>&1 || {
	cat "$tmp/install.log" >&2
	echo "FAIL: meson install" >&2
	exit 1
}

pc=$(find "$dest" -name cuvmm.pc | head -n 1)
if [ -z "$pc" ]; then
	echo "FAIL: no cuvmm.pc installed" >&2
	exit 1
fi
pcdir=$(dirname "$pc")

# With the docs built, they are installed: the HTML, the Markdown documents and the man pages.
if [ -f "$builddir/doc/html/index.html" ]; then
	docdir=$(find "$dest" -type d -path '*/share/doc/cuvmm' | head -n 1)
	for f in html/index.html html/guide_pool.html html/conventions.html README.md CHANGELOG.md design.md; do
		if [ -z "$docdir" ] || [ ! -f "$docdir/$f" ]; then
			echo "FAIL: share/doc/cuvmm/$f not installed" >&2
			exit 1
		fi
	done
	if [ -d "$builddir/examples" ] && [ ! -f "$docdir/man/man1/kv_server.1" ]; then
		echo "FAIL: the man pages are not installed under share/doc/cuvmm/man" >&2
		exit 1
	fi
	echo "docs installed under ${docdir#"$dest"}"
fi

# Relocate the .pc with --define-variable rather than PKG_CONFIG_SYSROOT_DIR, which would also rewrite
# any path of the build machine the .pc wrongly named instead of letting the check below see it.
prefix=$(PKG_CONFIG_PATH=$pcdir pkg-config --variable=prefix cuvmm)
pkgconf() {
	env -u PKG_CONFIG_SYSROOT_DIR PKG_CONFIG_PATH="$pcdir" PKG_CONFIG_LIBDIR="$pcdir" \
		pkg-config --define-variable=prefix="$dest$prefix" "$@"
}
flags=$(pkgconf --cflags --libs cuvmm)
libdir=$(pkgconf --variable=libdir cuvmm)
echo "pkg-config --cflags --libs cuvmm: $flags"

# Only what pkg-config says: no inherited search paths.
unset CPATH C_INCLUDE_PATH LIBRARY_PATH 2>/dev/null || true
case " $flags " in
*cuda*)
	echo "FAIL: pkg-config names a CUDA path; <cuvmm.h> needs none" >&2
	exit 1
	;;
esac

# shellcheck disable=SC2086
$cc_cmd -std=c99 -pedantic -Wall -Wextra -Werror -H -o "$tmp/outside" "$src" $flags 2> "$tmp/headers.log" || {
	cat "$tmp/headers.log" >&2
	echo "FAIL: the consumer does not build as -std=c99 -pedantic -Werror with pkg-config's flags" >&2
	exit 1
}
if grep -E '(^|/)cuda(_runtime_api)?\.h$' "$tmp/headers.log" >&2; then
	echo "FAIL: building the consumer read a CUDA header" >&2
	exit 1
fi
echo "built outside.c as C99 -pedantic -Werror without any CUDA header"
# shellcheck disable=SC2086
$cc_cmd -std=c11 -Wall -Wextra -Werror -o "$tmp/outside" "$src" $flags

if readelf -d "$tmp/outside" | grep 'NEEDED' | grep -q 'libcuda\.'; then
	echo "FAIL: the outside program links libcuda" >&2
	exit 1
fi

LD_LIBRARY_PATH=$libdir CUVMM_BACKEND=host "$tmp/outside"

if [ -n "$srcroot" ]; then
	cuda_flag=
	[ -z "$cudainc" ] || cuda_flag=-I$cudainc
	for ex in region_grow_shrink shrink_on_idle sleep_wake kv_server; do
		# shellcheck disable=SC2086
		$cc_cmd -std=gnu11 -Wall -Wextra -Werror -I"$srcroot/bench" $cuda_flag -o "$tmp/$ex" \
			"$srcroot/examples/$ex.c" "$srcroot/examples/example_util.c" $flags -ldl -lm -lpthread
		echo "built examples/$ex.c out of tree with pkg-config"
	done
	LD_LIBRARY_PATH=$libdir CUVMM_BACKEND=host "$tmp/region_grow_shrink" > "$tmp/ex.log" 2>&1 || {
		cat "$tmp/ex.log" >&2
		echo "FAIL: region_grow_shrink built out of tree" >&2
		exit 1
	}
	echo "ran region_grow_shrink built out of tree"
fi
