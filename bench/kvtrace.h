/*
 * The KV-cache serving trace's random numbers, shared by bench/trace.c and examples/kv_server.c so that
 * both replay exactly the same requests: splitmix64 seeding xoshiro256**, Box-Muller in polar form, and
 * elementary functions of our own, so the trace is bit-identical on every machine with IEEE doubles,
 * whatever its libm (and the benchmark needs none).
 */
#ifndef CUVMM_KVTRACE_H
#define CUVMM_KVTRACE_H

#include <stdbool.h>
#include <stdint.h>

/* ----- PRNG: splitmix64 seeds xoshiro256**; Box-Muller for normals ----- */

static inline uint64_t splitmix64(uint64_t *x)
{
	uint64_t z = (*x += 0x9e3779b97f4a7c15ull);

	z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
	z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
	return z ^ (z >> 31);
}

struct rng {
	uint64_t s[4];
	bool have_spare;
	double spare;
};

static inline uint64_t rotl(uint64_t x, int k)
{
	return (x << k) | (x >> (64 - k));
}

static inline uint64_t rng_next(struct rng *r)
{
	uint64_t *s = r->s, result = rotl(s[1] * 5, 7) * 9, t = s[1] << 17;

	s[2] ^= s[0];
	s[3] ^= s[1];
	s[1] ^= s[2];
	s[0] ^= s[3];
	s[2] ^= t;
	s[3] = rotl(s[3], 45);
	return result;
}

static inline void rng_seed(struct rng *r, uint64_t seed)
{
	uint64_t x = seed;

	for (int i = 0; i < 4; i++)
		r->s[i] = splitmix64(&x);
	r->have_spare = false;
}

/*
 * Elementary functions of our own: the benchmark links no libm (the bench build gives it only cuvmm and
 * libcudart), and the trace comes out bit-identical on every machine with IEEE doubles, whatever its libm.
 * Accurate to a few ulps over the ranges used here, which is far more than a token count needs.
 */
#define LN2_HI 6.93147180369123816490e-01
#define LN2_LO 1.90821492927058770002e-10

static inline double my_log(double x) /* x > 0, finite */
{
	union { double d; uint64_t u; } v = {.d = x};
	int e = (int)((v.u >> 52) & 0x7ff) - 1023;
	double m, f, f2, term, sum;

	if (e == -1023) { /* subnormal: scale up first */
		v.d = x * 18014398509481984.0; /* 2^54 */
		e = (int)((v.u >> 52) & 0x7ff) - 1023 - 54;
	}
	v.u = (v.u & 0x000fffffffffffffull) | 0x3ff0000000000000ull; /* mantissa in [1, 2) */
	m = v.d;
	if (m > 1.4142135623730951) {
		m *= 0.5;
		e++;
	}
	/* ln m = 2 atanh(f), f = (m - 1) / (m + 1), |f| <= 0.172 */
	f = (m - 1.0) / (m + 1.0);
	f2 = f * f;
	term = f;
	sum = 0;
	for (int k = 1; k <= 41; k += 2) {
		sum += term / k;
		term *= f2;
	}
	return (double)e * LN2_LO + 2.0 * sum + (double)e * LN2_HI;
}

static inline double my_exp(double x)
{
	union { double d; uint64_t u; } scale;
	double r, sum = 1.0, term = 1.0;
	long k;

	if (x > 700.0)
		return 1e300;
	if (x < -700.0)
		return 0.0;
	k = (long)(x / (LN2_HI + LN2_LO) + (x >= 0 ? 0.5 : -0.5));
	r = (x - (double)k * LN2_HI) - (double)k * LN2_LO; /* |r| <= 0.35 */
	for (int i = 1; i <= 20; i++) {
		term *= r / i;
		sum += term;
	}
	scale.u = (uint64_t)(k + 1023) << 52;
	return sum * scale.d;
}

static inline double my_sqrt(double x) /* x >= 0 */
{
	union { double d; uint64_t u; } v = {.d = x};
	double y;

	if (x <= 0)
		return 0;
	v.u = (v.u >> 1) + (0x3ff0000000000000ull >> 1); /* halve the exponent: a first guess */
	y = v.d;
	for (int i = 0; i < 8; i++)
		y = 0.5 * (y + x / y);
	return y;
}

/* Nearest integer, halves away from zero; x >= 0. */
static inline uint64_t my_round(double x)
{
	return (uint64_t)(x + 0.5);
}

/* Uniform in (-1, 1): 53 random bits. */
static inline double rng_uniform(struct rng *r)
{
	return ((double)(rng_next(r) >> 11) + 0.5) * (2.0 / 9007199254740992.0) - 1.0;
}

/* Standard normal: Box-Muller in Marsaglia's polar form (no trigonometry), two values per draw. */
static inline double rng_normal(struct rng *r)
{
	double u, v, s, mul;

	if (r->have_spare) {
		r->have_spare = false;
		return r->spare;
	}
	do {
		u = rng_uniform(r);
		v = rng_uniform(r);
		s = u * u + v * v;
	} while (s >= 1.0 || s == 0.0);
	mul = my_sqrt(-2.0 * my_log(s) / s);
	r->spare = v * mul;
	r->have_spare = true;
	return u * mul;
}

/* round(clip(exp(N(mu, sigma)), lo, hi)) tokens, times scale, rounded (at least one token). */
static inline uint64_t draw_tokens(struct rng *r, double mu, double sigma, uint32_t lo, uint32_t hi, double scale)
{
	double v = my_exp(mu + sigma * rng_normal(r));
	uint64_t n;

	if (v < lo)
		v = lo;
	if (v > hi)
		v = hi;
	n = my_round(v);
	n = my_round((double)n * scale);
	return n < 1 ? 1 : n;
}

#endif /* CUVMM_KVTRACE_H */
