#!/usr/bin/env python3
"""
A granule-level model of pool placement on the KV trace, for choosing a policy before building it.

It replays a trace shaped like bench/trace's (same distributions and step structure, Python's random
numbers, so not the same requests) against a heap of 2 MiB granules with FREE/USED/VA runs, and reports for
each placement policy the peak held / peak live ratio and the granules mapped + unmapped per malloc (the
driver work). It models no handles larger than a granule, no streams and no release delay. The library's
figures come from bench/trace; this only ranks policies (doc/design.md, "Pools").

    python3 bench/placement_model.py                 # all policies, seeds 1-6, scale 0.3 and 1
    python3 bench/placement_model.py --policies next,best --cap 0.0625 --seeds 1-16 --concurrency 48
"""
import argparse, bisect, math, random

G, KV = 2 << 20, 128 << 10
FREE, USED, VA = 0, 1, 2


def trace(seed, nreq=400, conc=48, scale=1.0):
    r = random.Random(seed)
    reqs = []
    for _ in range(nreq):
        p = round(min(max(math.exp(r.gauss(6.0, 1.0)), 16), 4096) * scale) or 1
        o = round(min(max(math.exp(r.gauss(5.0, 1.0)), 8), 2048) * scale) or 1
        reqs.append([p, o, 0, -1])  # tokens, outputs left, done, buffer id
    ops, nid, act, nxt = [], 0, [], 0
    while nxt < nreq or act:
        while len(act) < conc and nxt < nreq:
            q = reqs[nxt]; q[3] = nid; nid += 1
            ops.append(('a', q[3], q[0] * KV)); act.append(nxt); nxt += 1
        keep = []
        for i in act:
            q = reqs[i]; nb = nid; nid += 1
            ops.append(('a', nb, (q[0] + 1) * KV)); ops.append(('f', q[3], q[0] * KV))
            q[3] = nb; q[0] += 1; q[2] += 1
            if q[2] == q[1]:
                ops.append(('f', q[3], q[0] * KV))
            else:
                keep.append(i)
        act = keep
    return ops


class Heap:
    def __init__(s, fit, compose, cap, n=1 << 20):
        s.starts, s.run, s.free_set = [0], {0: [n, VA, 0]}, set()
        s.fit, s.compose, s.cap = fit, compose, cap
        s.rover_mode = 'start'  # as the library: the next search starts at the last allocation
        s.held = s.free = s.maps = s.unmaps = s.t = s.peak = s.fp = s.peakfp = s.rover = 0

    def _set(s, st, ln, state, t=0):
        if st not in s.run:
            bisect.insort(s.starts, st)
        s.run[st] = [ln, state, t]
        (s.free_set.add if state == FREE else s.free_set.discard)(st)

    def _del(s, st):
        del s.starts[bisect.bisect_left(s.starts, st)]; del s.run[st]; s.free_set.discard(st)

    def _nb(s, st):
        i = bisect.bisect_left(s.starts, st)
        return (s.starts[i - 1] if i else None), (s.starts[i + 1] if i + 1 < len(s.starts) else None)

    def _coalesce(s, st):
        ln, state, t = s.run[st]; l, r = s._nb(st)
        if r is not None and s.run[r][1] == state != USED:
            ln += s.run[r][0]; t = max(t, s.run[r][2]); s._del(r)
        if l is not None and s.run[l][1] == state != USED:
            s._del(st); st = l; ln += s.run[l][0]; t = max(t, s.run[l][2])
        s._set(st, ln, state, t)

    def _pick(s, k):
        c = [st for st in s.free_set if s.run[st][0] >= k]
        if not c:
            return None
        if s.fit == 'best':
            return min(c, key=lambda st: (s.run[st][0], st))
        if s.fit == 'aoff':
            return min(c)
        if s.fit == 'highest':
            return max(c)
        after = [st for st in c if st >= s.rover]  # next fit
        return min(after) if after else min(c)

    def _steal(s, need, keep):
        """Unmap FREE runs, oldest first, while held + need would pass (1 + cap) x the peak footprint."""
        if s.cap is None:
            return
        pk = max(s.peakfp, s.fp + need)
        lim = pk + int(pk * s.cap)
        for st in sorted(s.free_set, key=lambda st: s.run[st][2]):
            if s.held + need <= lim:
                break
            if st != keep:
                ln = s.run[st][0]
                s.free -= ln; s.held -= ln; s.unmaps += ln
                s.run[st][1] = VA; s.free_set.discard(st); s._coalesce(st)

    def alloc(s, k):
        s.t += 1
        b = s._pick(k)
        if b is not None:
            ln, _, t = s.run[b]
            if ln > k:
                s._set(b + k, ln - k, FREE, t)
            s._set(b, k, USED); s.free -= k; a = b
        else:
            best = None
            for st in (s.free_set if s.compose else ()):
                ln = s.run[st][0]; l, r = s._nb(st)
                for side, v in (('r', r), ('l', l)):
                    if v is not None and s.run[v][1] == VA and s.run[v][0] >= k - ln and (best is None or ln > best[1]):
                        best = (st, ln, side, v)
                        break
            lack = k - (best[1] if best else 0)
            s._steal(lack, best[0] if best else None)
            if best:
                st, ln, side, _ = best
                v = s._nb(st)[1 if side == 'r' else 0]  # the steal may have merged the address space beside it
                vl = s.run[v][0]; s.free -= ln
                if side == 'r':
                    s._del(v)
                    if vl > lack:
                        s._set(v + lack, vl - lack, VA)
                    s._set(st, k, USED); a = st
                else:
                    s._del(st)
                    if vl > lack:
                        s._set(v, vl - lack, VA)
                    else:
                        s._del(v)
                    a = st - lack; s._set(a, k, USED)
            else:
                a = next(st for st in s.starts if s.run[st][1] == VA and s.run[st][0] >= k)
                vl = s.run[a][0]
                if vl > k:
                    s._set(a + k, vl - k, VA)
                s._set(a, k, USED)
            s.maps += lack; s.held += lack; s.peak = max(s.peak, s.held)
        s.rover = a + k if s.rover_mode == 'end' else a
        s.fp += k; s.peakfp = max(s.peakfp, s.fp)
        return a

    def free_(s, a):
        s.t += 1
        ln = s.run[a][0]
        s._set(a, ln, FREE, s.t); s.free += ln; s.fp -= ln
        s._coalesce(a)


def replay(ops, **kw):
    h, where, live, peak_live, n = Heap(**kw), {}, 0, 0, 0
    for kind, i, b in ops:
        if kind == 'a':
            where[i] = h.alloc(-(-b // G)); live += b; peak_live = max(peak_live, live); n += 1
        else:
            h.free_(where.pop(i)); live -= b
    return h.peak * G / peak_live, (h.maps + h.unmaps) / n


def main():
    ap = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    ap.add_argument('--policies', default='best,aoff,highest,next')
    ap.add_argument('--cap', type=float, default=None, help='slack cap as a fraction of the peak footprint')
    ap.add_argument('--no-compose', action='store_true')
    ap.add_argument('--seeds', default='1-6')
    ap.add_argument('--scales', default='0.3,1')
    ap.add_argument('--concurrency', type=int, default=48)
    a = ap.parse_args()
    lo, _, hi = a.seeds.partition('-')
    traces = [trace(seed, conc=a.concurrency, scale=float(sc))
              for seed in range(int(lo), int(hi or lo) + 1) for sc in a.scales.split(',')]
    print('policy    held/live mean   max   granules mapped+unmapped per malloc (mean)')
    for pol in a.policies.split(','):
        rs = [replay(t, fit=pol, compose=not a.no_compose, cap=a.cap) for t in traces]
        print('%-8s  %14.3f %6.3f   %.3f' % (pol, sum(r[0] for r in rs) / len(rs), max(r[0] for r in rs),
                                            sum(r[1] for r in rs) / len(rs)))


if __name__ == '__main__':
    main()
