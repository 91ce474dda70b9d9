/*
 * A max segment tree over the granules of a pool: each leaf holds the length of the run that starts at that
 * granule (0 where none is indexed), each inner node the largest leaf below it. It answers "the first run
 * at or after granule `from` that is at least `min` granules long" in O(log n), which is what next-fit
 * placement (pool.c) needs and what size bins cannot give.
 */
#ifndef CVM_SEG_H
#define CVM_SEG_H

#include <stddef.h>
#include <stdint.h>

#define CVM_SEG_NONE SIZE_MAX

struct cvm_seg {
	size_t n;    /* leaves: a power of two >= the granules covered */
	uint32_t *t; /* 2n nodes; t[1] is the root, t[n + i] leaf i */
};

/* Cover `count` granules (count < 2^32), all leaves 0. CUVMM_ENOMEM or CUVMM_EINVAL on failure. */
int cvm_seg_init(struct cvm_seg *s, size_t count);
void cvm_seg_fini(struct cvm_seg *s);
void cvm_seg_set(struct cvm_seg *s, size_t i, uint32_t v);
/* The lowest i >= from whose leaf is >= min (min >= 1), or CVM_SEG_NONE. */
size_t cvm_seg_first(const struct cvm_seg *s, size_t from, uint32_t min);

#endif /* CVM_SEG_H */
