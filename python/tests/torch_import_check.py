"""cuvmm.torch imports where torch does not, and says that torch is what is missing when used.
Run as a script (meson's python-torch-import test, and test_torch.py): exit 0 when that holds."""
import sys

sys.modules["torch"] = None  # as if torch were not installed, also where it is
import cuvmm.torch  # noqa: E402

assert cuvmm.torch.enabled() is False
for call in (cuvmm.torch.enable, cuvmm.torch.stats, lambda: cuvmm.torch.sleep("weights")):
    try:
        call()
    except ImportError as e:
        assert "torch" in str(e), e
    except RuntimeError as e:  # sleep before enable says so first
        assert "enable" in str(e), e
    else:
        raise AssertionError("%r did not fail" % call)
print("cuvmm.torch without torch: ok")
