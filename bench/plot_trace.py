#!/usr/bin/env python3
"""Plot held vs live bytes over time from bench/trace's --csv output, one subplot per allocator.

Usage:
    bench/trace --csv=trace.csv [other options]
    python3 bench/plot_trace.py trace.csv -o doc/trace.png [--title "H200, seed 1"]

Input columns (header line required): allocator,t_ms,live_bytes,held_bytes[,driver_held_bytes,phase].
driver_held_bytes, where present and not empty, is drawn as a dashed line (for cuvmm on the CUDA backend it
is the driver's cross-check of the library's own count); rows with phase "idle" or "returned" are shaded as
the idle phase that follows the replay. Needs matplotlib (Agg backend, no display); nothing else.
"""
import argparse
import csv
import sys
from collections import OrderedDict

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (after choosing the backend)

GIB = float(1 << 30)


def read_series(path):
    series = OrderedDict()
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        missing = {"allocator", "t_ms", "live_bytes", "held_bytes"} - set(reader.fieldnames or [])
        if missing:
            sys.exit("%s: missing columns: %s" % (path, ", ".join(sorted(missing))))
        for row in reader:
            s = series.setdefault(row["allocator"], {"t": [], "live": [], "held": [], "drv": [], "phase": []})
            s["t"].append(float(row["t_ms"]) / 1000.0)
            s["live"].append(int(row["live_bytes"]) / GIB)
            s["held"].append(int(row["held_bytes"]) / GIB)
            drv = (row.get("driver_held_bytes") or "").strip()
            s["drv"].append(int(drv) / GIB if drv else None)
            s["phase"].append((row.get("phase") or "replay").strip())
    if not series:
        sys.exit("%s: no data rows" % path)
    return series


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("csv", help="time series written by bench/trace --csv")
    ap.add_argument("-o", "--output", default="trace.png", help="PNG to write (default: trace.png)")
    ap.add_argument("--title", default=None, help="figure title")
    ap.add_argument("--dpi", type=int, default=120)
    args = ap.parse_args()

    series = read_series(args.csv)
    n = len(series)
    fig, axes = plt.subplots(n, 1, figsize=(9, 2.6 * n + 0.6), squeeze=False)
    ymax = max(max(s["held"] + s["live"] + [d for d in s["drv"] if d is not None]) for s in series.values())
    for ax, (name, s) in zip(axes[:, 0], series.items()):
        peak_live = max(s["live"])
        replay_held = [h for h, p in zip(s["held"], s["phase"]) if p == "replay"] or s["held"]
        peak_held = max(replay_held)
        ratio = peak_held / peak_live if peak_live else float("nan")
        ax.plot(s["t"], s["held"], label="held", color="tab:red", linewidth=1.2, drawstyle="steps-post")
        ax.plot(s["t"], s["live"], label="live", color="tab:blue", linewidth=1.2, drawstyle="steps-post")
        if any(d is not None for d in s["drv"]):
            pts = [(t, d) for t, d in zip(s["t"], s["drv"]) if d is not None]
            ax.plot([p[0] for p in pts], [p[1] for p in pts], label="held (driver)", color="tab:gray",
                    linewidth=0.9, linestyle="--", drawstyle="steps-post")
        idle = [t for t, p in zip(s["t"], s["phase"]) if p != "replay"]
        if idle:
            ax.axvspan(min(idle), max(idle), color="0.92", zorder=0, label="idle")
        ax.set_title("%s: peak held %.2f / peak live %.2f GiB = %.2fx (CSV samples)"
                     % (name, peak_held, peak_live, ratio), fontsize=10)
        ax.set_ylabel("GiB")
        ax.set_ylim(0, ymax * 1.05 if ymax > 0 else 1)
        ax.set_xlim(left=0)
        ax.grid(True, alpha=0.3)
        ax.legend(loc="upper right", fontsize=8)
    axes[-1, 0].set_xlabel("time since the start of the replay (s)")
    if args.title:
        fig.suptitle(args.title)
    fig.tight_layout()
    fig.savefig(args.output, dpi=args.dpi)
    print("wrote %s (%d allocator%s)" % (args.output, n, "" if n == 1 else "s"))


if __name__ == "__main__":
    main()
