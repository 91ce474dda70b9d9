#!/usr/bin/env python3
"""Sweep bench/trace over a family of KV-cache traces and rank the allocators on every one of them.

The family (issue #11, target 1): trace shapes with per-token KV from 16 KiB to 256 KiB, 8 to 128 requests
at once, short and long prompts and outputs and several seeds, each replayed with the context's release
delay at 0, 100 ms and 1 s (27 traces by default). Every trace runs cuvmm (cuvmm_malloc/cuvmm_free) and
cuvmmasync (the _async calls) and, where a GPU is usable, cudaMalloc and cudaMallocAsync with release
threshold 0 (async0) on the same operation list (one bench/trace process per trace, so the allocators see
identical operations). The CUDA allocators do not depend on the release delay; they run on every trace all
the same, so that each row of the table is one process, one side-by-side run.

Reports, per trace, the granule floor (the peak of the live allocations each rounded up to the granule,
over peak live: what an allocator holds that gives each allocation granules of its own and frees at once;
the floor the issue names), held/live at peak and the pair cost (mean malloc + mean free, ns) of each
allocator, then per allocator the median, the worst and the worst ratio to the floor over the family;
writes every row to a CSV (--csv) and, if matplotlib can be imported, a plot (--plot; skipped with a note
otherwise).

Host backend (no GPU, or --backend=host): token counts are multiplied by --scale (bench/trace --scale)
and, unless --host-granularity is given, the host backend's granule is scaled by the same factor (2 MiB x
scale, rounded to a power of two, at least 64 KiB; CUVMM_HOST_GRANULARITY), so a scaled-down trace keeps
about the shape it has against 2 MiB granules at full scale. Host figures are not GPU figures: pair
costs there are memfd/mmap system calls, not driver calls.

Usage:
    python3 bench/sweep.py [--trace=build/bench/trace] [--scale=0.05] [--csv=sweep.csv] [--plot=sweep.png]
                           [--delays=0,100,1000] [--only=NAME,...] [--smoke] [--backend=cuda|host]
                           [--coarse-granules=N]
--smoke: three small traces at delay 0 and 100 ms, tiny scale (a CI check that the pipeline works; it
fails if a run fails, never on a figure). Exit status: 0, 1 if a run failed, 2 for bad arguments.
Python 3 standard library only (matplotlib optional, for the plot).
"""
import argparse
import csv
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time

# name, kv per token, concurrency, requests, seed, prompt (mu, sigma, max), output (mu, sigma, max)
SHAPES = [
    ("published", "128k", 48, 400, 1, (6.0, 1.0, 4096), (5.0, 1.0, 2048)),
    ("issue-24k-long", "24k", 40, 160, 1, (5.5, 1.2, 3000), (4.5, 1.1, 1500)),
    ("issue-64k-short", "64k", 96, 600, 7, (4.0, 0.8, 4096), (3.5, 0.7, 2048)),
    ("16k-c8-long", "16k", 8, 64, 2, (7.0, 0.8, 8192), (6.0, 0.8, 4096)),
    ("256k-c128-short", "256k", 128, 512, 3, (4.5, 0.8, 4096), (4.0, 0.8, 2048)),
    ("32k-c64-chat", "32k", 64, 256, 4, (5.0, 1.0, 4096), (6.0, 1.0, 4096)),
    ("192k-c16-rag", "192k", 16, 96, 5, (7.5, 0.6, 8192), (3.0, 0.5, 512)),
    ("48k-c32-mixed", "48k", 32, 200, 11, (6.0, 1.5, 8192), (5.0, 1.5, 4096)),
    ("128k-c128-s2", "128k", 128, 600, 2, (6.0, 1.0, 4096), (5.0, 1.0, 2048)),
]
SMOKE = ["published", "issue-24k-long", "16k-c8-long"]
CUVMM_ALLOCS = ["cuvmm", "cuvmmasync"]
GPU_ALLOCS = ["cudamalloc", "async0"]


def host_granularity(scale):
    g = 2 * 1024 * 1024 * scale
    return max(64 * 1024, 1 << int(round(math.log2(g))))


def gpu_usable(trace):
    """Ask bench/trace itself: with no GPU it says so in its banner (a run of one tiny trace)."""
    try:
        out = subprocess.run([trace, "--requests=1", "--scale=0.01", "--quiet", "--return-test-bytes=0",
                              "--allocators=cuvmm", "--release-delay-ms=0"], capture_output=True, text=True,
                             timeout=120)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return out.returncode == 0 and "NO USABLE GPU" not in out.stdout


def run_trace(args, shape, delay, allocs, gran):
    name, kv, conc, reqs, seed, p, o = shape
    with tempfile.NamedTemporaryFile(suffix=".csv", delete=False) as tf:
        summary = tf.name
    cmd = [args.trace, "--quiet", "--return-test-bytes=0", "--allocators=" + ",".join(allocs),
           "--backend=" + args.backend, "--scale=%g" % args.scale, "--kv-per-token=" + kv,
           "--concurrency=%d" % conc, "--requests=%d" % reqs, "--seed=%d" % seed,
           "--prompt-mu=%g" % p[0], "--prompt-sigma=%g" % p[1], "--prompt-max=%d" % p[2],
           "--output-mu=%g" % o[0], "--output-sigma=%g" % o[1], "--output-max=%d" % o[2],
           "--release-delay-ms=%d" % delay, "--summary-csv=" + summary]
    if args.coarse_granules:
        cmd.append("--coarse-bytes=%d" % (args.coarse_granules * (gran or 2 * 1024 * 1024)))
    env = dict(os.environ)
    if gran:
        env["CUVMM_HOST_GRANULARITY"] = str(gran)
    t0 = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    wall = time.monotonic() - t0
    rows = []
    try:
        with open(summary, newline="") as f:
            rows = [r for r in csv.DictReader(f) if r["kind"] == "trace"]
    except OSError:
        pass
    os.unlink(summary)
    if proc.returncode != 0:
        sys.stderr.write("sweep: %s delay %d ms failed (exit %d):\n%s%s\n" % (name, delay, proc.returncode,
                                                                           proc.stdout[-2000:], proc.stderr[-2000:]))
    out = []
    for r in rows:
        out.append({
            "trace": name, "release_delay_ms": delay, "kv_per_token": kv, "concurrency": conc,
            "requests": reqs, "seed": seed, "prompt_mu": p[0], "prompt_sigma": p[1], "prompt_max": p[2],
            "output_mu": o[0], "output_sigma": o[1], "output_max": o[2], "scale": args.scale,
            "host_granularity": gran or "", "allocator": r["allocator"], "backend": r["backend"],
            "ok": r["ok"], "mallocs": r["mallocs"], "peak_live_bytes": r["peak_live_bytes"],
            "peak_held_bytes": r["peak_held_bytes"], "ratio": r["ratio"], "held_exact": r["held_exact"],
            "pair_mean_ns": r["pair_mean_ns"], "map_calls": r["map_calls"], "unmap_calls": r["unmap_calls"],
            "create_calls": r["create_calls"], "release_calls": r["release_calls"], "wall_ms": r["wall_ms"],
            "floor": "%.4f" % (int(r["granule_floor_bytes"]) / max(1, int(r["peak_live_bytes"]))),
        })
    # Rounding up never shrinks: a floor below peak live is a bug of bench/trace, not a figure.
    bad = [r for r in out if float(r["floor"]) < 1.0]
    if bad:
        sys.stderr.write("sweep: %s delay %d ms: granule floor %s below peak live\n"
                         % (name, delay, bad[0]["floor"]))
    return proc.returncode == 0 and bool(out) and not bad, out, wall


def plot(rows, allocs, path):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("plot: matplotlib is not installed; no plot written (the CSV has every figure)")
        return
    keys = []
    for r in rows:
        k = "%s@%sms" % (r["trace"], r["release_delay_ms"])
        if k not in keys:
            keys.append(k)
    fig, (a1, a2) = plt.subplots(2, 1, figsize=(max(9, 0.42 * len(keys)), 8), sharex=True)
    w = 0.8 / max(1, len(allocs))
    for i, a in enumerate(allocs):
        by = {"%s@%sms" % (r["trace"], r["release_delay_ms"]): r for r in rows if r["allocator"] == a}
        xs = [j + (i - (len(allocs) - 1) / 2) * w for j in range(len(keys))]
        a1.bar(xs, [float(by[k]["ratio"]) if k in by else 0 for k in keys], w, label=a)
        a2.bar(xs, [float(by[k]["pair_mean_ns"]) / 1000 if k in by else 0 for k in keys], w, label=a)
    fl = {"%s@%sms" % (r["trace"], r["release_delay_ms"]): float(r["floor"]) for r in rows
          if r["allocator"] in CUVMM_ALLOCS}
    a1.scatter(range(len(keys)), [fl.get(k, float("nan")) for k in keys], marker="_", s=250, color="k", zorder=3,
               label="granule floor")
    a1.axhline(1.10, color="k", ls="--", lw=0.8, label="target 1.10")
    a1.set_ylabel("held / live at peak")
    a1.set_ylim(bottom=1.0)
    a1.legend(fontsize=8, ncol=len(allocs) + 1)
    a2.set_ylabel("pair cost (us)")
    a2.set_yscale("log")
    a2.set_xticks(range(len(keys)))
    a2.set_xticklabels(keys, rotation=70, ha="right", fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print("plot: wrote %s" % path)


def main():
    here = os.path.dirname(os.path.abspath(__file__))
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", default=os.path.join(here, "..", "build", "bench", "trace"),
                    help="the bench/trace program (default: build/bench/trace)")
    ap.add_argument("--backend", choices=["auto", "cuda", "host"], default="auto",
                    help="auto (default): the GPU when bench/trace finds one usable, else the host backend")
    ap.add_argument("--scale", type=float, default=None, help="token scale (default 1 on a GPU, 0.05 on host)")
    ap.add_argument("--host-granularity", default=None,
                    help="host backend granule in bytes, or 'scaled' (default) or 'default' (2 MiB)")
    ap.add_argument("--delays", default="0,100,1000", help="release delays in ms (default 0,100,1000)")
    ap.add_argument("--only", default=None, help="comma list of trace names (default: all)")
    ap.add_argument("--csv", default="sweep.csv", help="CSV to write (default sweep.csv)")
    ap.add_argument("--plot", default="sweep.png", help="PNG to write if matplotlib is present (default sweep.png)")
    ap.add_argument("--coarse-granules", type=int, default=0,
                    help="cuvmm pools with coarse_bytes of this many granules (default 0: off; the trade-off of "
                         "cuvmm_pool_config.coarse_bytes on KV traces)")
    ap.add_argument("--seeds", default="0",
                    help="comma list of offsets added to each shape's seed (default 0): --seeds=0,100,200 replays "
                         "every shape with three different sets of requests (rows named shape+100, ...)")
    ap.add_argument("--smoke", action="store_true", help="three small traces, tiny scale, delays 0 and 100")
    ap.add_argument("--list", action="store_true", help="print the family and exit")
    args = ap.parse_args()

    try:
        delays = [int(x) for x in args.delays.split(",")]
        if not delays or any(d < -1 for d in delays):
            raise ValueError
    except ValueError:
        ap.error("--delays=%s: a comma list of -1 or milliseconds" % args.delays)
    shapes = SHAPES
    if args.smoke:
        shapes = [s for s in SHAPES if s[0] in SMOKE]
        delays = [0, 100]
    if args.only:
        names = args.only.split(",")
        unknown = set(names) - {s[0] for s in SHAPES}
        if unknown:
            ap.error("--only: unknown trace(s) %s" % ", ".join(sorted(unknown)))
        shapes = [s for s in SHAPES if s[0] in names]
    try:
        offsets = [int(x) for x in args.seeds.split(",")]
        if not offsets or any(x < 0 for x in offsets):
            raise ValueError
    except ValueError:
        ap.error("--seeds=%s: a comma list of offsets >= 0" % args.seeds)
    shapes = [(s[0] + ("+%d" % off if off else ""), s[1], s[2], s[3], s[4] + off, s[5], s[6])
              for off in offsets for s in shapes]
    if args.list:
        for s in shapes:
            print("%-16s kv %5s/token, %3d at once, %3d requests, seed %2d, prompt lognormal(%g, %g) <= %d, "
                  "output lognormal(%g, %g) <= %d" % (s[0], s[1], s[2], s[3], s[4], *s[5], *s[6]))
        print("%d shapes x release delays %s ms = %d traces" % (len(shapes), ",".join(map(str, delays)),
                                                                len(shapes) * len(delays)))
        return 0
    if not os.access(args.trace, os.X_OK):
        ap.error("%s: not an executable (build first: ninja -C build)" % args.trace)

    gpu = args.backend != "host" and gpu_usable(args.trace)
    if args.backend == "cuda" and not gpu:
        ap.error("--backend=cuda, but bench/trace finds no usable GPU")
    args.backend = "cuda" if gpu else "host"
    if args.scale is None:
        args.scale = 0.005 if args.smoke else (1.0 if gpu else 0.05)
    if args.scale <= 0:
        ap.error("--scale must be > 0")
    gran = None
    if args.backend == "host":
        hg = args.host_granularity or "scaled"
        if hg == "scaled":
            gran = host_granularity(args.scale)
        elif hg != "default":
            try:
                gran = int(hg)
            except ValueError:
                ap.error("--host-granularity=%s: bytes, 'scaled' or 'default'" % hg)
    allocs = CUVMM_ALLOCS + (GPU_ALLOCS if gpu else [])
    print("sweep: %d traces (%d shapes x delays %s ms), allocators %s, backend %s, scale %g%s" % (
        len(shapes) * len(delays), len(shapes), ",".join(map(str, delays)), ",".join(allocs), args.backend,
        args.scale, ", host granule %d KiB" % (gran // 1024) if gran else ""))
    if args.backend == "host":
        print("sweep: HOST BACKEND: held/live is the library's; pair costs are host system calls, not GPU figures")

    rows, failed = [], 0
    for s in shapes:
        for d in delays:
            ok, out, wall = run_trace(args, s, d, allocs, gran)
            failed += not ok
            rows += out
            cells = "  ".join("%s %.3f %7.1fus" % (r["allocator"], float(r["ratio"]),
                                                   float(r["pair_mean_ns"]) / 1000) for r in out)
            floor = "floor %.3f  " % float(out[0]["floor"]) if out else ""
            print("%-16s delay %4d ms  %s%s  (run %.1f s)%s"
                  % (s[0], d, floor, cells, wall, "" if ok else "  FAILED"), flush=True)

    print("\n%-11s %7s %7s %-30s %9s %9s %13s" % ("allocator", "median", "worst", "worst trace", "pair med",
                                                 "pair max", "worst /floor"))
    for a in allocs:
        rs = [r for r in rows if r["allocator"] == a and r["ok"] == "1"]
        if not rs:
            continue
        ratios = [float(r["ratio"]) for r in rs]
        pairs = [float(r["pair_mean_ns"]) / 1000 for r in rs]
        worst = max(rs, key=lambda r: float(r["ratio"]))
        over_floor = max(float(r["ratio"]) / float(r["floor"]) for r in rs)
        print("%-11s %7.3f %7.3f %-30s %8.1fus %8.1fus %13.3f" % (
            a, statistics.median(ratios), max(ratios), "%s@%sms" % (worst["trace"], worst["release_delay_ms"]),
            statistics.median(pairs), max(pairs), over_floor))
    floors = {(r["trace"], r["release_delay_ms"]): float(r["floor"]) for r in rows
              if r["allocator"] in CUVMM_ALLOCS and r["ok"] == "1"}
    if floors:
        print("granule floor (live allocations each rounded up to the granule, at peak, over peak live): median "
              "%.3f, worst %.3f; above 1.10 on %d of %d traces" % (
                  statistics.median(floors.values()), max(floors.values()),
                  sum(f > 1.10 for f in floors.values()), len(floors)))
    over = [r for r in rows if r["allocator"] in CUVMM_ALLOCS and float(r["ratio"]) > 1.10]
    ncv = len([r for r in rows if r["allocator"] in CUVMM_ALLOCS])
    over_fl = [r for r in rows if r["allocator"] in CUVMM_ALLOCS and float(r["ratio"]) > 1.10 * float(r["floor"])]
    print("cuvmm and cuvmmasync rows above the 1.10 target: %d of %d; above 1.10x their granule floor: %d of %d"
          % (len(over), ncv, len(over_fl), ncv))
    if rows:
        with open(args.csv, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(rows[0].keys()))
            w.writeheader()
            w.writerows(rows)
        print("csv: wrote %s" % args.csv)
        if not args.smoke:
            plot(rows, allocs, args.plot)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
