"""PyTorch scenarios, stock allocator against cuvmm, each run in a fresh process.

    python3 bench/torch/scenarios.py [--reps N] [--out FILE.json] [--quick]

Needs torch with a CUDA GPU and transformers; models are built from configs with random weights (nothing is
downloaded). Held memory is the process's GPU memory as NVML reports it (pynvml), which is what nvidia-smi
shows; where pynvml is missing, total minus free from cudaMemGetInfo.

Scenarios (each: stock, stock with expandable segments, cuvmm):
  rounds   load a model, generate, del model, idle 2.5 s; three rounds in one process. Held after each idle,
           and (stock) after empty_cache() too: the floor of CUDA context plus cuBLAS workspaces.
  chat     12 turns of a chat with a DynamicCache, then "clear" (the cache dropped), idle 2.5 s.
  speed    generate() tokens/s at batch 1 and 16.
  weights  a model loaded tensor by tensor: held / tensor bytes (cuvmm: the "weights" pool's held).
  sleep    cuvmm.torch.sleep/wake of the weights (first and second time) against a plain pinned copy of the
           same bytes in the same process; again with cuvmm.torch.sleep_prepare() before the first sleep
           (mode cuvmm-prepared, its time in prepare_s); and prepared in a pool configured with coarse_bytes
           (mode cuvmm-coarse, --coarse-mib: tensors from that size up on handles as large as fit).
"""
import argparse
import json
import os
import subprocess
import sys
import time

MODELS = {
    "qwen2-1.5b": dict(kind="qwen2", vocab_size=151936, hidden_size=1536, intermediate_size=8960,
                       num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
                       max_position_embeddings=4096, tie_word_embeddings=True),
    "llama-1b": dict(kind="llama", vocab_size=128256, hidden_size=2048, intermediate_size=8192,
                     num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                     max_position_embeddings=4096, tie_word_embeddings=True),
}

GiB = float(1 << 30)


# ---------------------------------------------------------------- in the child process

def held_bytes(torch):
    """The process's GPU memory as NVML sees it; where NVML does not list this process (a container's pid
    namespace), the device's used memory from cudaMemGetInfo (the benchmark runs alone on the GPU)."""
    try:
        import pynvml
        pynvml.nvmlInit()
        h = pynvml.nvmlDeviceGetHandleByIndex(torch.cuda.current_device())
        for p in pynvml.nvmlDeviceGetComputeRunningProcesses(h):
            if p.pid == os.getpid() and p.usedGpuMemory:
                return int(p.usedGpuMemory)
    except Exception:
        pass
    free, total = torch.cuda.mem_get_info()
    return total - free


def build(torch, name):
    import transformers
    cfg = dict(MODELS[name])
    kind = cfg.pop("kind")
    if kind == "qwen2":
        conf, cls = transformers.Qwen2Config(**cfg), transformers.Qwen2ForCausalLM
    else:
        conf, cls = transformers.LlamaConfig(**cfg), transformers.LlamaForCausalLM
    torch.manual_seed(0)
    with torch.device("cuda"):
        old = torch.get_default_dtype()
        torch.set_default_dtype(torch.bfloat16)
        try:
            model = cls(conf)
        finally:
            torch.set_default_dtype(old)
    return model.eval()


def child(args):
    mode, scenario = args.mode, args.scenario
    # sleep: cuvmm.torch.sleep_prepare() before the first sleep; cuvmm-coarse also configures the pool
    prepared = mode in ("cuvmm-prepared", "cuvmm-coarse")
    out = {"mode": mode, "scenario": scenario}
    if mode == "cuvmm-coarse":
        import cuvmm.torch
        cuvmm.torch.configure_pool("weights", coarse_bytes=args.coarse_mib << 20)
        out["coarse_mib"] = args.coarse_mib
    if prepared:
        mode = "cuvmm"
    if mode == "cuvmm":
        import cuvmm.torch
        cuvmm.torch.enable()
    import torch
    import gc
    torch.cuda.init()
    _ = torch.ones(1, device="cuda") @ torch.ones(1, 1, device="cuda")  # context and cuBLAS up
    out["baseline"] = held_bytes(torch)
    model_name = args.model
    if scenario == "rounds":
        out["after_idle"], out["after_empty_cache"] = [], []
        for r in range(3):
            model = build(torch, model_name)
            ids = torch.randint(0, 1000, (1, 32), device="cuda")
            with torch.no_grad():
                model.generate(ids, max_new_tokens=32, do_sample=False, pad_token_id=0)
            torch.cuda.synchronize()
            del model, ids
            gc.collect()
            time.sleep(2.5)
            out["after_idle"].append(held_bytes(torch))
            if mode != "cuvmm":
                torch.cuda.empty_cache()
                out["after_empty_cache"].append(held_bytes(torch))
    elif scenario == "chat":
        from transformers import DynamicCache
        model = build(torch, model_name)
        torch.cuda.synchronize()
        gc.collect()
        if mode != "cuvmm":
            torch.cuda.empty_cache()
        time.sleep(2.5)
        out["weights_only"] = held_bytes(torch)
        cache = DynamicCache()
        history = torch.randint(0, 1000, (1, 64), device="cuda")
        with torch.no_grad():
            for turn in range(12):
                user = torch.randint(0, 1000, (1, 48), device="cuda")
                history = torch.cat([history, user], dim=1)
                res = model.generate(history, past_key_values=cache, max_new_tokens=48, do_sample=False,
                                     pad_token_id=0, return_dict_in_generate=True)
                history, cache = res.sequences, res.past_key_values
        torch.cuda.synchronize()
        out["peak_turn12"] = held_bytes(torch)
        del cache, history, res, user  # "clear"
        gc.collect()
        time.sleep(2.5)
        out["after_clear"] = held_bytes(torch)
        if mode != "cuvmm":
            torch.cuda.empty_cache()
            out["after_clear_empty_cache"] = held_bytes(torch)
    elif scenario == "speed":
        model = build(torch, model_name)
        for batch in (1, 16):
            ids = torch.randint(0, 1000, (batch, 64), device="cuda")
            with torch.no_grad():
                model.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=0)  # warm-up
                best = 0.0
                for _ in range(3):
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    model.generate(ids, max_new_tokens=64, min_new_tokens=64, do_sample=False, pad_token_id=0)
                    torch.cuda.synchronize()
                    best = max(best, batch * 64 / (time.perf_counter() - t0))
            out["tok_s_b%d" % batch] = best
    elif scenario in ("weights", "sleep"):
        if mode == "cuvmm":
            import cuvmm.torch
            with cuvmm.torch.pool("weights"):
                model = build(torch, model_name)
        else:
            model = build(torch, model_name)
        torch.cuda.synchronize()
        gc.collect()
        tensor_bytes = sum(t.numel() * t.element_size() for t in model.state_dict().values()
                           if t.is_cuda and t.data_ptr())
        # tied weights appear twice in state_dict: count each storage once
        seen, tensor_bytes = set(), 0
        for t in list(model.parameters()) + list(model.buffers()):
            if t.is_cuda and t.data_ptr() not in seen:
                seen.add(t.data_ptr())
                tensor_bytes += t.numel() * t.element_size()
        out["tensor_bytes"] = tensor_bytes
        if mode == "cuvmm":
            import ctypes
            time.sleep(1.5)  # init's temporaries, freed, go back after the release delay (1 s)
            lib = cuvmm.torch._c()
            import cuvmm._lib as L
            p = ctypes.c_void_p()
            lib.cuvmm_torch_pool(b"weights", 0, ctypes.byref(p))
            st = L.StatsStruct()
            st.size = ctypes.sizeof(st)
            lib.cuvmm_pool_stats(p, ctypes.byref(st))
            out["held"] = st.held_bytes
        else:
            torch.cuda.empty_cache()
            out["held"] = torch.cuda.memory_reserved()
        out["ratio"] = out["held"] / tensor_bytes
        if scenario == "sleep" and mode == "cuvmm":
            if prepared:
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                cuvmm.torch.sleep_prepare("weights")
                out["prepare_s"] = time.perf_counter() - t0
            for i in range(2):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                cuvmm.torch.sleep("weights")
                t1 = time.perf_counter()
                cuvmm.torch.wake("weights")
                torch.cuda.synchronize()
                t2 = time.perf_counter()
                out["sleep_gbs_%d" % i] = tensor_bytes / (t1 - t0) / 1e9
                out["wake_gbs_%d" % i] = tensor_bytes / (t2 - t1) / 1e9
            src = torch.empty(tensor_bytes, dtype=torch.uint8, device="cuda")
            host = torch.empty(tensor_bytes, dtype=torch.uint8, pin_memory=True)
            for _ in range(2):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                host.copy_(src, non_blocking=True)
                torch.cuda.synchronize()
                t1 = time.perf_counter()
                src.copy_(host, non_blocking=True)
                torch.cuda.synchronize()
                t2 = time.perf_counter()
            out["pinned_d2h_gbs"] = tensor_bytes / (t1 - t0) / 1e9
            out["pinned_h2d_gbs"] = tensor_bytes / (t2 - t1) / 1e9
    print("RESULT " + json.dumps(out), flush=True)


# ---------------------------------------------------------------- the driver

def run_one(mode, scenario, model, coarse_mib, timeout=600):
    env = dict(os.environ)
    env.pop("PYTORCH_CUDA_ALLOC_CONF", None)
    if mode == "expandable":
        env["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
    cmd = [sys.executable, os.path.abspath(__file__), "--child", "--mode", mode, "--scenario", scenario,
           "--model", model, "--coarse-mib", str(coarse_mib)]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    for line in r.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    return {"mode": mode, "scenario": scenario, "error": r.stderr[-3000:]}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--mode", default="stock",
                    choices=["stock", "expandable", "cuvmm", "cuvmm-prepared", "cuvmm-coarse"])
    ap.add_argument("--coarse-mib", type=int, default=32,
                    help="mode cuvmm-coarse: the weights pool's coarse_bytes, in MiB (default 32)")
    ap.add_argument("--scenario", default="rounds", choices=["rounds", "chat", "speed", "weights", "sleep"])
    ap.add_argument("--model", default="qwen2-1.5b", choices=sorted(MODELS))
    ap.add_argument("--reps", type=int, default=2, help="repetitions of each scenario (default 2)")
    ap.add_argument("--scenarios", default="rounds,chat,speed,weights,sleep")
    ap.add_argument("--out", default=None, help="write every result as JSON here")
    args = ap.parse_args()
    if args.child:
        child(args)
        return 0
    results = []
    for scen in args.scenarios.split(","):
        models = sorted(MODELS) if scen == "weights" else [args.model]
        modes = {"speed": ["stock", "cuvmm"], "weights": ["stock", "cuvmm"], "sleep": ["cuvmm", "cuvmm-prepared", "cuvmm-coarse"]}.get(
            scen, ["stock", "expandable", "cuvmm"])
        for model in models:
            for rep in range(args.reps if scen != "sleep" else 1):
                for mode in modes:
                    t0 = time.time()
                    r = run_one(mode, scen, model, args.coarse_mib)
                    r.update(model=model, rep=rep, seconds=round(time.time() - t0, 1))
                    results.append(r)
                    short = {k: (round(v / GiB, 3) if isinstance(v, int) and v > 1 << 20 else
                                 [round(x / GiB, 3) for x in v] if isinstance(v, list) else
                                 round(v, 3) if isinstance(v, float) else v)
                             for k, v in r.items() if k != "error"}
                    print(json.dumps(short), flush=True)
                    if "error" in r:
                        print("ERROR " + r["error"], flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
