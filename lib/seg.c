/* Max segment tree for first-fit searches from a position: see seg.h. */
#include <stdlib.h>

#include "cuvmm.h"
#include "seg.h"

int cvm_seg_init(struct cvm_seg *s, size_t count)
{
	size_t n = 1;

	if (count == 0 || count > UINT32_MAX)
		return CUVMM_EINVAL;
	while (n < count)
		n <<= 1;
	s->t = calloc(2 * n, sizeof(*s->t));
	if (!s->t)
		return CUVMM_ENOMEM;
	s->n = n;
	return CUVMM_OK;
}

void cvm_seg_fini(struct cvm_seg *s)
{
	free(s->t);
	s->t = NULL;
	s->n = 0;
}

void cvm_seg_set(struct cvm_seg *s, size_t i, uint32_t v)
{
	i += s->n;
	s->t[i] = v;
	for (i >>= 1; i; i >>= 1) {
		uint32_t m = s->t[2 * i] > s->t[2 * i + 1] ? s->t[2 * i] : s->t[2 * i + 1];

		if (s->t[i] == m)
			break; /* nothing above changes either */
		s->t[i] = m;
	}
}

size_t cvm_seg_first(const struct cvm_seg *s, size_t from, uint32_t min)
{
	size_t i;

	if (from >= s->n || s->t[1] < min)
		return CVM_SEG_NONE;
	/* Climb from the leaf until a subtree that starts after `from` (or the leaf itself) holds a match... */
	for (i = from + s->n; s->t[i] < min; i++) {
		while (i & 1)
			i >>= 1; /* a right child: its parent's right neighbour is next */
		if (i == 0)
			return CVM_SEG_NONE; /* climbed past the root: nothing after `from` */
	}
	/* ...then descend to its leftmost matching leaf. */
	while (i < s->n)
		i = s->t[2 * i] >= min ? 2 * i : 2 * i + 1;
	return i - s->n;
}
