#!/usr/bin/env python3
"""Plot the CSV of examples/shrink_on_idle: held and live memory over time, per object.

Usage:
    shrink_on_idle --csv=shrink.csv
    python3 examples/plot_shrink_on_idle.py shrink.csv [-o doc/shrink_on_idle.png] [--title TEXT]

The CSV has the columns t_ms,phase,object,live_bytes,held_bytes,free_bytes: per sample one row for each of
weights, kv, activations and device, and one row "gpu_free" (CUDA backend) or "host_available" (host
backend) with the driver's free memory in free_bytes. The figure has one panel per object, held as a
filled area and live as a line, with the bursts shaded; the device panel also shows the driver's free
memory on a second axis. Needs matplotlib (drawn with the Agg backend, no display needed).
"""
import argparse
import csv
import sys
from collections import defaultdict

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

MIB = 1024.0 * 1024.0
GIB = 1024.0 * MIB
PANELS = [
    ("device", "device (all objects + cached chunks)"),
    ("kv", "kv (KV blocks)"),
    ("activations", "activations (pool)"),
    ("weights", "weights (pool)"),
]


def read(path):
    series = defaultdict(lambda: {"t": [], "live": [], "held": []})
    free = {"t": [], "v": [], "name": None}
    phases = []  # (t_s, phase) per sample, once
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            t = float(row["t_ms"]) / 1e3
            obj = row["object"]
            if obj in ("gpu_free", "host_available"):
                free["t"].append(t)
                free["v"].append(int(row["free_bytes"]) / GIB)
                free["name"] = obj
                phases.append((t, row["phase"]))
                continue
            s = series[obj]
            s["t"].append(t)
            s["live"].append(int(row["live_bytes"]) / MIB)
            s["held"].append(int(row["held_bytes"]) / MIB)
    return series, free, phases


def burst_spans(phases):
    """Time spans of the bursts: [start, end) over consecutive samples whose phase starts with 'burst'."""
    spans, start, prev_t = [], None, None
    for t, ph in phases:
        in_burst = ph.startswith("burst")
        if in_burst and start is None:
            start = t
        elif not in_burst and start is not None:
            spans.append((start, t))
            start = None
        prev_t = t
    if start is not None:
        spans.append((start, prev_t))
    return spans


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("csv", help="the CSV written by shrink_on_idle --csv")
    ap.add_argument("-o", "--output", default="doc/shrink_on_idle.png", help="PNG to write")
    ap.add_argument("--title", default=None, help="figure title")
    args = ap.parse_args()

    series, free, phases = read(args.csv)
    if not series:
        sys.exit(f"{args.csv}: no samples")
    spans = burst_spans(phases)
    backend = "host backend" if free["name"] == "host_available" else "GPU"

    fig, axes = plt.subplots(
        len(PANELS), 1, figsize=(10, 9), sharex=True, gridspec_kw={"height_ratios": [2, 1.2, 1, 1]}
    )
    for ax, (obj, label) in zip(axes, PANELS):
        s = series.get(obj)
        if not s:
            continue
        for a, b in spans:
            ax.axvspan(a, b, color="0.92", lw=0)
        ax.fill_between(s["t"], s["held"], step="post", color="tab:orange", alpha=0.35, lw=0, label="held")
        ax.step(s["t"], s["held"], where="post", color="tab:orange", lw=1.2)
        ax.step(s["t"], s["live"], where="post", color="tab:blue", lw=1.5, label="live")
        ax.set_ylabel("MiB")
        ax.set_ylim(bottom=0)
        ax.set_title(label, loc="left", fontsize=10)
        ax.grid(axis="y", color="0.85", lw=0.5)
        if obj == "device" and free["t"]:
            ax2 = ax.twinx()
            name = "driver free memory" if free["name"] == "gpu_free" else "host MemAvailable"
            ax2.plot(free["t"], free["v"], color="tab:green", lw=1, ls="--", label=name)
            ax2.set_ylabel(f"{name}, GiB", color="tab:green")
            ax2.tick_params(axis="y", colors="tab:green")
            lines = ax.get_legend_handles_labels()
            lines2 = ax2.get_legend_handles_labels()
            ax.legend(lines[0] + lines2[0], lines[1] + lines2[1], loc="lower left", fontsize=8, framealpha=0.9)
    axes[-1].set_xlabel("time, s (shaded: bursts of requests; white: idle)")
    fig.suptitle(args.title or f"shrink_on_idle ({backend}): held memory falls back to live once idle")
    fig.tight_layout()
    fig.savefig(args.output, dpi=110)
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
