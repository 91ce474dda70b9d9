"""Tests of the cuvmm Python package. unittest.TestCase classes, so that pytest and unittest both run them.

Run on the backend in $CUVMM_BACKEND (meson registers python-host and python-cuda). On the host backend
device pointers are host addresses, so the tests read and write them with ctypes to check contents; the
tests that do so skip themselves on the CUDA backend.
From the source tree:  CUVMM_LIBRARY=build/lib/libcuvmm.so PYTHONPATH=python CUVMM_BACKEND=host \
                       python3 -m pytest -q python/tests
"""

import ctypes
import gc
import os
import re
import subprocess
import sys
import threading
import time
import unittest

import cuvmm
from cuvmm import _lib

BACKEND = os.environ.get("CUVMM_BACKEND", "host")
HOST = BACKEND == "host"
MiB = 1 << 20
HERE = os.path.dirname(os.path.abspath(__file__))
HEADER = os.path.join(HERE, "..", "..", "include", "cuvmm.h")

host_only = unittest.skipUnless(HOST, "reads device pointers from the CPU: host backend only")


def new_ctx(**kw):
    """A context that never releases on its own unless asked, so that stats are deterministic."""
    kw.setdefault("release_delay_ms", -1)
    kw.setdefault("background_release", False)
    return cuvmm.Context(**kw)


def poke(addr, data):
    ctypes.memmove(addr, data, len(data))


def peek(addr, n):
    return ctypes.string_at(addr, n)


def pattern(seed, n):
    return bytes((seed * 31 + i * 7) & 0xFF for i in range(n))


def run_python(code, **env):
    full = dict(os.environ)
    for k, v in env.items():
        if v is None:
            full.pop(k, None)
        else:
            full[k] = v
    return subprocess.run([sys.executable, "-c", code], env=full, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True, timeout=120)


class TestModule(unittest.TestCase):
    def test_version(self):
        self.assertRegex(cuvmm.version(), r"^\d+\.\d+\.\d+$")
        self.assertEqual(cuvmm.__version__, cuvmm.version())

    def test_error_codes(self):
        for code in cuvmm.ErrorCode:
            self.assertEqual(cuvmm.err_name(code), "CUVMM_" + code.name)
            self.assertIs(getattr(cuvmm, code.name), code)
            self.assertTrue(cuvmm.strerror(code))
        self.assertEqual(cuvmm.strerror(cuvmm.EINVAL), "invalid argument")
        self.assertEqual(cuvmm.strerror(-1000), "unknown error")
        self.assertEqual(cuvmm.err_name(12345), "CUVMM_E?")
        self.assertIsInstance(cuvmm.last_driver_error(), int)

    def test_error_class(self):
        e = cuvmm.Error(cuvmm.ENOMEM, "cuvmm_malloc")
        self.assertIsInstance(e, cuvmm.OutOfMemory)
        self.assertIsInstance(e, MemoryError)
        self.assertEqual((e.code, e.name, e.function), (-2, "CUVMM_ENOMEM", "cuvmm_malloc"))
        self.assertIn("out of physical memory", str(e))
        self.assertIn("cuvmm_malloc", str(e))
        self.assertIsInstance(cuvmm.Error(-1), ValueError)
        self.assertIs(type(cuvmm.Error(-77)), cuvmm.Error)
        self.assertEqual(cuvmm.Error(-77).name, "CUVMM_E?")

    def test_public_names(self):
        for name in cuvmm.__all__:
            self.assertTrue(hasattr(cuvmm, name), name)
        self.assertTrue(os.path.exists(cuvmm.library_path) or "/" not in cuvmm.library_path)

    def test_no_torch_import(self):
        r = run_python("import sys, cuvmm; assert 'torch' not in sys.modules, 'torch imported'")
        self.assertEqual(r.returncode, 0, r.stderr)

    @unittest.skipUnless(os.path.exists(HEADER), "source tree header not found")
    def test_call_name(self):
        self.assertEqual(cuvmm.call_name(cuvmm.Call.MAP), "cuMemMap")
        self.assertEqual(cuvmm.call_name(cuvmm.Call.CAPTURE_INFO), "cuStreamGetCaptureInfo")
        self.assertEqual(cuvmm.call_name(len(cuvmm.Call)), "?")

    def test_every_function_bound(self):
        with open(HEADER) as f:
            names = set(re.findall(r"CUVMM_API\b[^;{]*?\b(cuvmm_\w+)\s*\(", f.read()))
        self.assertGreater(len(names), 40)
        self.assertEqual(names, set(_lib.PROTOTYPES))
        for name in names:
            self.assertIsNotNone(getattr(_lib.lib, name).argtypes, name)


@unittest.skipUnless(os.environ.get("CUVMM_LAYOUT_PROBE"), "CUVMM_LAYOUT_PROBE (meson's layout_probe) not set")
class TestLayout(unittest.TestCase):
    """The ctypes structs and enums against the C compiler's view of <cuvmm.h>."""

    @classmethod
    def setUpClass(cls):
        out = subprocess.run([os.environ["CUVMM_LAYOUT_PROBE"]], stdout=subprocess.PIPE, text=True,
                             check=True).stdout
        cls.c = {k: int(v) for k, v in (line.split() for line in out.splitlines())}

    def test_structs(self):
        for cname, st in (("cuvmm_config", _lib.Config), ("cuvmm_stats", _lib.StatsStruct),
                          ("cuvmm_pool_config", _lib.PoolConfig), ("cuvmm_kv_config", _lib.KVConfig),
                          ("cuvmm_kv_move", _lib.KVMove), ("cuvmm_torch_stats", _lib.TorchStats)):
            self.assertEqual(ctypes.sizeof(st), self.c[cname + ".sizeof"], cname)
            for field, _ in st._fields_:
                if field == "size":
                    continue
                key = "%s.%s" % (cname, field.rstrip("_"))
                self.assertEqual(getattr(st, field).offset, self.c[key], key)
        self.assertEqual(ctypes.sizeof(_lib.c_enum), self.c["enum.sizeof"])

    def test_enums(self):
        for enum, prefix in ((cuvmm.Backend, "CUVMM_BACKEND_"), (cuvmm.Call, "CUVMM_CALL_"),
                             (cuvmm.LogLevel, "CUVMM_LOG_"), (cuvmm.ErrorCode, "CUVMM_")):
            for member in enum:
                self.assertEqual(int(member), self.c[prefix + member.name], member)
        self.assertEqual(len(cuvmm.Call), self.c["CUVMM_CALL_COUNT_"])
        self.assertEqual((self.c["CUVMM_SLEEP_OFFLOAD"], self.c["CUVMM_SLEEP_DISCARD"]), (0, 1))


class TestStats(unittest.TestCase):
    def test_access(self):
        s = cuvmm.Stats(held_bytes=5, live_bytes=3)
        self.assertEqual(s.held_bytes, 5)
        self.assertEqual(s["live_bytes"], 3)
        self.assertEqual(s.get("nope", 7), 7)
        self.assertIn("peak_held_bytes", s)
        with self.assertRaises(KeyError):
            s["nope"]
        d = s.as_dict()
        self.assertEqual(list(d), [f for f, _ in _lib.StatsStruct._fields_ if f != "size"])
        self.assertEqual(d, dict(s.items()))
        self.assertEqual(dict(zip(s.keys(), s.values())), d)
        self.assertEqual(len(s), len(d))
        self.assertIn("held_bytes=5", repr(s))
        self.assertEqual(s, cuvmm.Stats(**d))


class TestContext(unittest.TestCase):
    def test_life_cycle(self):
        ctx = new_ctx()
        self.assertEqual(ctx.backend, BACKEND)
        self.assertGreaterEqual(ctx.device_count, 1)
        self.assertFalse(ctx.closed)
        s = ctx.stats(0)
        self.assertEqual(s.live_bytes, 0)
        ctx.trim()
        ctx.trim(0, keep_bytes=MiB)
        ctx.close()
        ctx.close()  # idempotent
        self.assertTrue(ctx.closed)
        for call in (lambda: ctx.stats(0), ctx.trim, lambda: ctx.pool("x"), lambda: ctx.backend):
            with self.assertRaises(cuvmm.ClosedError) as cm:
                call()
            self.assertIsInstance(cm.exception, cuvmm.Error)
            self.assertIsInstance(cm.exception, ValueError)
            self.assertEqual(cm.exception.name, "CUVMM_EINVAL")
            self.assertIn("closed", str(cm.exception))
        self.assertIn("closed", repr(ctx))

    def test_context_manager(self):
        with new_ctx() as ctx:
            self.assertIn(BACKEND, repr(ctx))
        self.assertTrue(ctx.closed)

    def test_config(self):
        with new_ctx(device_limit_bytes=8 * MiB, retain_bytes=0) as ctx:
            with ctx.pool("cap") as pool:
                p = pool.malloc(4 * MiB)
                with self.assertRaises(cuvmm.OutOfMemory) as cm:
                    pool.malloc(8 * MiB)
                self.assertEqual(cm.exception.code, cuvmm.ENOMEM)
                pool.free(p)
        with self.assertRaises(ValueError):
            cuvmm.Context(backend="tpu")
        with self.assertRaises(cuvmm.InvalidArgument):
            cuvmm.Context(retain_bytes=-1)
        with self.assertRaises(cuvmm.InvalidArgument):
            cuvmm.Context(release_delay_ms=-2)

    @host_only
    def test_host_config(self):
        with self.assertRaises(cuvmm.InvalidArgument) as cm:
            cuvmm.Context(backend="host", host_granularity=3 * 4096)
        self.assertEqual(cm.exception.function, "cuvmm_ctx_create")
        with cuvmm.Context(backend=cuvmm.Backend.HOST, host_granularity=4 * MiB) as ctx:
            with ctx.region(16 * MiB) as r:
                self.assertEqual(r.granularity, 4 * MiB)

    def test_bad_device(self):
        with new_ctx() as ctx:
            n = ctx.device_count
            with self.assertRaises(cuvmm.InvalidArgument):
                ctx.stats(n)
            with self.assertRaises(cuvmm.InvalidArgument):
                ctx.trim(n)
            with self.assertRaises(cuvmm.NoDevice):
                ctx.pool("x", device=n)
            with self.assertRaises(cuvmm.NoDevice):
                ctx.region(MiB, device=n)

    def test_close_closes_children(self):
        ctx = new_ctx()
        pool = ctx.pool("p")
        region = ctx.region(8 * MiB)
        kv = ctx.kv(4096, 64)
        pool.malloc(1000)
        region.resize(MiB)
        kv.alloc(3)
        ctx.close()
        for obj in (pool, region, kv):
            self.assertTrue(obj.closed, obj)
            with self.assertRaises(cuvmm.ClosedError):
                obj.stats()
            obj.close()

    def test_child_keeps_context_alive(self):
        pool = new_ctx().pool("orphan")
        gc.collect()
        self.assertFalse(pool.context.closed)
        pool.free(pool.malloc(4096))
        ctx = pool.context
        del pool
        gc.collect()
        self.assertFalse(ctx.closed)  # only the pool went
        self.assertEqual(len(ctx._s.children), 0)
        ctx.close()

    def test_garbage_collection(self):
        # Objects dropped without close(): __del__ destroys them, children before their context.
        for _ in range(3):
            ctx = new_ctx()
            pool = ctx.pool("gc")
            pool.malloc(MiB)
            ctx.region(4 * MiB).resize(MiB)
            del ctx, pool
            gc.collect()

    def test_interpreter_exit_with_open_objects(self):
        code = ("import cuvmm\n"
                "ctx = cuvmm.Context(release_delay_ms=0)\n"
                "pool = ctx.pool('left'); p = pool.malloc(1 << 20)\n"
                "r = ctx.region(1 << 24); r.resize(1 << 21)\n"
                "kv = ctx.kv(4096, 100); kv.alloc(5)\n"
                "cuvmm.set_log_callback(lambda lvl, msg: None)\n"
                "cycle = [pool]; cycle.append(cycle)\n"
                "print('ok')\n")
        r = run_python(code)
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertEqual(r.stdout.strip(), "ok")


class TestPool(unittest.TestCase):
    def setUp(self):
        self.ctx = new_ctx()
        self.pool = self.ctx.pool("test")

    def tearDown(self):
        self.ctx.close()

    def test_malloc_free(self):
        ptrs = [self.pool.malloc(n) for n in (1, 256, 1000, MiB, 3 * MiB + 5)]
        for p in ptrs:
            self.assertIsInstance(p, int)
            self.assertEqual(p % 256, 0)
        self.assertEqual(len(set(ptrs)), len(ptrs))
        s = self.pool.stats()
        self.assertGreaterEqual(s.live_bytes, 1 + 256 + 1000 + MiB + 3 * MiB + 5)
        for p in ptrs:
            self.pool.free(p)
        self.pool.free(None)
        self.pool.free(0)
        self.assertEqual(self.pool.stats().live_bytes, 0)
        self.assertEqual(self.pool.name, "test")
        self.assertIn("test", repr(self.pool))

    @host_only
    def test_contents(self):
        data = {}
        for i, n in enumerate((100, 4096, MiB, 5 * MiB)):
            p = self.pool.malloc(n)
            data[p] = pattern(i, min(n, 4096))
            poke(p, data[p])
            if n > len(data[p]):
                poke(p + n - 1, b"\xab")
        for p, d in data.items():
            self.assertEqual(peek(p, len(d)), d)

    def test_errors(self):
        with self.assertRaises(cuvmm.Error) as cm:
            self.pool.malloc(0)
        self.assertEqual((cm.exception.code, cm.exception.name), (cuvmm.EINVAL, "CUVMM_EINVAL"))
        self.assertEqual(cm.exception.function, "cuvmm_malloc")
        self.assertEqual(str(cm.exception), "cuvmm_malloc: invalid argument")
        p = self.pool.malloc(4096)
        self.pool.free(p)
        with self.assertRaises(cuvmm.InvalidArgument) as cm:
            self.pool.free(p)  # double free
        self.assertEqual(cm.exception.name, "CUVMM_EINVAL")
        with self.assertRaises(cuvmm.InvalidArgument):
            self.pool.free(12345 * 4096)  # not this pool's
        with self.assertRaises(TypeError):
            self.pool.malloc(16, stream="default")
        with self.assertRaises((cuvmm.Error, OverflowError)):
            self.pool.malloc(1 << 62)

    def test_streams(self):
        class TorchLikeStream:
            cuda_stream = 0x5000

        class CtypesStream:
            _as_parameter_ = ctypes.c_void_p(0x6000)

        if not HOST:
            self.skipTest("fake stream handles: host backend only")
        for s in (0, None, 0x4000, ctypes.c_void_p(0x4000), TorchLikeStream(), CtypesStream()):
            p = self.pool.malloc(1000, stream=s)
            self.pool.free(p, stream=s)
        self.assertEqual(self.pool.stats().live_bytes, 0)

    def test_sleep_wake(self):
        p = self.pool.malloc(3 * MiB)
        q = self.pool.malloc(1000)
        d1, d2 = pattern(1, 4096), pattern(2, 1000)
        if HOST:
            poke(p + MiB, d1)
            poke(q, d2)
        live = self.pool.stats().live_bytes
        self.pool.sleep()  # offload
        s = self.pool.stats()
        self.assertEqual((s.held_bytes, s.mapped_bytes, s.live_bytes), (0, 0, live))
        for call in (lambda: self.pool.malloc(10), lambda: self.pool.free(q), self.pool.sleep):
            with self.assertRaises(cuvmm.StateError) as cm:
                call()
            self.assertEqual(cm.exception.name, "CUVMM_ESTATE")
        self.pool.wake()
        with self.assertRaises(cuvmm.StateError):
            self.pool.wake()
        self.assertEqual(self.pool.stats().live_bytes, live)
        if HOST:
            self.assertEqual(peek(p + MiB, len(d1)), d1)
            self.assertEqual(peek(q, len(d2)), d2)
        self.pool.sleep(offload=False)
        self.pool.wake()
        self.pool.free(p)
        self.pool.free(q)

    def test_trim(self):
        ptrs = [self.pool.malloc(MiB) for _ in range(8)]
        for p in ptrs:
            self.pool.free(p)
        self.assertGreater(self.pool.stats().held_bytes, 0)
        self.pool.trim()
        self.assertEqual(self.pool.stats().held_bytes, 0)
        self.ctx.trim()
        self.assertEqual(self.ctx.stats(0).held_bytes, 0)

    def test_stats_invariants(self):
        ptrs = []
        for i in range(200):
            ptrs.append(self.pool.malloc(1000 + i * 9000))
            if i % 3 == 2:
                self.pool.free(ptrs.pop(len(ptrs) // 2))
            s = self.pool.stats()
            self.assertLessEqual(s.live_bytes, s.mapped_bytes)
            self.assertLessEqual(s.mapped_bytes, s.held_bytes)
            self.assertLessEqual(s.held_bytes, s.reserved_bytes)
            self.assertLessEqual(s.held_bytes, s.peak_held_bytes)
            self.assertLessEqual(s.live_bytes, s.peak_live_bytes)
            c = self.ctx.stats(0)
            self.assertGreaterEqual(c.held_bytes, s.held_bytes)
            self.assertEqual(c.live_bytes, s.live_bytes)
        self.assertGreater(self.ctx.stats(0).map_calls, 0)

    def test_sleep_prepare(self):
        p = self.pool.malloc(5 * MiB)
        if HOST:
            poke(p + MiB, pattern(3, 4096))
        regs = self.ctx.call_count("host_register")
        self.pool.sleep_prepare()
        self.assertGreater(self.ctx.call_count("host_register"), regs)
        regs = self.ctx.call_count("host_register")
        self.pool.sleep()
        self.assertEqual(self.ctx.call_count("host_register"), regs)  # the prepared copy served it
        with self.assertRaises(cuvmm.StateError):
            self.pool.sleep_prepare()
        self.pool.wake()
        if HOST:
            self.assertEqual(peek(p + MiB, 4096), pattern(3, 4096))
        self.pool.free(p)

    def test_coarse_bytes(self):
        # 64 MiB allocations: one handle each with coarse_bytes, one per 2 MiB granule without (packed).
        for coarse, handles in ((64 * MiB, 1), (0, 32)):
            with self.ctx.pool("weights", coarse_bytes=coarse) as pool:
                creates = self.ctx.call_count("create")
                ptrs = [pool.malloc(64 * MiB) for _ in range(4)]
                self.assertEqual(self.ctx.call_count("create") - creates, 4 * handles, coarse)
                for p in ptrs:
                    pool.free(p)
                releases = self.ctx.call_count("release")
                pool.trim()
                self.assertEqual(self.ctx.call_count("release") - releases, 4 * handles, coarse)
                self.assertEqual(pool.stats().held_bytes, 0)
        with self.assertRaises(cuvmm.InvalidArgument):
            self.ctx.pool("x", coarse_bytes=-1)

    def test_use_after_close(self):
        self.pool.close()
        with self.assertRaises(cuvmm.ClosedError) as cm:
            self.pool.malloc(16)
        self.assertIn("'test'", str(cm.exception))
        self.pool.close()


class TestLimits(unittest.TestCase):
    """Ints that the C types cannot hold: ctypes would wrap them silently (-1 to SIZE_MAX, 2**32 to 0)."""

    def test_out_of_range_ints(self):
        with new_ctx() as ctx, ctx.pool("lim") as pool, ctx.region(8 * MiB) as r, ctx.kv(4096, 64) as kv:
            g = r.granularity
            calls = [
                lambda: pool.malloc(-1), lambda: pool.malloc(1 << 64), lambda: pool.trim(-1),
                lambda: pool.free(-256), lambda: r.map(-g, g), lambda: r.unmap(0, (1 << 64) + g),
                lambda: r.resize(-1), lambda: kv.alloc(1 << 32), lambda: kv.alloc(-1),
                lambda: ctx.stats(1 << 31), lambda: ctx.trim(0, -1), lambda: ctx.pool("x", max_bytes=-1),
                lambda: ctx.pool("x", device=1 << 31), lambda: ctx.region(-1), lambda: ctx.kv(4096, 1 << 32),
                lambda: ctx.kv(-4096, 10), lambda: ctx.inject_fault("map", count=1 << 32),
                lambda: ctx.inject_fault("map", skip=-1), lambda: cuvmm.Context(retain_bytes=1 << 64),
            ]
            for i, call in enumerate(calls):
                with self.assertRaises(cuvmm.InvalidArgument, msg="call %d" % i) as cm:
                    call()
                self.assertEqual(cm.exception.name, "CUVMM_EINVAL")
            with self.assertRaises(IndexError):
                kv.tensor(1 << 32)
            with self.assertRaises(IndexError):
                kv.tensor(-1)
            self.assertEqual(pool.stats().live_bytes, 0)
            self.assertEqual(kv.stats().live_bytes, 0)
            self.assertEqual(ctx.call_count("map"), 0)  # nothing reached the driver
            self.assertEqual(kv.compact(1 << 40), [])

    def test_wrong_kinds(self):
        """A bool or a float where a size is meant is EINVAL, not 1 or a TypeError."""
        with new_ctx() as ctx:
            for kw in (dict(max_bytes=True), dict(coarse_bytes=2.5), dict(max_bytes=None), dict(device=False),
                       dict(peer_access=[True])):
                with self.assertRaises(cuvmm.InvalidArgument, msg=repr(kw)):
                    ctx.pool("x", **kw)
            with self.assertRaises(cuvmm.InvalidArgument):
                ctx.kv(4096.0, 64)
            with self.assertRaises(cuvmm.InvalidArgument):
                cuvmm.Context(release_delay_ms=1.5)
            cuvmm.Context(background_release=False).close()  # a bool field takes a bool

    def test_object_peer_masks(self):
        """An object's peer_access in Python terms and the C mask it becomes: None is the context's (C 0);
        no devices is the object's own device alone (C 0 would mean the context's); True every device."""
        from cuvmm import _objects
        mask = lambda v, dev=1: _objects.pool_config("f", dev, 0, v).peer_access
        self.assertEqual(mask(None), 0)
        self.assertEqual(mask(False), 1 << 1)
        self.assertEqual(mask([]), 1 << 1)
        self.assertEqual(mask(0, 3), 1 << 3)
        self.assertEqual(mask([0]), 1)
        self.assertEqual(mask(True), (1 << 64) - 1)
        with self.assertRaises(cuvmm.InvalidArgument):
            _objects.pool_config("f", 0, 0, False, any_device=True)


class TestRegion(unittest.TestCase):
    def setUp(self):
        self.ctx = new_ctx()
        self.r = self.ctx.region(64 * MiB)
        self.g = self.r.granularity

    def tearDown(self):
        self.ctx.close()

    def test_properties(self):
        self.assertEqual(self.g, 2 * MiB)
        self.assertEqual(self.r.size, 64 * MiB)
        self.assertIsInstance(self.r.base, int)
        self.assertEqual(self.r.base % self.g, 0)
        with self.ctx.region(5 * MiB + 1) as r2:
            self.assertEqual(r2.size, 6 * MiB)
        with self.ctx.region(64 * MiB, granularity=8 * MiB) as r3:
            self.assertEqual(r3.granularity, 8 * MiB)
            r3.resize(1)
            self.assertEqual(r3.stats().mapped_bytes, 8 * MiB)
        with self.assertRaises(cuvmm.InvalidArgument):
            self.ctx.region(64 * MiB, granularity=3 * MiB)
        with self.assertRaises(cuvmm.InvalidArgument):
            self.ctx.region(0)
        self.assertIn("granularity", repr(self.r))

    def test_map_unmap(self):
        g = self.g
        self.r.map(0, 2 * g)
        self.r.map(4 * g, g)
        s = self.r.stats()
        self.assertEqual((s.mapped_bytes, s.live_bytes, s.reserved_bytes), (3 * g, 3 * g, 64 * MiB))
        self.r.unmap(0, g)
        self.r.unmap(8 * g, g)  # not mapped: ignored
        self.assertEqual(self.r.stats().live_bytes, 2 * g)
        for bad in ((1, g), (0, 0), (0, g + 1), (self.r.size, g), (self.r.size - g, 2 * g)):
            with self.assertRaises(cuvmm.InvalidArgument, msg=bad):
                self.r.map(*bad)
            with self.assertRaises(cuvmm.InvalidArgument, msg=bad):
                self.r.unmap(*bad)

    def test_resize_keeps_contents(self):
        self.r.resize(3 * MiB)
        self.assertEqual(self.r.stats().mapped_bytes, 4 * MiB)
        d = pattern(3, 4096)
        if HOST:
            poke(self.r.base + 3 * MiB - 4096, d)
        self.r.resize(40 * MiB)
        self.assertEqual(self.r.stats().mapped_bytes, 40 * MiB)
        if HOST:
            self.assertEqual(peek(self.r.base + 3 * MiB - 4096, 4096), d)
            poke(self.r.base + 40 * MiB - 1, b"x")
        self.r.resize(4 * MiB)
        self.assertEqual(self.r.stats().live_bytes, 4 * MiB)
        if HOST:
            self.assertEqual(peek(self.r.base + 3 * MiB - 4096, 4096), d)
        self.r.resize(0)
        self.assertEqual(self.r.stats().live_bytes, 0)
        with self.assertRaises(cuvmm.InvalidArgument):
            self.r.resize(self.r.size + 1)

    def test_sleep_wake(self):
        self.r.resize(6 * MiB)
        d = pattern(4, 8192)
        if HOST:
            poke(self.r.base + 5 * MiB, d)
        self.r.sleep(offload=True)
        self.assertEqual(self.r.stats().held_bytes, 0)
        with self.assertRaises(cuvmm.StateError):
            self.r.resize(MiB)
        with self.assertRaises(cuvmm.StateError):
            self.r.sleep()
        self.r.wake()
        self.assertEqual(self.r.stats().mapped_bytes, 6 * MiB)
        if HOST:
            self.assertEqual(peek(self.r.base + 5 * MiB, len(d)), d)
        with self.assertRaises(cuvmm.StateError):
            self.r.wake()


class TestKV(unittest.TestCase):
    def setUp(self):
        self.ctx = new_ctx()
        self.bb = 16 * 8 * 128 * 2  # 32 KiB: 64 blocks per 2 MiB page
        self.kv = self.ctx.kv(self.bb, 1024, tensors=4)

    def tearDown(self):
        self.ctx.close()

    def test_alloc_free(self):
        ids = self.kv.alloc(10)
        self.assertEqual(len(set(ids)), 10)
        self.assertTrue(all(0 <= i < 1024 for i in ids))
        s = self.kv.stats()
        self.assertEqual(s.live_bytes, 10 * self.bb * 4)
        self.assertEqual(s.mapped_bytes, 4 * 2 * MiB)  # one page in each tensor
        self.assertEqual(self.kv.address(2, 5), self.kv.tensor(2) + 5 * self.bb)
        if HOST:
            for t in range(4):
                for b in ids:
                    poke(self.kv.address(t, b), pattern(t * 100 + b, 64))
            for t in range(4):
                for b in ids:
                    self.assertEqual(peek(self.kv.address(t, b), 64), pattern(t * 100 + b, 64))
        self.kv.free(ids[:5])
        self.kv.free(ids[5:], stream=0)
        self.assertEqual(self.kv.stats().live_bytes, 0)
        self.assertIn("tensors=4", repr(self.kv))

    def test_errors(self):
        with self.assertRaises(cuvmm.InvalidArgument):
            self.kv.alloc(0)
        with self.assertRaises(IndexError):
            self.kv.tensor(4)
        ids = self.kv.alloc(2)
        with self.assertRaises(cuvmm.InvalidArgument):
            self.kv.free([ids[0], ids[0]])  # twice in one list: nothing freed
        self.assertEqual(self.kv.stats().live_bytes, 2 * self.bb * 4)
        with self.assertRaises(cuvmm.InvalidArgument):
            self.kv.free([])
        with self.assertRaises(cuvmm.InvalidArgument):
            self.kv.free([-1])
        self.kv.free(ids)
        with self.assertRaises(cuvmm.InvalidArgument):
            self.kv.free(ids)  # double free
        with self.assertRaises(cuvmm.NoSpace):
            self.kv.alloc(1025)
        with self.assertRaises(cuvmm.InvalidArgument):
            self.ctx.kv(0, 10)

    def test_compact(self):
        ids = self.kv.alloc(64 * 4)  # four full pages
        keep = [b for b in ids if b % 64 < 40 or b >= 192]  # three sparse pages, one full
        self.kv.free([b for b in ids if b not in keep])
        moves = self.kv.compact(1000)
        self.assertGreater(len(moves), 0)
        froms = [m[0] for m in moves]
        tos = [m[1] for m in moves]
        self.assertTrue(set(froms) <= set(keep))
        self.assertFalse(set(tos) & set(keep))
        if HOST:
            for f, t in moves:
                poke(self.kv.address(0, f), b"m" * 16)
                ctypes.memmove(self.kv.address(0, t), self.kv.address(0, f), self.bb)
        live = self.kv.stats().live_bytes
        self.kv.free(froms)
        self.assertEqual(self.kv.stats().live_bytes, live - len(froms) * self.bb * 4)
        self.assertEqual(self.kv.compact(0), [])
        self.kv.free([b for b in keep if b not in froms] + tos)
        self.ctx.trim()
        self.assertEqual(self.kv.stats().held_bytes, 0)


class TestFaults(unittest.TestCase):
    def setUp(self):
        self.ctx = new_ctx()

    def tearDown(self):
        self.ctx.close()

    def test_pool_malloc_fault_changes_nothing(self):
        with self.ctx.pool("f") as pool:
            before_pool, before_ctx = pool.stats(), self.ctx.stats(0)
            maps = self.ctx.call_count("map")
            self.ctx.inject_fault("map", skip=0, count=1, err=cuvmm.ENOMEM)
            with self.assertRaises(cuvmm.OutOfMemory) as cm:
                pool.malloc(4 * MiB)
            self.assertEqual((cm.exception.code, cm.exception.name), (-2, "CUVMM_ENOMEM"))
            self.assertGreater(self.ctx.call_count(cuvmm.Call.MAP), maps)
            after = pool.stats()
            for f in ("live_bytes", "mapped_bytes", "held_bytes", "peak_live_bytes"):
                self.assertEqual(after[f], before_pool[f], f)
            self.assertEqual(self.ctx.stats(0).held_bytes, before_ctx.held_bytes)
            p = pool.malloc(4 * MiB)  # the fault is spent
            pool.free(p)

    def test_driver_error(self):
        with self.ctx.region(16 * MiB) as r:
            r.resize(2 * MiB)
            self.ctx.inject_fault(cuvmm.Call.MAP, skip=1, count=1, err=cuvmm.EDRIVER)  # the 2nd of 3 maps
            with self.assertRaises(cuvmm.DriverError) as cm:
                r.resize(8 * MiB)
            self.assertEqual(cm.exception.name, "CUVMM_EDRIVER")
            self.assertEqual(cm.exception.driver_error, 999)  # CUDA_ERROR_UNKNOWN
            self.assertEqual(cuvmm.last_driver_error(), 999)
            s = r.stats()
            self.assertEqual((s.mapped_bytes, s.live_bytes), (2 * MiB, 2 * MiB))
            r.resize(8 * MiB)
            self.assertEqual(r.stats().mapped_bytes, 8 * MiB)

    def test_wake_fault_stays_asleep(self):
        with self.ctx.pool("w") as pool:
            p = pool.malloc(6 * MiB)
            d = pattern(9, 4096)
            if HOST:
                poke(p + 4 * MiB, d)
            pool.sleep()
            self.ctx.inject_fault("create", count=0xFFFFFFFF, err="CUVMM_ENOMEM")
            with self.assertRaises(cuvmm.OutOfMemory):
                pool.wake()
            self.assertEqual(pool.stats().held_bytes, 0)
            with self.assertRaises(cuvmm.StateError):
                pool.malloc(1)  # still asleep
            self.ctx.inject_fault("create", count=0)
            pool.wake()
            if HOST:
                self.assertEqual(peek(p + 4 * MiB, len(d)), d)
            pool.free(p)

    def test_kv_fault(self):
        with self.ctx.kv(4096, 2048, tensors=2) as kv:
            self.ctx.inject_fault("map", skip=1, count=1, err=cuvmm.OutOfMemory)
            with self.assertRaises(cuvmm.OutOfMemory):
                kv.alloc(10)
            s = kv.stats()
            self.assertEqual((s.live_bytes, s.mapped_bytes), (0, 0))
            self.assertEqual(len(kv.alloc(10)), 10)

    def test_bad_arguments(self):
        with self.assertRaises(ValueError):
            self.ctx.inject_fault("nosuchcall")
        with self.assertRaises(cuvmm.InvalidArgument):
            self.ctx.inject_fault("map", err=cuvmm.EINVAL)  # only ENOMEM and EDRIVER
        with self.assertRaises(ValueError):
            self.ctx.call_count(99)
        self.assertEqual(self.ctx.call_count("copy"), 0)


class TestIdleRelease(unittest.TestCase):
    def test_release_delay_zero(self):
        with new_ctx(release_delay_ms=0) as ctx, ctx.pool("idle") as pool:
            ptrs = [pool.malloc(MiB) for _ in range(6)]
            self.assertGreater(ctx.stats(0).held_bytes, 0)
            for p in ptrs:
                pool.free(p)
            ctx.trim()
            self.assertEqual(ctx.stats(0).held_bytes, 0)
            self.assertGreater(ctx.stats(0).peak_held_bytes, 0)

    def test_background_release(self):
        with cuvmm.Context(release_delay_ms=50, background_release=True) as ctx:
            pool = ctx.pool("bg")
            r = ctx.region(16 * MiB)
            r.resize(8 * MiB)
            ptrs = [pool.malloc(MiB) for _ in range(6)]
            for p in ptrs:
                pool.free(p)
            r.resize(0)
            deadline = time.monotonic() + 10
            while ctx.stats(0).held_bytes and time.monotonic() < deadline:
                time.sleep(0.02)
            self.assertEqual(ctx.stats(0).held_bytes, 0)  # with no call from us
            self.assertEqual(ctx.stats(0).live_bytes, 0)


class TestLibraryLookup(unittest.TestCase):
    def test_explicit_path(self):
        r = run_python("import cuvmm; print(cuvmm.library_path)", CUVMM_LIBRARY=cuvmm.library_path)
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertEqual(r.stdout.strip(), cuvmm.library_path)

    def test_bad_path(self):
        r = run_python("import cuvmm", CUVMM_LIBRARY="/nonexistent/libcuvmm.so")
        self.assertNotEqual(r.returncode, 0)
        self.assertIn("ImportError", r.stderr)
        self.assertIn("CUVMM_LIBRARY", r.stderr)
        self.assertIn("/nonexistent/libcuvmm.so", r.stderr)

    def test_not_a_library(self):
        r = run_python("import cuvmm", CUVMM_LIBRARY=os.path.abspath(__file__))
        self.assertNotEqual(r.returncode, 0)
        self.assertIn("cannot load libcuvmm.so", r.stderr)
        self.assertIn(os.path.abspath(__file__), r.stderr)


class TestThreads(unittest.TestCase):
    def test_malloc_free_threads(self):
        errors = []
        with new_ctx(release_delay_ms=0) as ctx, ctx.pool("threads") as pool:
            def worker(seed):
                try:
                    mine = []
                    for i in range(400):
                        n = 256 + ((seed * 7919 + i * 104729) % (3 * MiB))
                        p = pool.malloc(n)
                        tag = bytes([seed]) * 64
                        if HOST:
                            poke(p, tag)
                        mine.append((p, tag))
                        if len(mine) > 8:
                            q, t = mine.pop(0)
                            if HOST and peek(q, 64) != t:
                                errors.append("contents of 0x%x changed" % q)
                            pool.free(q)
                    for q, _ in mine:
                        pool.free(q)
                except Exception as e:  # reported below, not lost in the thread
                    errors.append(repr(e))

            threads = [threading.Thread(target=worker, args=(s,)) for s in range(1, 9)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            self.assertEqual(errors, [])
            s = pool.stats()
            self.assertEqual(s.live_bytes, 0)
            self.assertGreater(s.peak_live_bytes, 0)

    def test_close_while_in_use(self):
        # Threads keep calling while the context closes: each call works or raises ClosedError.
        for _ in range(5):
            ctx = new_ctx()
            pool = ctx.pool("race")
            unexpected = []
            started = threading.Barrier(5)

            def worker():
                started.wait()
                try:
                    while True:
                        pool.free(pool.malloc(4096))
                except cuvmm.ClosedError:
                    pass
                except Exception as e:
                    unexpected.append(repr(e))

            threads = [threading.Thread(target=worker) for _ in range(4)]
            for t in threads:
                t.start()
            started.wait()
            time.sleep(0.01)
            ctx.close()
            for t in threads:
                t.join()
            self.assertEqual(unexpected, [])
            self.assertTrue(pool.closed)


class TestMisuse(unittest.TestCase):
    """What an adversarial review found: each case failed (crashed, hung, wrapped or coerced) before."""

    def test_close_racing_a_child_close(self):
        """A child closed on one thread while its context closes on another is destroyed once: the context
        waits for the child's destroy (it segfaulted or aborted every time)."""
        code = """
import cuvmm, threading
for i in range(60):
    ctx = cuvmm.Context(release_delay_ms=-1, background_release=False)
    r = ctx.region(256 << 20); r.resize(16 << 20)
    pool = ctx.pool("p"); ptrs = [pool.malloc(1 << 20) for _ in range(8)]
    kv = ctx.kv(4096, 64); kv.alloc(3)
    ts = [threading.Thread(target=o.close) for o in (r, pool, kv)]
    for t in ts: t.start()
    ctx.close()
    for t in ts: t.join()
    assert r.closed and pool.closed and kv.closed and ctx.closed
print("ok")
"""
        out = run_python(code)
        self.assertEqual(out.returncode, 0, out.stderr[-2000:])
        self.assertIn("ok", out.stdout)

    def test_close_inside_a_log_callback(self):
        """Closing an object from a log callback run by a call on that object (or on a child of the
        context closed) would wait for itself: Busy (swallowed by the callback), and the object stays
        usable; it hung before."""
        code = """
import cuvmm
ctx = cuvmm.Context(release_delay_ms=-1, background_release=False)
pool = ctx.pool("x")
seen = []
def cb(lvl, msg):
    for o in (pool, ctx):
        try:
            o.close()
        except cuvmm.Busy as e:
            seen.append(type(o).__name__)
cuvmm.set_log_callback(cb, "debug")
ctx.inject_fault("create", count=1, err=cuvmm.EDRIVER)
try:
    pool.malloc(1 << 20)
except cuvmm.DriverError:
    pass
cuvmm.set_log_callback(None)
assert "Pool" in seen and "Context" in seen, seen
assert not pool.closed and not ctx.closed
pool.free(pool.malloc(1 << 20))
ctx.close()
print("ok")
"""
        out = run_python(code)
        self.assertEqual(out.returncode, 0, out.stderr[-2000:])
        self.assertIn("ok", out.stdout)

    def test_copy_and_pickle_refused(self):
        """A copy would share the C object, and dropping it closed the original."""
        import copy
        import pickle
        with new_ctx() as ctx:
            pool = ctx.pool("w")
            for obj in (ctx, pool):
                with self.assertRaises(TypeError):
                    copy.copy(obj)
                with self.assertRaises(TypeError):
                    copy.deepcopy(obj)
                with self.assertRaises(TypeError):
                    pickle.dumps(obj)
            self.assertFalse(ctx.closed or pool.closed)
            e = pickle.loads(pickle.dumps(cuvmm.ClosedError("Pool 'w'")))
            self.assertIs(type(e), cuvmm.ClosedError)
            self.assertIn("Pool 'w' is closed", str(e))

    def test_addresses_and_streams_do_not_wrap(self):
        """p + 2**64 freed p; a stream of 2**64 became NULL; name lookups wrapped into real codes."""
        with new_ctx() as ctx:
            pool = ctx.pool("w")
            p = pool.malloc(4096)
            for bad in (p + (1 << 64), 1 << 64, -p):
                with self.assertRaises(cuvmm.InvalidArgument, msg=hex(bad)):
                    pool.free(bad)
            with self.assertRaises(cuvmm.InvalidArgument):
                pool.sleep(stream=1 << 64)
            with self.assertRaises(cuvmm.InvalidArgument):
                pool.malloc(4096, stream=-1)
            for bad in ("x", 2.5, True):
                with self.assertRaisesRegex(cuvmm.InvalidArgument, "not an address", msg=repr(bad)):
                    pool.free(bad)
            self.assertEqual(pool.stats().live_bytes, 4096)
            pool.free(p)
        self.assertEqual(cuvmm.strerror((1 << 32) - 1), "unknown error")
        self.assertEqual(cuvmm.strerror(1 << 40), "unknown error")
        self.assertEqual(cuvmm.err_name(-1 - (1 << 32)), "CUVMM_E?")
        self.assertEqual(cuvmm.call_name(1 << 33), "?")
        with self.assertRaises(TypeError):
            cuvmm.strerror(-1.0)

    def test_method_arguments_of_the_wrong_kind(self):
        """True became 1 and 2.5 raised ctypes.ArgumentError; now EINVAL naming the argument."""
        with new_ctx() as ctx:
            pool, kv, r = ctx.pool("w"), ctx.kv(4096, 64), ctx.region(64 * MiB)
            calls = [lambda: pool.malloc(True), lambda: pool.malloc(2.5), lambda: ctx.region(True),
                     lambda: pool.trim(True), lambda: ctx.stats(None), lambda: ctx.trim(0, 2.5),
                     lambda: r.map(0, 2.5), lambda: kv.alloc(True), lambda: kv.alloc(2.5),
                     lambda: kv.compact("1"), lambda: cuvmm.Context(retain_bytes="1G"),
                     lambda: cuvmm.Context(background_release="off"),
                     lambda: cuvmm.Context(background_release=2)]
            for i, call in enumerate(calls):
                with self.assertRaises(cuvmm.InvalidArgument, msg="call %d" % i) as cm:
                    call()
                self.assertRegex(str(cm.exception), "not an integer|not a bool|not an address", "call %d" % i)
            self.assertEqual(pool.stats().live_bytes, 0)
            self.assertEqual(kv.stats().live_bytes, 0)
            with self.assertRaises(TypeError):
                ctx.call_count(True)
            with self.assertRaises(TypeError):
                ctx.inject_fault(True)
            with self.assertRaises(TypeError):
                ctx.inject_fault("map", err=-2.5)
            with self.assertRaises(ValueError):
                ctx.inject_fault("map", err="bogus")

    def test_kv_counts_and_addresses(self):
        """alloc(n) made an array of n ids before any check (2**32 - 1: 16 GiB); compact sized its array by
        the argument; address() took any block."""
        with new_ctx() as ctx:
            kv = ctx.kv(4096, 64, tensors=2)
            with self.assertRaises(cuvmm.NoSpace):
                kv.alloc(0xFFFFFFFF)
            with self.assertRaises(cuvmm.InvalidArgument):
                kv.alloc(1 << 32)
            ids = kv.alloc(3)
            self.assertEqual(len(kv.compact(1 << 40)) <= 3, True)
            self.assertEqual(kv.address(1, 2), kv.tensor(1) + 2 * 4096)
            for bad in (-1, 64):
                with self.assertRaises(IndexError):
                    kv.address(0, bad)
            for bad in ([True], [2.5], ["1"], [ids[0], None]):
                with self.assertRaises(cuvmm.InvalidArgument, msg=repr(bad)):
                    kv.free(bad)
            self.assertEqual(kv.stats().live_bytes, 3 * 2 * 4096)
            with self.assertRaises(TypeError):
                kv.address(0, 2.5)
            kv.free(ids)

    def test_pool_names(self):
        """C copies at most 31 bytes and stops at a NUL; other kinds became their str()."""
        with new_ctx() as ctx:
            for bad in ("a\0b", b"x", 123, "n" * 32, "\u00e9" * 16):
                with self.assertRaises(cuvmm.InvalidArgument, msg=repr(bad)):
                    ctx.pool(bad)
            self.assertEqual(ctx.pool("n" * 31).name, "n" * 31)
            ctx.pool(None).close()

    def test_log_levels(self):
        """"warning" is CUVMM_LOG's word too; a bad level or callback says so."""
        cuvmm.set_log_callback(lambda lvl, msg: None, "warning")
        cuvmm.set_log_callback(None)
        with self.assertRaises(ValueError):
            cuvmm.set_log_callback(lambda lvl, msg: None, "loud")
        with self.assertRaises(TypeError):
            cuvmm.set_log_callback(5)


class TestLogCallback(unittest.TestCase):
    def test_callback(self):
        got = []
        cuvmm.set_log_callback(lambda lvl, msg: got.append((lvl, msg)), "info")
        try:
            with new_ctx():
                pass
        finally:
            cuvmm.set_log_callback(None)
        self.assertTrue(got)
        self.assertTrue(all(isinstance(lvl, cuvmm.LogLevel) and isinstance(m, str) for lvl, m in got))
        self.assertTrue(any("context" in m for _, m in got))
        n = len(got)
        with new_ctx():
            pass
        self.assertEqual(len(got), n)  # reset: no more calls

    def test_callback_exception_is_contained(self):
        def bad(lvl, msg):
            raise RuntimeError("from the callback")
        cuvmm.set_log_callback(bad, cuvmm.LogLevel.DEBUG)
        try:
            with new_ctx() as ctx:
                ctx.pool("x").close()
        finally:
            cuvmm.set_log_callback(None)


if __name__ == "__main__":
    unittest.main()
