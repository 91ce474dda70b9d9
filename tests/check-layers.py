#!/usr/bin/env python3
"""Usage: check-layers.py SOURCE_ROOT

The layers of lib/ (doc/design.md): every file of lib/ has a row in LAYERS below, and its #include "..."
lines may name only headers of its own layer or lower, no two modules may reach each other through their
includes (no include circle), and a private header is included only inside its module (and by tests).
Prints each breach, naming the files, and exits 1; exits 0 with a PASS line when there is none.
"""
import os
import re
import sys

# Layers, bottom first: a file may include headers of its own layer and below, never above.
BASE, DRIVER, PHYS, CONTEXT, REGIONS, ALLOCATORS, INTEGRATIONS = range(7)
LAYER_NAMES = ["base", "driver", "physical memory", "context", "regions", "allocators", "integrations"]

# The one table: file -> (layer, module, private). A module is a .c/.h pair and the files that are its
# parts by name (drv_*, pool_*, region_sleep, ctx_*): the include circles are looked for between modules.
# private: a header only its own module (and tests/) may include.
# base: shared leaves that hold no state of the library's objects (errors, logging, the environment
# parser, the published page's format and its reader, the first-fit index, the packer's planner).
LAYERS = {
    "errors.c": (BASE, "errors", False),
    "log.c": (BASE, "log", False),
    "log.h": (BASE, "log", False),
    "config.c": (BASE, "config", False),
    "config.h": (BASE, "config", False),
    "publish.h": (BASE, "publish", False),        # the page's format: writer (ctx_publish.c) and reader
    "publish_read.c": (BASE, "publish", False),   # the reader, also built into cuvmm-top
    "seg.c": (BASE, "seg", False),
    "seg.h": (BASE, "seg", False),
    "pack.c": (BASE, "pack", False),
    "pack.h": (BASE, "pack", False),
    "drv.c": (DRIVER, "drv", False),
    "drv.h": (DRIVER, "drv", False),
    "drv_cuda.c": (DRIVER, "drv", False),
    "drv_host.c": (DRIVER, "drv", False),
    "drv_test.h": (DRIVER, "drv", True),          # the host backend's test hooks: tests only
    "policy.c": (PHYS, "policy", False),
    "policy.h": (PHYS, "policy", False),
    "fence.c": (PHYS, "fence", False),
    "fence.h": (PHYS, "fence", False),
    "phys.c": (PHYS, "phys", False),
    "phys.h": (PHYS, "phys", False),
    "ctx.c": (CONTEXT, "ctx", False),
    "ctx.h": (CONTEXT, "ctx", False),
    "ctx_capture.c": (CONTEXT, "ctx", False),     # the captures seen: may the device be synchronised?
    "ctx_capture.h": (CONTEXT, "ctx", False),
    "ctx_publish.c": (CONTEXT, "ctx", False),     # writing the context's page; ctx.c its only caller
    "ctx_publish.h": (CONTEXT, "ctx", True),
    "region.c": (REGIONS, "region", False),
    "region.h": (REGIONS, "region", False),
    "region_sleep.c": (REGIONS, "region", False),
    "pool.c": (ALLOCATORS, "pool", False),
    "pool.h": (ALLOCATORS, "pool", False),
    "pool_int.h": (ALLOCATORS, "pool", True),
    "pool_runs.c": (ALLOCATORS, "pool", False),
    "pool_place.c": (ALLOCATORS, "pool", False),
    "pool_slab.c": (ALLOCATORS, "pool", False),
    "pool_reclaim.c": (ALLOCATORS, "pool", False),
    "pool_pack.c": (ALLOCATORS, "pool", False),
    "graph.c": (ALLOCATORS, "graph", False),
    "graph.h": (ALLOCATORS, "graph", False),
    "kv.c": (ALLOCATORS, "kv", False),
    "kv.h": (ALLOCATORS, "kv", False),
    "torch.c": (INTEGRATIONS, "torch", False),
}

# Module pairs allowed to include each other, each with its reason. Keep it empty; every entry is a debt.
# config <-> log: the logger reads $CUVMM_LOG through the one environment parser, and the parser reports
# the other variables' bad values through the logger ($CUVMM_LOG's own straight to stderr, so no loop).
ALLOWED_CIRCLES = {frozenset(("config", "log"))}

INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"')


def includes(path):
    with open(path, encoding="utf-8", errors="replace") as f:
        return [m.group(1) for m in map(INCLUDE.match, f) if m]


def find_circles(edges):
    """Every elementary circle of the module graph, each once, as a list of modules."""
    circles, seen = [], set()
    for start in sorted(edges):
        stack = [(start, [start])]
        while stack:
            node, path = stack.pop()
            for nxt in sorted(edges.get(node, ())):
                if nxt == start:
                    key = frozenset(path)
                    if key not in seen:
                        seen.add(key)
                        circles.append(path + [start])
                elif nxt not in path and nxt > start:
                    stack.append((nxt, path + [nxt]))
    return circles


def main():
    if len(sys.argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    lib = os.path.join(sys.argv[1], "lib")
    files = sorted(f for f in os.listdir(lib) if f.endswith((".c", ".h")))
    errors = []
    for f in files:
        if f not in LAYERS:
            errors.append(f"lib/{f}: not in the layer table of tests/check-layers.py (add it, with its layer)")
    for f in sorted(set(LAYERS) - set(files)):
        errors.append(f"lib/{f}: in the layer table but not in lib/ (remove its row)")

    edges = {}  # module -> {module: [(file, header)]}
    for f in files:
        if f not in LAYERS:
            continue
        layer, module, _ = LAYERS[f]
        for h in includes(os.path.join(lib, f)):
            if h not in LAYERS:
                continue  # the public header, or a file outside lib/
            hlayer, hmodule, hprivate = LAYERS[h]
            if hlayer > layer:
                errors.append(f"lib/{f} ({LAYER_NAMES[layer]}) includes {h} ({LAYER_NAMES[hlayer]}): "
                              "an arrow pointing up")
            if hprivate and hmodule != module:
                errors.append(f"lib/{f} includes {h}, private to the {hmodule} module")
            if hmodule != module:
                edges.setdefault(module, {}).setdefault(hmodule, []).append((f, h))

    for circle in find_circles(edges):
        if len(circle) == 3 and frozenset(circle) in ALLOWED_CIRCLES:
            continue
        how = "; ".join(f"{a} -> {b} (" + ", ".join(f"lib/{f} includes {h}" for f, h in edges[a][b]) + ")"
                        for a, b in zip(circle, circle[1:]))
        errors.append(f"include circle {' -> '.join(circle)}: {how}")

    for e in errors:
        print("FAIL: " + e, file=sys.stderr)
    if errors:
        return 1
    print(f"PASS: layers ({len(files)} files of lib/, every include points down or across, no circle)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
