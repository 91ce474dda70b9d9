#!/bin/sh
# Usage: help2man.sh PROGRAM NAME VERSION > NAME.1
# A man page (section 1) from PROGRAM --help, for the examples and benchmarks, which all print their help
# in one shape (examples/cli.h): "Usage: NAME [OPTION]...", a description up to the first blank line, then
# the options and notes. Needs only sh and sed.
set -eu
prog=$1
name=$2
version=$3
help=$("$prog" --help)

# troff: a backslash is written \e; a line may not start with . or '.
esc() { sed -e 's/\\/\\e/g' -e "s/^\\([.']\\)/\\\\\\&\\1/"; }

synopsis=$(printf '%s\n' "$help" | sed -n '1s/^Usage: *[^ ]* *//p')
# The NAME line: the description paragraph (line 2 up to the first blank line), its first sentence.
summary=$(printf '%s\n' "$help" | sed -n '2,/^$/p' | tr '\n' ' ' | sed -e 's/\. .*//' -e 's/[ .:]*$//')
printf '.TH %s 1 "" "cuvmm %s" "cuvmm examples and benchmarks"\n' "$(printf '%s' "$name" | tr 'a-z' 'A-Z')" "$version"
printf '.SH NAME\n%s \\- %s\n' "$name" "$(printf '%s' "$summary" | esc)"
printf '.SH SYNOPSIS\n.B %s\n%s\n' "$name" "$(printf '%s' "$synopsis" | esc)"
printf '.SH DESCRIPTION\n.nf\n'
printf '%s\n' "$help" | sed '1d' | esc
printf '.fi\n.SH SEE ALSO\nThe cuvmm API documentation (share/doc/cuvmm/html/index.html) and README.md.\n'
