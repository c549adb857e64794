"""A/B of the grouped-expert call (kernels/gguf_moe.py) against the per-expert loop
(SparseMoE.use_grouped), in one process, alternated: prompt processing (one prompt of PP
random tokens) and single-stream decode (TG tokens), tok/s by wall time and by process CPU
time (the latter holds up on a loaded machine), tokens compared.
usage: ab_moe_grouped.py MODEL [PP] [TG] (ROUNDS=3)"""
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from pagedllm import LLM, SamplingParams  # noqa: E402
from pagedllm.layers.moe import SparseMoE  # noqa: E402

path = sys.argv[1]
pp = int(sys.argv[2]) if len(sys.argv) > 2 else 512
tg = int(sys.argv[3]) if len(sys.argv) > 3 else 64
llm = LLM(path, max_model_len=2048, kv_cache_memory_bytes="512MiB", enable_prefix_caching=False)
model = llm.llm_engine.engine_core.runner.model
moes = [m for m in model.modules() if isinstance(m, SparseMoE)]
assert moes and all(m.expert_stacks is not None for m in moes), "no grouped stacks: nothing to compare"
vocab = min(len(llm.get_tokenizer()), 32000)
prompt_pp = [{"prompt_token_ids": torch.randint(10, vocab, (pp,), generator=torch.Generator().manual_seed(0)).tolist()}]
prompt_tg = [{"prompt_token_ids": prompt_pp[0]["prompt_token_ids"][:8]}]
one = SamplingParams(max_tokens=1, temperature=0.0)
params = SamplingParams(max_tokens=tg, temperature=0.0, ignore_eos=True)
llm.generate(prompt_tg, SamplingParams(max_tokens=4), use_tqdm=False)
res = {(k, m): [] for k in ("pp", "tg", "pp_cpu", "tg_cpu") for m in ("loop", "grouped")}
tokens = {}
for r in range(int(os.environ.get("ROUNDS", 3))):
    for mode in ("loop", "grouped"):
        for m in moes:
            m.use_grouped = mode == "grouped"
        t0, c0 = time.perf_counter(), time.process_time()
        llm.generate(prompt_pp, one, use_tqdm=False)
        res["pp", mode].append(pp / (time.perf_counter() - t0))
        res["pp_cpu", mode].append(pp / (time.process_time() - c0))
        t0, c0 = time.perf_counter(), time.process_time()
        out = llm.generate(prompt_tg, params, use_tqdm=False)
        res["tg", mode].append(tg / (time.perf_counter() - t0))
        res["tg_cpu", mode].append(tg / (time.process_time() - c0))
        tokens[mode] = out[0].outputs[0].token_ids
        print(f"{mode}: pp {res['pp', mode][-1]:.1f} tg {res['tg', mode][-1]:.2f} tok/s, load {os.getloadavg()[0]:.1f}",
              flush=True)
for k in ("pp", "tg", "pp_cpu", "tg_cpu"):
    a, b = statistics.median(res[k, "loop"]), statistics.median(res[k, "grouped"])
    print(f"{k}: loop {a:.2f} grouped {b:.2f} ratio {b / a:.2f}")
print("same tokens" if tokens["loop"] == tokens["grouped"] else f"tokens differ: {tokens}")
