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


def refused(what, name="other", **kw):
    """configure_pool(name, **kw) raises cuvmm.Error EINVAL, and nothing else."""
    try:
        cuvmm.torch.configure_pool(name, **kw)
    except cuvmm.Error as e:
        assert e.code == cuvmm.EINVAL, (what, e)
    else:
        raise AssertionError("configure_pool(%r, %r) did not fail: %s" % (name, kw, what))


for bad in (dict(coarse_bytes=-1), dict(max_bytes=1 << 64), dict(peer_access=[64]), dict(peer_access="x")):
    refused("out of range", **bad)
# Values of the wrong kind are EINVAL too, never coerced (True is not 1 byte) nor another exception; no
# peers at all has no mask that serves every device's pool.
for bad in (dict(max_bytes=True), dict(coarse_bytes=1.5), dict(max_bytes=None), dict(peer_access=[True]),
            dict(peer_access=False), dict(peer_access=[])):
    refused("wrong kind", **bad)
# Names: a NUL byte would cut the name in C ("\0" would be the default pool): refused, as are non-str names.
for name in ("\0", "weights\0kv", b"weights", 5):
    refused("bad name", name, max_bytes=2 << 20)
refused("a 32-byte pool name", "x" * 32)
cuvmm.torch.configure_pool("torch", max_bytes=1 << 41)  # the default pool's own name: the default pool
cuvmm.torch.configure_pool("other", peer_access=[0])    # device 0 may read every device's "other" pool
print("cuvmm.torch without torch: ok")
