import sys, os, statistics
sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[2]))
from pagedllm import LLM, SamplingParams
from pagedllm.benchmarks.quant_decode import single_stream_ms
import pagedllm.models.gguf_quant as gq
path = sys.argv[1]  # a Q8_0 GGUF (bench random-llama-1b --prepare-only makes one)
llms = {}
for name, types in (("quantized", ("Q8_0", "Q4_0", "Q4_1")), ("blocks", ("Q4_0", "Q4_1"))):
    gq.QUANTIZED_WEIGHT_TYPES = types
    llms[name] = LLM(path, quantization="gguf", max_model_len=2048, kv_cache_memory_bytes="256MiB", enable_prefix_caching=False)
    llms[name].generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(max_tokens=4), use_tqdm=False)
res = {k: [] for k in llms}
for r in range(3):
    for name, llm in llms.items():
        ms = single_stream_ms(llm, [5], 48)
        res[name].append(1e3 / ms)
        print(name, f"{1e3/ms:.2f} tok/s load {os.getloadavg()[0]:.1f}", flush=True)
a, b = statistics.median(res["quantized"]), statistics.median(res["blocks"])
print(f"median quantized {a:.2f} blocks {b:.2f} ratio {b/a:.2f}")
