#!/bin/sh
# Usage: check-hygiene.sh SOURCE_ROOT   (a git checkout)
# No compiled Python is tracked; no tracked file points at the project's notes outside the repository
# (../shared: what is needed from there is copied under doc/); CHANGELOG.md has a section for the version
# in meson.build. CI runs it.
set -eu
cd "$1"
fail=0

if git ls-files | grep -E '(^|/)__pycache__/|\.py[co]$'; then
	echo "FAIL: compiled Python is tracked (above)" >&2
	fail=1
fi
# Paths into the shared notes, however they are spelled; this script names them only in the pattern.
if git ls-files -z | xargs -0 grep -nE '(\.\./)+shared/|(^|[^a-z])shared/(facts|GPU\.md|API\.md|STYLE\.md|hooks)' \
	-- 2>/dev/null | grep -v '^tests/check-hygiene.sh:'; then
	echo "FAIL: tracked files point outside the repository (above)" >&2
	fail=1
fi
version=$(sed -n "s/^ *version: *'\([0-9.]*\)'.*/\1/p" meson.build | head -n 1)
if ! grep -q "^## \[$version\]" CHANGELOG.md 2>/dev/null; then
	echo "FAIL: CHANGELOG.md has no '## [$version]' section" >&2
	fail=1
fi
[ $fail -eq 0 ] && echo "PASS: hygiene (version $version)"
exit $fail
