"""Runs test_torch.py for meson (suite cuda): exit 77 (SKIP) where torch, a CUDA GPU or pytest is missing,
so that a machine without them never reports the PyTorch tests as passed."""
import os
import sys

here = os.path.dirname(os.path.abspath(__file__))
try:
    import torch
except ImportError:
    print("SKIP: torch is not installed")
    sys.exit(77)
if not torch.cuda.is_available():
    print("SKIP: torch sees no CUDA device")
    sys.exit(77)
try:
    import pytest
except ImportError:
    print("SKIP: pytest is not installed")
    sys.exit(77)
print("torch %s on %s" % (torch.__version__, torch.cuda.get_device_name(0)), flush=True)
sys.exit(pytest.main(["-q", "-rs", "-p", "no:cacheprovider", os.path.join(here, "test_torch.py")] + sys.argv[1:]))
