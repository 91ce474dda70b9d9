"""cuvmm.torch against real PyTorch on a GPU. Each scenario runs in a fresh interpreter, since the
allocator must be installed before the first CUDA allocation. Without torch or a GPU every test reports
itself skipped; the one test that needs neither (importing cuvmm.torch without torch) always runs."""
import os
import subprocess
import sys
import textwrap

import pytest


def _torch_gpu():
    try:
        import torch
    except Exception:
        return False
    return torch.cuda.is_available() and os.environ.get("CUVMM_BACKEND", "cuda") != "host"


needs_gpu = pytest.mark.skipif(not _torch_gpu(), reason="needs torch with a CUDA GPU (and CUVMM_BACKEND not host)")


# What every scenario starts with: the imports, and a check that configure_pool refuses with a given code.
PRELUDE = """import cuvmm, cuvmm.torch, torch, time, gc


def configure_fails(code, name, **kw):
    try:
        cuvmm.torch.configure_pool(name, **kw)
    except cuvmm.Error as e:
        assert e.code == code, (name, kw, e)
    else:
        raise AssertionError("configure_pool(%r, %r) was accepted" % (name, kw))
"""


def run(code, env=None, timeout=600):
    e = dict(os.environ)
    e.pop("CUVMM_BACKEND", None)
    e.update(env or {})
    r = subprocess.run([sys.executable, "-c", PRELUDE + textwrap.dedent(code)], env=e, capture_output=True,
                       text=True, timeout=timeout)
    assert r.returncode == 0, "scenario failed:\nstdout:\n%s\nstderr:\n%s" % (r.stdout, r.stderr[-6000:])
    return r.stdout


def test_import_without_torch():
    here = os.path.dirname(os.path.abspath(__file__))
    out = subprocess.run([sys.executable, os.path.join(here, "torch_import_check.py")], capture_output=True,
                         text=True)
    assert out.returncode == 0, out.stdout + out.stderr


@needs_gpu
def test_enable_after_allocation_says_what_to_do():
    run("""
        x = torch.ones(1, device='cuda')
        try:
            cuvmm.torch.enable()
        except RuntimeError as e:
            assert 'python -m cuvmm.torch' in str(e), e
        else:
            raise AssertionError('no error')
    """)


@needs_gpu
def test_memory_api_reports_cuvmm():
    run("""
        cuvmm.torch.enable(release_delay_ms=200)
        assert cuvmm.torch.enabled()
        MiB = 1 << 20
        x = torch.empty(256 * MiB, dtype=torch.uint8, device='cuda')
        a = torch.cuda.memory_allocated()
        assert a >= 256 * MiB, a
        assert torch.cuda.memory_reserved() >= a
        assert torch.cuda.max_memory_allocated() >= a
        assert torch.cuda.max_memory_reserved() >= torch.cuda.memory_reserved()
        st = torch.cuda.memory_stats()
        for k in ('allocated_bytes.all.current', 'reserved_bytes.all.peak', 'num_ooms', 'active_bytes.all.current'):
            assert k in st, k
        assert isinstance(torch.cuda.memory_summary(), str)
        free0, total = torch.cuda.mem_get_info()
        del x
        assert torch.cuda.memory_allocated() < 256 * MiB
        torch.cuda.reset_peak_memory_stats()
        assert torch.cuda.max_memory_allocated() < 256 * MiB
        torch.cuda.empty_cache()
        assert torch.cuda.memory_reserved() < 64 * MiB, torch.cuda.memory_reserved()
        free1, _ = torch.cuda.mem_get_info()
        assert free1 - free0 > 200 * MiB, (free0, free1)
        torch.cuda.reset_accumulated_memory_stats()
        try:
            torch.cuda.set_per_process_memory_fraction(0.5)
        except RuntimeError as e:
            assert 'device_limit_bytes' in str(e), e
        else:
            raise AssertionError('set_per_process_memory_fraction was accepted and ignored')
        try:
            torch.cuda.MemPool()
        except RuntimeError as e:
            assert 'cuvmm.torch.pool' in str(e), e
        else:
            raise AssertionError('MemPool was accepted')
    """)


@needs_gpu
def test_idle_release_without_empty_cache():
    run("""
        cuvmm.torch.enable(release_delay_ms=300)
        MiB = 1 << 20
        xs = [torch.randn(64, 1024, 1024, device='cuda') for _ in range(4)]  # 1 GiB
        free0, _ = torch.cuda.mem_get_info()
        del xs
        gc.collect()
        time.sleep(1.0)
        free1, _ = torch.cuda.mem_get_info()
        assert free1 - free0 > 900 * MiB, (free0, free1)
        assert torch.cuda.memory_reserved() < 64 * MiB
    """)


@needs_gpu
def test_graph_capture_global_mode_with_background_release():
    run("""
        cuvmm.torch.enable(release_delay_ms=10)
        lin = torch.nn.Linear(512, 512, device='cuda')
        x = torch.randn(64, 512, device='cuda')
        # memory for the background thread to give back during the capture
        junk = [torch.empty(8 << 20, dtype=torch.uint8, device='cuda') for _ in range(16)]
        del junk
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(3):
                y = torch.relu(lin(x))
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            time.sleep(0.1)  # the background pass runs while the capture is under way
            y = torch.relu(lin(x))
            z = y * 2
        # other streams allocate and free in between
        s2 = torch.cuda.Stream()
        with torch.cuda.stream(s2):
            tmp = [torch.randn(1 << 20, device='cuda') for _ in range(8)]
            del tmp
        torch.cuda.synchronize()
        for i in range(3):
            x.copy_(torch.randn(64, 512, device='cuda'))
            g.replay()
            torch.cuda.synchronize()
            ref = torch.relu(lin(x)) * 2
            assert torch.allclose(z, ref), (z - ref).abs().max()
        pools = cuvmm.torch.graph_pools()
        assert len(pools) == 1, pools
        del g, y, z
        gc.collect()
        assert cuvmm.torch.graph_pools() == {}
    """)


@needs_gpu
def test_shared_graph_pool_and_make_graphed_callables():
    run("""
        cuvmm.torch.enable(release_delay_ms=50)
        pool = torch.cuda.graph_pool_handle()
        a = torch.randn(1024, device='cuda'); b = torch.randn(1024, device='cuda')
        g1, g2 = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
        torch.cuda.synchronize()
        with torch.cuda.graph(g1, pool=pool):
            o1 = a * 2 + 1
        with torch.cuda.graph(g2, pool=pool):
            o2 = o1 * 3
        g1.replay(); g2.replay(); torch.cuda.synchronize()
        assert torch.allclose(o2, (a * 2 + 1) * 3)
        assert len(cuvmm.torch.graph_pools()) == 1
        model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU(), torch.nn.Linear(64, 8)).cuda()
        inp = torch.randn(16, 64, device='cuda', requires_grad=True)
        gm = torch.cuda.make_graphed_callables(model, (inp,))
        x = torch.randn(16, 64, device='cuda', requires_grad=True)
        out = gm(x)
        ref = model(x)
        assert torch.allclose(out, ref, atol=1e-5)
        out.sum().backward()
    """)


@needs_gpu
def test_torch_compile_reduce_overhead():
    run("""
        cuvmm.torch.enable()
        model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256)).cuda()
        f = torch.compile(model, mode='reduce-overhead')
        with torch.no_grad():
            for i in range(5):
                x = torch.randn(32, 256, device='cuda')
                y = f(x)
                assert torch.allclose(y, model(x), atol=1e-4, rtol=1e-4), i
        print('compiled ok')
    """, timeout=900)


@needs_gpu
def test_record_stream_and_threads():
    run("""
        import threading
        cuvmm.torch.enable(release_delay_ms=20)
        s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
        for _ in range(20):
            with torch.cuda.stream(s1):
                x = torch.ones(4 << 20, device='cuda')
            s2.wait_stream(s1)
            with torch.cuda.stream(s2):
                y = x * 3  # x is used on s2
                x.record_stream(s2)
            del x
            with torch.cuda.stream(s1):
                w = torch.zeros(4 << 20, device='cuda')  # must not clobber x under s2's kernel
            torch.cuda.synchronize()
            assert float(y[0]) == 3.0 and float(y.sum()) == 3.0 * (4 << 20)
        errors = []
        def work():
            try:
                for _ in range(50):
                    t = torch.randn(1 << 16, device='cuda')
                    assert float((t - t).abs().sum()) == 0.0
            except Exception as e:
                errors.append(e)
        ts = [threading.Thread(target=work) for _ in range(4)]
        [t.start() for t in ts]; [t.join() for t in ts]
        assert not errors, errors
    """)


@needs_gpu
def test_named_pool_sleep_wake_keeps_graphs_and_tokens():
    run("""
        from transformers import Qwen2Config, Qwen2ForCausalLM
        cuvmm.torch.enable(release_delay_ms=100)
        torch.manual_seed(0)
        cfg = Qwen2Config(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
        with cuvmm.torch.pool('weights'):
            model = Qwen2ForCausalLM(cfg).to('cuda', torch.bfloat16).eval()
        ids = torch.randint(0, 512, (1, 16), device='cuda')
        with torch.no_grad():
            t0 = model.generate(ids, max_new_tokens=16, do_sample=False)
        lin = model.model.layers[0].mlp.up_proj
        x = torch.randn(4, 128, device='cuda', dtype=torch.bfloat16)
        g = torch.cuda.CUDAGraph()
        with torch.no_grad():
            y0 = lin(x).clone()
            torch.cuda.synchronize()
            with torch.cuda.graph(g):
                y = lin(x)
        held0 = cuvmm.torch.stats()['reserved_bytes']
        cuvmm.torch.sleep_prepare('weights')  # the sleep copies into memory pinned now
        cuvmm.torch.sleep('weights', offload=True)
        held1 = cuvmm.torch.stats()['reserved_bytes']
        assert held1 < held0, (held0, held1)
        cuvmm.torch.wake('weights')
        g.replay(); torch.cuda.synchronize()
        assert torch.equal(y, y0)
        with torch.no_grad():
            t1 = model.generate(ids, max_new_tokens=16, do_sample=False)
        assert torch.equal(t0, t1), (t0, t1)
    """)


@needs_gpu
def test_configured_pool_takes_large_handles():
    run("""
        import cuvmm
        from cuvmm._lib import lib
        cuvmm.torch.configure_pool('weights', coarse_bytes=64 << 20)  # before enable() works too
        for bad in (dict(coarse_bytes=-1), dict(max_bytes=1 << 64), dict(peer_access=[99])):
            configure_fails(cuvmm.EINVAL, 'other', **bad)
        cuvmm.torch.enable(release_delay_ms=-1)
        ctx = lib.cuvmm_torch_ctx()
        creates = lambda: lib.cuvmm_ctx_call_count(ctx, cuvmm.Call.CREATE)
        c0 = creates()
        with cuvmm.torch.pool('weights'):
            w = [torch.full((32 << 20,), i, dtype=torch.int16, device='cuda') for i in range(8)]  # 64 MiB each
        c1 = creates()
        assert c1 - c0 == 8, c1 - c0  # one handle per tensor
        x = torch.ones(64 << 20, dtype=torch.uint8, device='cuda')  # the default pool: 2 MiB handles
        assert creates() - c1 == 32, creates() - c1
        configure_fails(cuvmm.ESTATE, 'weights', coarse_bytes=1 << 20)  # after first use
        held = cuvmm.torch.stats()['reserved_bytes']
        cuvmm.torch.sleep('weights')
        assert cuvmm.torch.stats()['reserved_bytes'] <= held - (512 << 20)
        cuvmm.torch.wake('weights')
        for i, t in enumerate(w):
            assert int(t[0]) == i and int(t[-1]) == i and bool((t == i).all()), i
        assert int(x.sum()) == 64 << 20
    """)


@needs_gpu
def test_first_allocations_inside_a_capture():
    run("""
        import cuvmm
        from cuvmm._lib import lib
        cuvmm.torch.configure_pool('w', coarse_bytes=32 << 20)
        cuvmm.torch.enable(release_delay_ms=10)
        g = torch.cuda.CUDAGraph()
        # The process's first tensors are made inside a capture (global mode, PyTorch's default), and the
        # configured pool is created there: its reservation and its first mappings happen during the capture.
        with torch.cuda.graph(g):
            x = torch.empty(1 << 20, device='cuda')  # no kernel: filled outside, before each replay
            ctx = lib.cuvmm_torch_ctx()
            c0 = lib.cuvmm_ctx_call_count(ctx, cuvmm.Call.CREATE)
            with cuvmm.torch.pool('w'):
                w = torch.ones(16 << 20, device='cuda')  # 64 MiB on one handle (default pool: 32)
            c1 = lib.cuvmm_ctx_call_count(ctx, cuvmm.Call.CREATE)
            y = x + w[: 1 << 20]
        assert c1 - c0 == 1, c1 - c0
        for i in range(3):
            x.fill_(float(i))
            g.replay()
            torch.cuda.synchronize()
            assert float(y.sum()) == float((i + 1) << 20), (i, float(y.sum()))
        configure_fails(cuvmm.ESTATE, 'w', coarse_bytes=1 << 20)  # after a first use inside a capture
        with cuvmm.torch.pool('w'):
            v = torch.full((16 << 20,), 2.0, device='cuda')  # the same pool outside the capture
        assert float(v.sum()) == 2.0 * (16 << 20)
        del g, x, y, w, v
        gc.collect()
        assert cuvmm.torch.graph_pools() == {}
    """)


@needs_gpu
def test_python_m_runs_unmodified_script(tmp_path):
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent("""
        import sys, time, torch
        x = torch.randn(1024, 1024, 64, device='cuda')
        free0 = torch.cuda.mem_get_info()[0]
        del x
        time.sleep(1.0)
        free1 = torch.cuda.mem_get_info()[0]
        print('released', (free1 - free0) >> 20, 'MiB', sys.argv[1:])
        """))
    e = dict(os.environ, CUVMM_RELEASE_DELAY_MS="200")
    e.pop("CUVMM_BACKEND", None)
    r = subprocess.run([sys.executable, "-m", "cuvmm.torch", str(script), "a", "b"], env=e, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    mib = int(r.stdout.split()[1])
    assert mib > 200, r.stdout
    assert "['a', 'b']" in r.stdout


def _two_gpus():
    try:
        import torch
    except Exception:
        return False
    return _torch_gpu() and torch.cuda.device_count() >= 2


@pytest.mark.skipif(not _two_gpus(), reason="needs torch with two CUDA GPUs")
def test_model_on_two_gpus_peer_access_and_idle_release():
    run("""
        cuvmm.torch.enable(release_delay_ms=300, peer_access=True)
        MiB = 1 << 20
        torch.manual_seed(0)
        # A two-stage model, one stage per GPU, as device_map="auto" would place it.
        l0 = torch.nn.Linear(4096, 4096).to('cuda:0')
        l1 = torch.nn.Linear(4096, 4096).to('cuda:1')
        x = torch.randn(256, 4096, device='cuda:0')
        with torch.no_grad():
            y = l1(l0(x).to('cuda:1'))
            ref = l1.cpu()(l0.cpu()(x.cpu()))
        assert torch.allclose(y.cpu(), ref, atol=1e-2, rtol=1e-3), (y.cpu() - ref).abs().max()
        l0.to('cuda:0'); l1.to('cuda:1')
        # A kernel on GPU 1 reading GPU 0's memory directly (peer access), and the other way round.
        a = torch.arange(1 << 20, device='cuda:0', dtype=torch.float32)
        b = torch.ones(1 << 20, device='cuda:1')
        torch.cuda.synchronize(0)
        assert torch.equal((a.to('cuda:1', non_blocking=True) + b).cpu(), (a.cpu() + 1))
        # A burst on both devices, then memory back on both once idle (no empty_cache).
        reserved = [torch.cuda.memory_reserved(d) for d in (0, 1)]
        burst = [torch.empty(64 * MiB, dtype=torch.uint8, device='cuda:%d' % d) for d in (0, 1) for _ in range(8)]
        assert all(torch.cuda.memory_reserved(d) >= reserved[d] + 500 * MiB for d in (0, 1))
        del burst
        gc.collect()
        torch.cuda.synchronize(0); torch.cuda.synchronize(1)
        time.sleep(1.5)
        for d in (0, 1):
            assert torch.cuda.memory_reserved(d) < reserved[d] + 64 * MiB, (d, torch.cuda.memory_reserved(d))
        print('ok')
    """)
