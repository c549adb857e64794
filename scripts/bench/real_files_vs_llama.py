"""The real files users download (Gemma 3 270M Q4_K_M; the default model's Q4_1), pagedllm's default
configuration against llama-bench -t 2, alternated: pp512 and tg128 (random_llama_1b's protocol)."""
import sys, os, statistics
sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[2]))
from pagedllm import LLM, SamplingParams
from pagedllm.benchmarks.random_llama_1b import _pagedllm_pp_tg, llama_bench
from pagedllm.models.loader import resolve_checkpoint
BIN = __import__("os").environ["LLAMA_CPP_BIN"]  # llama.cpp build/bin (llama-bench)
names = sys.argv[1].split(",") if len(sys.argv) > 1 else ["gemma-3-270m"]
rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 3
for name in names:
    path, _ = resolve_checkpoint(name)
    llm = LLM(name, max_model_len=2048, kv_cache_memory_bytes="512MiB", enable_prefix_caching=False)
    vocab = llm.llm_engine.model_config.vocab_size
    llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(max_tokens=4), use_tqdm=False)
    ours, theirs = [], []
    for r in range(rounds):
        ours.append(_pagedllm_pp_tg(llm, vocab, 512, 128, r))
        theirs.append(llama_bench(BIN, path, 2, 512, 128))
        print(f"{name} round {r}: pagedllm pp {ours[-1][0]:.1f} tg {ours[-1][1]:.2f}; llama.cpp pp {theirs[-1][0]:.1f} tg {theirs[-1][1]:.2f}; load {os.getloadavg()[0]:.1f}", flush=True)
    med = lambda rows, i: statistics.median(r[i] for r in rows)
    print(f"{name} ({path}): pp512 {med(ours,0):.1f} / {med(theirs,0):.1f} = {med(ours,0)/med(theirs,0):.2f}x; "
          f"tg128 {med(ours,1):.2f} / {med(theirs,1):.2f} = {med(ours,1)/med(theirs,1):.2f}x", flush=True)
    del llm
