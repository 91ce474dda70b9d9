"""cuvmm.torch imports where torch does not, and says that torch is what is missing when used; its named
pools can be configured without it.
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
# Configuring a named pool needs neither torch nor a device (nothing is created until the pool's first use).
import cuvmm  # noqa: E402
cuvmm.torch.configure_pool("weights", coarse_bytes=64 << 20)
cuvmm.torch.configure_pool("weights", coarse_bytes=128 << 20)  # replaces: no pool of that name exists yet
cuvmm.torch.configure_pool(None, max_bytes=1 << 40)             # the default pool
for bad in (dict(coarse_bytes=-1), dict(max_bytes=1 << 64), dict(peer_access=[64]), dict(peer_access="x")):
    try:
        cuvmm.torch.configure_pool("other", **bad)
    except cuvmm.Error as e:
        assert e.code == cuvmm.EINVAL, (bad, e)
    else:
        raise AssertionError("configure_pool(%r) did not fail" % bad)
try:
    cuvmm.torch.configure_pool("x" * 32)
except cuvmm.Error as e:
    assert e.code == cuvmm.EINVAL, e
else:
    raise AssertionError("a 32-byte pool name was accepted")
print("cuvmm.torch without torch: ok")
