"""Sampled single-stream decode on Gemma 3 270M (the real Q4_K_M file, default configuration):
greedy, Gemma's generation defaults (temperature 1, top_k 64, top_p 0.95), temperature only; 64
tokens after a 6-token prompt, tok/s. usage: ab_sampler.py CHECKOUT_DIR (run per checkout,
alternated, for a before/after)."""
import sys, time
root = sys.argv[1]
sys.path.insert(0, root)
from pagedllm import LLM, SamplingParams
llm = LLM("gemma-3-270m", max_model_len=1024, kv_cache_memory_bytes="256MiB", enable_prefix_caching=False)
prompt = [{"prompt_token_ids": [2, 651, 6037, 576, 6081, 603]}]
for name, p in [("greedy", SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)),
                ("top_k64_top_p0.95", SamplingParams(max_tokens=64, temperature=1.0, top_k=64, top_p=0.95, ignore_eos=True, seed=1)),
                ("temperature_only", SamplingParams(max_tokens=64, temperature=1.0, ignore_eos=True, seed=1))]:
    llm.generate(prompt, p, use_tqdm=False)
    t = time.perf_counter(); llm.generate(prompt, p, use_tqdm=False); dt = time.perf_counter() - t
    print(root, name, f"{64/dt:.1f} tok/s", flush=True)
