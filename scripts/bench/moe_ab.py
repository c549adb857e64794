import sys, time, torch
sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[2]))
torch.set_num_threads(1)
from pagedllm.kernels.gguf_moe import ExpertStacks, grouped_experts
from pagedllm.benchmarks.gguf_matmul import random_blocks
E, H, I = 128, 2048, 768  # Qwen3-30B-A3B's layer
gu = torch.stack([random_blocks("Q4_K", 2 * I, H, seed=e).data for e in range(E)])
dn = torch.stack([random_blocks("Q6_K", H, I, seed=1000 + e).data for e in range(E)])
s = ExpertStacks(gu, "Q4_K", dn, "Q6_K")
g = torch.Generator().manual_seed(0)
for T in (1, 4, 16):
    x = torch.randn(T, H, generator=g)
    ids = torch.stack([torch.randperm(E, generator=g)[:8] for _ in range(T)])
    w = torch.rand(T, 8, generator=g)
    res = {False: [], True: []}
    for r in range(5):
        for int8 in (False, True):
            t = time.process_time()
            for _ in range(3): grouped_experts(x, ids, w, s, int8_activations=int8)
            res[int8].append((time.process_time() - t) / 3)
    a, b = min(res[False]) * 1e3, min(res[True]) * 1e3
    print(f"T={T}: int16 {a:.2f} ms, int8 {b:.2f} ms, int16/int8 {a/b:.2f}")
