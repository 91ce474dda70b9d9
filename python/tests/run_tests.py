"""Runs test_cuvmm.py for meson: with pytest where it is installed, else with unittest (the tests are
unittest.TestCase classes, so both run all of them). Exit 77 (SKIP) when the backend in $CUVMM_BACKEND
cannot make a context, e.g. the cuda suite on a machine without a GPU."""

import os
import sys

here = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, here)

import cuvmm  # noqa: E402  (after the path; a failure to load the library is a failure, not a skip)

try:
    cuvmm.Context().close()
except (cuvmm.NoDriver, cuvmm.NoDevice) as e:
    print("SKIP: no %s backend here: %s" % (os.environ.get("CUVMM_BACKEND", "cuda"), e))
    sys.exit(77)

try:
    import pytest
except ImportError:
    pytest = None

if pytest is not None:
    print("running with pytest %s, library %s" % (pytest.__version__, cuvmm.library_path), flush=True)
    sys.exit(pytest.main(["-q", "-rs", "-p", "no:cacheprovider", os.path.join(here, "test_cuvmm.py")]))

import unittest  # noqa: E402

print("pytest not installed: running with unittest, library %s" % cuvmm.library_path, flush=True)
suite = unittest.defaultTestLoader.loadTestsFromName("test_cuvmm")
result = unittest.TextTestRunner(verbosity=1).run(suite)
sys.exit(0 if result.wasSuccessful() else 1)
