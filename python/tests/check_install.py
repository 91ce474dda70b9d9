"""Usage: check_install.py BUILDDIR
Installs BUILDDIR into a scratch DESTDIR and checks that the installed package, imported from there with
no CUVMM_LIBRARY, loads the installed libcuvmm.so next to it (through its _config.py) and works on the
host backend."""

import os
import shutil
import subprocess
import sys
import tempfile

builddir = sys.argv[1]
meson = shutil.which("meson") or "meson"
with tempfile.TemporaryDirectory(prefix="cuvmm-pyinstall.") as tmp:
    dest = os.path.join(tmp, "root")
    r = subprocess.run([meson, "install", "-C", builddir, "--destdir", dest, "--no-rebuild"],
                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if r.returncode:
        sys.exit("FAIL: meson install\n" + r.stdout)
    pkgs = [root for root, _, files in os.walk(dest)
            if root.endswith(os.sep + "cuvmm") and "__init__.py" in files]
    if len(pkgs) != 1:
        sys.exit("FAIL: expected one installed cuvmm package under %s, found %r" % (dest, pkgs))
    for f in ("_config.py", "_lib.py", "_objects.py", "_errors.py"):
        if not os.path.exists(os.path.join(pkgs[0], f)):
            sys.exit("FAIL: %s not installed in %s" % (f, pkgs[0]))
    env = {k: v for k, v in os.environ.items() if k not in ("CUVMM_LIBRARY", "LD_LIBRARY_PATH")}
    env.update(PYTHONPATH=os.path.dirname(pkgs[0]), CUVMM_BACKEND="host", PYTHONDONTWRITEBYTECODE="1")
    code = ("import cuvmm, sys\n"
            "assert cuvmm.library_path.startswith(sys.argv[1]), cuvmm.library_path\n"
            "assert cuvmm.__file__.startswith(sys.argv[1]), cuvmm.__file__\n"
            "with cuvmm.Context() as ctx, ctx.pool('install') as p:\n"
            "    p.free(p.malloc(4096))\n"
            "print('installed package', cuvmm.__file__, 'loaded', cuvmm.library_path)\n")
    r = subprocess.run([sys.executable, "-c", code, dest], env=env, cwd=tmp)
    if r.returncode:
        sys.exit("FAIL: the installed package did not load the installed library")
