/*
 * Command-line conventions shared by the examples and the benchmarks; nothing here is part of cuvmm.
 *
 *  - --help prints the program's help (every option described) to stdout and exits 0.
 *  - A bad value is named in the error (option and value, and what is accepted) on stderr, followed by
 *    "Try 'PROG --help'.", and the program exits 2. Nothing is silently corrected or clamped.
 *  - An unknown option or a stray argument exits 2 the same way.
 *
 * Header-only (static functions), so a program built out of tree needs only this file.
 */
#ifndef CUVMM_CLI_H
#define CUVMM_CLI_H

#include <errno.h>
#include <math.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#if defined(__GNUC__)
#define CLI_UNUSED_ __attribute__((unused))
#define CLI_NORETURN_ __attribute__((noreturn))
#define CLI_PRINTF_(a, b) __attribute__((format(printf, a, b)))
#else
#define CLI_UNUSED_
#define CLI_NORETURN_
#define CLI_PRINTF_(a, b)
#endif

/* The exit status of a usage error (as with GNU tools and getopt-based programs). */
#define CLI_EXIT_USAGE 2

static const char *cli_prog_ = "program";

/* Remember the program's name for messages (the last part of argv[0]). */
static CLI_UNUSED_ void cli_init(const char *argv0)
{
	const char *slash = argv0 ? strrchr(argv0, '/') : NULL;

	cli_prog_ = slash ? slash + 1 : argv0 ? argv0 : "program";
}

/* --help: the text to stdout, exit 0. */
static CLI_UNUSED_ CLI_NORETURN_ void cli_help(const char *text)
{
	fputs(text, stdout);
	exit(0);
}

/* A usage error: "PROG: <message>" and a pointer to --help on stderr, exit 2. */
static CLI_UNUSED_ CLI_NORETURN_ CLI_PRINTF_(1, 2) void cli_fail(const char *fmt, ...)
{
	va_list ap;

	fprintf(stderr, "%s: ", cli_prog_);
	va_start(ap, fmt);
	vfprintf(stderr, fmt, ap);
	va_end(ap);
	fprintf(stderr, "\nTry '%s --help'.\n", cli_prog_);
	exit(CLI_EXIT_USAGE);
}

/* getopt_long returned '?' (it has printed what was wrong) or a stray argument is left. */
static CLI_UNUSED_ CLI_NORETURN_ void cli_bad_usage(void)
{
	fprintf(stderr, "Try '%s --help'.\n", cli_prog_);
	exit(CLI_EXIT_USAGE);
}

/* No arguments may follow the options. */
static CLI_UNUSED_ void cli_no_operands(int argc, char **argv, int optind_)
{
	if (optind_ < argc)
		cli_fail("unexpected argument '%s'", argv[optind_]);
}

/* An integer in [min, max]; anything else (junk, blanks, out of range) is a usage error naming --name. */
static CLI_UNUSED_ long long cli_int(const char *name, const char *s, long long min, long long max)
{
	char *end;
	long long v;

	errno = 0;
	v = strtoll(s, &end, 10);
	if (!*s || *s == ' ' || *s == '\t' || errno || *end)
		cli_fail("--%s=%s: not an integer", name, s);
	if (v < min || v > max)
		cli_fail("--%s=%s: must be between %lld and %lld", name, s, min, max);
	return v;
}

/* A finite number in [min, max]. */
static CLI_UNUSED_ double cli_double(const char *name, const char *s, double min, double max)
{
	char *end;
	double v;

	errno = 0;
	v = strtod(s, &end);
	if (!*s || *s == ' ' || *s == '\t' || errno || *end || !isfinite(v))
		cli_fail("--%s=%s: not a number", name, s);
	if (v < min || v > max)
		cli_fail("--%s=%s: must be between %g and %g", name, s, min, max);
	return v;
}

/* The index of s in the NULL-terminated list `choices` (at least one); anything else is a usage error that
 * names them. CLI_BACKENDS: the --backend option of every program, index 1 being the host backend. */
#define CLI_BACKENDS ((const char *const[]){"cuda", "host", NULL})
static CLI_UNUSED_ int cli_choice(const char *name, const char *s, const char *const *choices)
{
	char list[256] = "";
	size_t n = 0;
	int i;

	for (i = 0; choices[i]; i++)
		if (strcmp(s, choices[i]) == 0)
			return i;
	for (int j = 0; j < i && n < sizeof(list); j++)
		n += (size_t)snprintf(list + n, sizeof(list) - n, "%s%s", j == 0 ? "" : j == i - 1 ? " or " : ", ",
				      choices[j]);
	cli_fail("--%s=%s: must be %s", name, s, list);
}

/* A size in bytes: digits with an optional K, M, G or T suffix (binary; KiB and KB also read), in
 * [min, max]. */
static CLI_UNUSED_ uint64_t cli_size(const char *name, const char *s, uint64_t min, uint64_t max)
{
	char *end;
	unsigned long long v;
	unsigned shift = 0;

	errno = 0;
	if (*s < '0' || *s > '9')
		cli_fail("--%s=%s: not a size (digits with an optional K, M, G or T suffix)", name, s);
	v = strtoull(s, &end, 10);
	switch (*end | 0x20) {
	case 'k': shift = 10; end++; break;
	case 'm': shift = 20; end++; break;
	case 'g': shift = 30; end++; break;
	case 't': shift = 40; end++; break;
	default: break;
	}
	if (shift && (*end | 0x20) == 'i')
		end++;
	if (shift && (*end | 0x20) == 'b')
		end++;
	if (errno || *end || (shift && v > (UINT64_MAX >> shift)))
		cli_fail("--%s=%s: not a size (digits with an optional K, M, G or T suffix)", name, s);
	v <<= shift;
	if (v < min || v > max)
		cli_fail("--%s=%s: must be between %llu and %llu bytes", name, s, (unsigned long long)min,
			 (unsigned long long)max);
	return v;
}

#endif /* CUVMM_CLI_H */
