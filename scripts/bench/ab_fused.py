"""A/B of the compiled decode forward (models/fused_decode.py) against module-by-module decode,
in one process, alternated: single-stream tok/s by wall time and by process CPU time (the
latter holds up on a loaded machine). usage: ab_fused.py MODEL [TOKENS] (ROUNDS=3)"""
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from pagedllm import LLM, SamplingParams  # noqa: E402

path = sys.argv[1]
tg = int(sys.argv[2]) if len(sys.argv) > 2 else 64
llm = LLM(path, dtype=os.environ.get("DTYPE", "auto"), max_model_len=2048, kv_cache_memory_bytes="512MiB", enable_prefix_caching=False)
fused = llm.llm_engine.engine_core.runner.model.model.fused_layers
params = SamplingParams(max_tokens=tg, temperature=0.0, ignore_eos=True)
prompt = [{"prompt_token_ids": [2, 651, 6037, 576, 6081, 603]}]
llm.generate(prompt, SamplingParams(max_tokens=4), use_tqdm=False)
calls = []
fused.register_forward_hook(lambda *_: calls.append(1))
print("dtype", llm.llm_engine.model_config.dtype, "layers", len(llm.llm_engine.engine_core.runner.model.model.layers))
res = {"modules": [], "fused": []}
cpu = {"modules": [], "fused": []}
tokens = {}
for r in range(int(os.environ.get("ROUNDS", 3))):
    for mode in ("modules", "fused"):
        fused.enabled = mode == "fused"
        calls.clear()
        t0, c0 = time.perf_counter(), time.process_time()
        out = llm.generate(prompt, params, use_tqdm=False)
        wall, cpu_s = time.perf_counter() - t0, time.process_time() - c0
        tokens[mode] = out[0].outputs[0].token_ids
        res[mode].append(tg / wall)
        cpu[mode].append(tg / cpu_s)
        print(f"{mode}: {tg / wall:.1f} tok/s wall, {tg / cpu_s:.1f} tok/CPU-s, load {os.getloadavg()[0]:.1f}",
              f"fused calls {len(calls)}", flush=True)
a, b = statistics.median(res["modules"]), statistics.median(res["fused"])
ca, cb = statistics.median(cpu["modules"]), statistics.median(cpu["fused"])
print(f"median wall: modules {a:.1f} fused {b:.1f} ratio {b / a:.2f}; CPU: {ca:.1f} {cb:.1f} ratio {cb / ca:.2f}")
print("same tokens:", tokens["modules"] == tokens["fused"])
