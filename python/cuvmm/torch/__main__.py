"""python -m cuvmm.torch SCRIPT [ARGS...]  |  python -m cuvmm.torch -m MODULE [ARGS...]

Run an unmodified PyTorch program with cuvmm as its CUDA allocator. CUVMM_* environment variables configure
the library (CUVMM_RELEASE_DELAY_MS, CUVMM_RETAIN_BYTES, CUVMM_DEVICE_LIMIT, CUVMM_LOG, ...).
"""
import runpy
import sys


def main(argv):
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__.strip())
        return 0 if argv else 2
    import cuvmm.torch
    cuvmm.torch.enable()
    if argv[0] == "-m":
        if len(argv) < 2:
            print("python -m cuvmm.torch: -m needs a module name", file=sys.stderr)
            return 2
        sys.argv = argv[1:]
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = argv
        runpy.run_path(argv[0], run_name="__main__")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
