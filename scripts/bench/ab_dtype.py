"""pp512 and tg128 of one model in two dtypes (default: bfloat16 and float32), each its own LLM,
alternated: which dtype should `auto` pick for a file? usage: ab_dtype.py MODEL [ROUNDS]"""
import gc
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from pagedllm import LLM, SamplingParams  # noqa: E402
from pagedllm.benchmarks.random_llama_1b import _pagedllm_pp_tg  # noqa: E402

name = sys.argv[1]
rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 3
dtypes = os.environ.get("DTYPES", "bfloat16,float32").split(",")
res = {d: [] for d in dtypes}
for r in range(rounds):
    for d in dtypes:
        llm = LLM(name, dtype=d, max_model_len=2048, kv_cache_memory_bytes="512MiB", enable_prefix_caching=False)
        vocab = llm.llm_engine.model_config.vocab_size
        llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(max_tokens=4), use_tqdm=False)
        res[d].append(_pagedllm_pp_tg(llm, vocab, 512, 128, r))
        print(f"{d} round {r}: pp {res[d][-1][0]:.1f} tg {res[d][-1][1]:.2f} load {os.getloadavg()[0]:.1f}", flush=True)
        del llm
        gc.collect()
for d in dtypes:
    print(d, "median pp", f"{statistics.median(x[0] for x in res[d]):.1f}", "tg", f"{statistics.median(x[1] for x in res[d]):.2f}")
