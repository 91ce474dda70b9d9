"""An ordinary PyTorch script, nothing cuvmm in it: load a transformers model (random weights from a config),
generate, delete it, sleep 2 s, and print the GPU memory the process holds at each step (NVML, as
nvidia-smi shows it). Run it both ways:

    python3 examples/torch/del_model.py                    # stock PyTorch: the memory stays cached
    python3 -m cuvmm.torch examples/torch/del_model.py     # cuvmm: back to the driver, no empty_cache()
"""
import gc
import os
import time

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM


def held_gib():
    try:
        import pynvml
        pynvml.nvmlInit()
        h = pynvml.nvmlDeviceGetHandleByIndex(0)
        for p in pynvml.nvmlDeviceGetComputeRunningProcesses(h):
            if p.pid == os.getpid() and p.usedGpuMemory:
                return p.usedGpuMemory / 2**30
    except Exception:
        pass
    free, total = torch.cuda.mem_get_info()  # the device's used memory, where NVML does not list the process
    return (total - free) / 2**30


cfg = Qwen2Config(vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                  num_attention_heads=12, num_key_value_heads=2, tie_word_embeddings=True)
torch.manual_seed(0)
with torch.device("cuda"):
    model = Qwen2ForCausalLM(cfg).to(torch.bfloat16).eval()
print("loaded:          %.2f GiB held" % held_gib())
ids = torch.randint(0, 1000, (4, 64), device="cuda")
with torch.no_grad():
    out = model.generate(ids, max_new_tokens=64, do_sample=False, pad_token_id=0)
print("generated %d tokens: %.2f GiB held, torch.cuda.memory_allocated %.2f GiB, memory_reserved %.2f GiB"
      % (out.numel(), held_gib(), torch.cuda.memory_allocated() / 2**30, torch.cuda.memory_reserved() / 2**30))
del model, out, ids
gc.collect()
time.sleep(2.0)
print("del + 2 s idle:  %.2f GiB held, memory_allocated %.2f GiB, memory_reserved %.2f GiB"
      % (held_gib(), torch.cuda.memory_allocated() / 2**30, torch.cuda.memory_reserved() / 2**30))
