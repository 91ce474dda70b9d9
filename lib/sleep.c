/*
 * Sleep and wake of a region's mapped chunks: the layer under cuvmm_region_sleep/wake and
 * cuvmm_pool_sleep/wake.
 *
 * Sleep records every mapped chunk (first granule, size class), copies their contents to one pinned host
 * buffer (OFFLOAD), unmaps them all and only then releases them, so that a failure anywhere before the
 * release can put the very same chunks back and leave the region awake and intact. Only if the driver
 * refuses that too (an unmap refused, then a map back) does the sleep go forward instead: the contents are
 * in the host copy, and chunks it cannot unmap stay quarantined (see struct cvm_slot) for the wake. Wake maps chunks of
 * the same classes at the same granules, copies the contents back and frees the host copy only once the
 * copy has completed; a failure unmaps what it mapped and leaves the region asleep with its host copy.
 * Copies are issued in pieces of CVM_COPY_PIECE bytes, back to back on one stream, so the copy engine
 * stays busy while the host thread keeps queueing; wake maps the next piece while the last one copies.
 */
#include <stdlib.h>
#include <string.h>

#include "log.h"
#include "region.h"

#define CVM_COPY_PIECE ((size_t)64 << 20)

struct cvm_sleep_chunk {
	size_t g;      /* first granule */
	uint8_t cls;
};

struct cvm_sleep {
	enum cuvmm_sleep_mode mode;
	struct cvm_sleep_chunk *chunks;
	size_t nchunks;
	void *host;        /* OFFLOAD: contents of the chunks, in order */
	size_t host_bytes;
};

static size_t chunk_bytes(const struct cuvmm_region *r, const struct cvm_sleep_chunk *c)
{
	return r->dev->info.granularity << c->cls;
}

/* Copy the chunks to the host buffer, coalescing adjacent chunks into spans and cutting spans
 * into pieces. Stops at the first failure. */
static int copy_out(struct cuvmm_region *r, struct cvm_sleep *s, CUstream stream)
{
	struct cvm_drv *d = CVM_DRV(r->dev);
	size_t off = 0;

	for (size_t i = 0; i < s->nchunks;) {
		size_t g = s->chunks[i].g, bytes = 0;

		/* a span: chunks that follow one another in the address space */
		do {
			bytes += chunk_bytes(r, &s->chunks[i]);
			i++;
		} while (i < s->nchunks && s->chunks[i].g == g + (bytes >> r->gshift));
		for (size_t done = 0; done < bytes;) {
			size_t n = bytes - done < CVM_COPY_PIECE ? bytes - done : CVM_COPY_PIECE;
			uintptr_t dev = r->base + (g << r->gshift) + done;
			char *host = (char *)s->host + off + done;
			int err = cvm_drv_copy_dtoh(d, r->dev->index, host, dev, n, stream);

			if (err) {
				/* Pieces already queued still read or write both sides: let them finish before the
				 * caller unmaps device memory or frees the host copy. */
				cvm_drv_stream_sync(d, r->dev->index, stream);
				return err;
			}
			done += n;
		}
		off += bytes;
	}
	return cvm_drv_stream_sync(d, r->dev->index, stream);
}

/* Map chunks [0, n) of `kept` back at their granules (undo of a partial unmap). Returns true if all went
 * back; each one that did, or that the driver refused (then given back or quarantined by the map), leaves
 * `kept`. */
static bool remap_kept(struct cuvmm_region *r, struct cvm_sleep *s, struct cvm_chunk **kept, size_t n)
{
	bool all = true;

	for (size_t i = 0; i < n; i++) {
		if (cvm_region_chunk_map_locked(r, s->chunks[i].g, kept[i], CVM_SLOT_MAPPED)) {
			cvm_err("sleep: could not map granule %zu back after a failed unmap; sleeping instead",
				s->chunks[i].g);
			all = false;
		}
		kept[i] = NULL;
	}
	return all;
}

int cvm_region_sleep_locked(struct cuvmm_region *r, enum cuvmm_sleep_mode mode, CUstream stream)
{
	struct cvm_drv *d = CVM_DRV(r->dev);
	struct cvm_sleep *s;
	struct cvm_chunk **kept = NULL;
	size_t n = 0;
	int err;

	if (r->sleep)
		return CUVMM_ESTATE;
	/* The copies and the fence must run now, not at a graph's replay. */
	err = cvm_drv_refuse_captured(d, r->dev->index, stream);
	if (err)
		return err;
	s = calloc(1, sizeof(*s));
	if (!s)
		return CUVMM_ENOMEM;
	s->mode = mode;
	for (size_t g = 0; g < r->npages; g += r->slot[g].chunk ? cvm_span(r, r->slot[g].chunk) : 1)
		n += r->slot[g].state == CVM_SLOT_MAPPED;
	s->chunks = calloc(n ? n : 1, sizeof(*s->chunks));
	kept = calloc(n ? n : 1, sizeof(*kept));
	if (!s->chunks || !kept) {
		err = CUVMM_ENOMEM;
		goto fail;
	}
	for (size_t g = 0; g < r->npages;) {
		struct cvm_chunk *c = r->slot[g].chunk;

		if (c && r->slot[g].state == CVM_SLOT_MAPPED) {
			s->chunks[s->nchunks].g = g;
			s->chunks[s->nchunks].cls = c->cls;
			s->nchunks++;
			s->host_bytes += c->size;
		}
		g += c ? cvm_span(r, c) : 1;
	}
	if (!stream) {
		err = cvm_dev_sync(r->dev);
		if (err)
			goto fail;
	}
	if (mode == CUVMM_SLEEP_OFFLOAD && s->host_bytes) {
		/* Pinning is the slow part (seconds for GiBs, where the copy takes milliseconds): reuse the
		 * pinned buffer an earlier wake kept, if it is large enough. */
		if (r->host_keep && r->host_keep_bytes >= s->host_bytes) {
			s->host = r->host_keep;
			r->host_keep = NULL;
			r->host_keep_bytes = 0;
		} else {
			cvm_region_host_drop(r);
			err = cvm_drv_host_alloc(d, s->host_bytes, &s->host);
			if (err)
				goto fail;
		}
		err = copy_out(r, s, stream);
		if (err)
			goto fail;
	} else if (stream) {
		/* DISCARD still waits for the work on the stream before taking the memory away. */
		err = cvm_drv_stream_sync(d, r->dev->index, stream);
		if (err)
			goto fail;
	}
	for (size_t i = 0; i < s->nchunks; i++) {
		if (!cvm_region_chunk_unmap_locked(r, s->chunks[i].g, &kept[i]))
			continue;
		/* Refused: map back what was unmapped, and the region is awake and intact. */
		if (remap_kept(r, s, kept, i)) {
			err = CUVMM_EDRIVER;
			goto fail;
		}
		/* A map back was refused too: those contents are in the host copy alone (or were to be dropped),
		 * so the sleep goes forward instead. Chunks whose unmap is refused stay quarantined at their
		 * granules, counted held, until a pass unmaps them or the wake takes them back. */
		for (size_t k = 0; k < s->nchunks; k++) {
			size_t g = s->chunks[k].g;

			if (kept[k] || r->slot[g].state != CVM_SLOT_MAPPED)
				continue; /* unmapped, in hand or given back */
			if (cvm_region_chunk_unmap_locked(r, g, &kept[k]))
				cvm_region_quarantine_locked(r, g, r->slot[g].chunk);
		}
		break;
	}
	/* Past the point of no return: the physical memory goes back to the driver, not to the cache. */
	size_t slept = 0;
	for (size_t i = 0; i < s->nchunks; i++) {
		if (!kept[i])
			continue;
		slept += kept[i]->size;
		cvm_phys_release(&r->dev->phys, kept[i]);
	}
	cvm_info("sleep (%s): gave %.1f MiB (%zu chunks) back to the driver", mode == CUVMM_SLEEP_OFFLOAD ?
		 "offload" : "discard", slept / 1048576.0, s->nchunks);
	free(kept);
	r->sleep = s;
	return CUVMM_OK;
fail:
	if (s->host)
		cvm_drv_host_free(d, s->host);
	free(kept);
	free(s->chunks);
	free(s);
	return err;
}

/*
 * Wake, pipelined: chunks are mapped in pieces of up to CVM_COPY_PIECE bytes, and each piece's copy is
 * queued as soon as it is mapped, so the driver calls for the next piece overlap the DMA of this one.
 */
int cvm_region_wake_locked(struct cuvmm_region *r, CUstream stream)
{
	struct cvm_sleep *s = r->sleep;
	struct cvm_drv *d = CVM_DRV(r->dev);
	bool copy = s && s->mode == CUVMM_SLEEP_OFFLOAD && s->host_bytes;
	size_t i, off = 0, piece = 0, piece_first = 0;
	int err = CUVMM_OK;

	if (!s)
		return CUVMM_ESTATE;
	err = cvm_drv_refuse_captured(d, r->dev->index, stream);
	if (err)
		return err;
	/* Chunks an earlier wake could not unmap stay quarantined at their granules: unmap them now if the
	 * driver lets us, else take them back below. */
	if (r->npending)
		cvm_region_process_locked(r, cvm_now_ns(), false);
	for (i = 0; i < s->nchunks; i++) {
		size_t g = s->chunks[i].g;
		struct cvm_chunk *c = r->slot[g].chunk;
		bool last, adjacent;

		if (c) {
			/* Quarantined by an earlier wake: the very chunk this record asks for, still mapped. */
			if (c->cls != s->chunks[i].cls || r->slot[g].state != CVM_SLOT_DONE) {
				err = CUVMM_EDRIVER;
				goto undo;
			}
			err = cvm_region_grant_locked(r, g);
			if (err)
				goto undo;
			for (size_t j = 0; j < cvm_span(r, c); j++)
				r->slot[g + j].state = CVM_SLOT_MAPPED;
			r->npending -= cvm_span(r, c);
		} else {
			err = cvm_phys_get(&r->dev->phys, s->chunks[i].cls, &r->cnt, &c);
			if (err)
				goto undo;
			err = cvm_region_chunk_map_locked(r, g, c, CVM_SLOT_MAPPED);
			if (err)
				goto undo; /* c is given back or quarantined */
		}
		if (!copy)
			continue;
		piece += chunk_bytes(r, &s->chunks[i]);
		last = i + 1 == s->nchunks;
		adjacent = !last && s->chunks[i + 1].g == s->chunks[i].g + cvm_span(r, c);
		if (last || !adjacent || piece >= CVM_COPY_PIECE) {
			err = cvm_drv_copy_htod(d, r->dev->index, r->base + (s->chunks[piece_first].g << r->gshift),
						(char *)s->host + off, piece, stream);
			if (err) {
				i++; /* chunk i is mapped too */
				goto undo;
			}
			off += piece;
			piece = 0;
			piece_first = i + 1;
		}
	}
	if (copy) {
		err = cvm_drv_stream_sync(d, r->dev->index, stream);
		if (err)
			goto undo; /* i == nchunks: all of them */
		/* Kept, pinned, for the next sleep; trim and destroy give it back. */
		r->host_keep = s->host;
		r->host_keep_bytes = s->host_bytes;
	}
	free(s->chunks);
	free(s);
	r->sleep = NULL;
	return CUVMM_OK;
undo:
	/* Copies already queued write into what is about to be unmapped: let them finish first. Nothing
	 * written matters: unmap what this call mapped; the host copy stays. */
	if (copy)
		cvm_drv_stream_sync(d, r->dev->index, stream);
	while (i-- > 0) {
		struct cvm_chunk *c = r->slot[s->chunks[i].g].chunk;

		if (cvm_region_chunk_unmap_locked(r, s->chunks[i].g, &c)) {
			/* Kept at its granule, out of the cache: the next wake takes it back (or a pass unmaps it). */
			cvm_region_quarantine_locked(r, s->chunks[i].g, c);
			continue;
		}
		cvm_phys_undo(&r->dev->phys, c);
	}
	return err;
}

void cvm_sleep_coarsen(struct cuvmm_region *r, size_t first, size_t n, unsigned max_cls)
{
	struct cvm_sleep *s = r->sleep;
	size_t lo = 0, hi, g, m = 0, end = first + n;

	if (!s || !n)
		return;
	for (size_t step = s->nchunks; step;) { /* lower bound: first chunk at or after `first` */
		size_t half = step / 2;

		if (s->chunks[lo + half].g < first) {
			lo += half + 1;
			step -= half + 1;
		} else {
			step = half;
		}
	}
	/* The range must be exactly the chunks from lo on, back to back. */
	for (hi = lo, g = first; hi < s->nchunks && s->chunks[hi].g < end; hi++) {
		if (s->chunks[hi].g != g)
			return;
		g += (size_t)1 << (s->chunks[hi].cls - r->cls0);
	}
	if (g != end)
		return;
	/* Largest aligned chunks that fit, from the start (as cvm_region_map_locked lays them out). */
	for (g = first; g < end; m++)
		g += (size_t)1 << cvm_fit_cls(r, g, end, max_cls);
	if (m >= hi - lo)
		return; /* no fewer handles */
	for (g = first, m = lo; g < end; m++) {
		unsigned c = cvm_fit_cls(r, g, end, max_cls);

		s->chunks[m].g = g;
		s->chunks[m].cls = (uint8_t)(r->cls0 + c);
		g += (size_t)1 << c;
	}
	memmove(&s->chunks[m], &s->chunks[hi], (s->nchunks - hi) * sizeof(*s->chunks));
	s->nchunks -= hi - m;
}

void cvm_region_host_drop(struct cuvmm_region *r)
{
	if (r->host_keep)
		cvm_drv_host_free(CVM_DRV(r->dev), r->host_keep);
	r->host_keep = NULL;
	r->host_keep_bytes = 0;
}

void cvm_sleep_discard(struct cuvmm_region *r)
{
	struct cvm_sleep *s = r->sleep;

	if (!s)
		return;
	if (s->host)
		cvm_drv_host_free(CVM_DRV(r->dev), s->host);
	free(s->chunks);
	free(s);
	r->sleep = NULL;
}

static int check_mode(enum cuvmm_sleep_mode mode)
{
	return mode == CUVMM_SLEEP_OFFLOAD || mode == CUVMM_SLEEP_DISCARD ? CUVMM_OK : CUVMM_EINVAL;
}

int cuvmm_region_sleep(struct cuvmm_region *r, enum cuvmm_sleep_mode mode, CUstream stream)
{
	int err;

	if (!r || check_mode(mode))
		return CUVMM_EINVAL;
	pthread_mutex_lock(&r->lock);
	if (r->sleep) {
		err = CUVMM_ESTATE;
	} else {
		/* Pending unmaps are not contents: finish them (waiting for their fences) before sleeping. */
		if (r->npending)
			cvm_region_process_locked(r, cvm_now_ns(), true);
		/* Still pending: an unmap the driver refused (retried later); sleeping now would leave it mapped. */
		err = r->npending ? CUVMM_EDRIVER : cvm_region_sleep_locked(r, mode, stream);
	}
	pthread_mutex_unlock(&r->lock);
	/* Chunks of finished unmaps went to the device's cache: give those back too. */
	if (!err)
		cvm_phys_reclaim(&r->dev->phys, cvm_now_ns(), true, r->ctx->cfg.retain_bytes);
	return err;
}

int cuvmm_region_wake(struct cuvmm_region *r, CUstream stream)
{
	int err;

	if (!r)
		return CUVMM_EINVAL;
	pthread_mutex_lock(&r->lock);
	err = cvm_region_wake_locked(r, stream);
	pthread_mutex_unlock(&r->lock);
	return err;
}
