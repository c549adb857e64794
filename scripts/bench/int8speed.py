import sys, time, torch, numpy as np
sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[2]))
from pagedllm.kernels.build import gguf_linear_ops
from pagedllm.benchmarks.gguf_matmul import random_blocks
torch.set_num_threads(int(sys.argv[3]) if len(sys.argv) > 3 else 1)
ops = gguf_linear_ops()
idx = {n: i for i, n in enumerate(ops.type_names())}
shapes = [(2048, 8192), (8192, 2048)]
types = sys.argv[1].split(",") if len(sys.argv) > 1 else ["Q4_K", "Q6_K"]
Ms = [int(v) for v in (sys.argv[2].split(",") if len(sys.argv) > 2 else ["1"])]
src = torch.ones(1 << 28); dst = torch.empty_like(src)
res = {}
ws = {}
for t in types:
    for k, n in shapes:
        first = random_blocks(t, n, k, seed=k + n)
        ws[(t, k, n)] = [first.data] + [first.data.clone() for _ in range(int(96e6 // first.data.numel()))]
for r in range(6):
    for t in types:
        for k, n in shapes:
            for M in Ms:
                x = torch.randn(M, k)
                for path in ("int16", "int8"):
                    wl = ws[(t, k, n)]
                    reps = max(len(wl), int(1e9 // wl[0].numel()))
                    s = time.process_time()
                    for i in range(reps):
                        ops.linear(x, wl[i % len(wl)], idx[t], path)
                    dt = (time.process_time() - s) / reps
                    if r: res.setdefault((t, k, n, M, path), []).append(wl[0].numel() / dt / 1e9)
    s = time.process_time(); dst.copy_(src); dt = time.process_time() - s
    if r: res.setdefault("copy", []).append(2 * src.numel() * 4 / dt / 1e9)
cp = np.median(res.pop("copy"))
print(f"copy {cp:.1f} GB/s threads {torch.get_num_threads()}")
for key in sorted(set(k[:4] for k in res)):
    a, b = np.median(res[key + ("int16",)]), np.median(res[key + ("int8",)])
    print(key, f"int16 {a:.1f} GB/s ({a/cp:.2f}x copy)  int8 {b:.1f} GB/s ({b/cp:.2f}x copy)  ratio {b/a:.2f}")
