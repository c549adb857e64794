"""A/B of the GGUF small-M kernel's activations (int16 vs int8) in one process, alternated."""
import sys, time, os
sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[2]))
from pagedllm import LLM, SamplingParams
from pagedllm.benchmarks.quant_decode import single_stream_ms
from pagedllm.layers.linear import Linear
from pagedllm.layers.embedding import LMHead
path = sys.argv[1]; tg = int(sys.argv[2]) if len(sys.argv) > 2 else 64
llm = LLM(path, quantization="gguf", max_model_len=2048, kv_cache_memory_bytes="512MiB", enable_prefix_caching=False)
model = llm.llm_engine.model_executor.driver_worker.model_runner.model if hasattr(llm.llm_engine, "model_executor") else None
def modules():
    import gc
    for o in gc.get_objects():
        if isinstance(o, (Linear, LMHead)):
            yield o
mods = list(modules())
print("modules", len(mods), {m.decode_activations for m in mods})
def setmode(mode):
    for m in mods: m.decode_activations = mode
llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(max_tokens=4), use_tqdm=False)
res = {"int16": [], "int8": []}
for r in range(int(os.environ.get("ROUNDS", 3))):
    for mode in ("int16", "int8"):
        setmode(mode)
        single_stream_ms(llm, [5], 4)
        ms = single_stream_ms(llm, [5], tg)
        res[mode].append(1e3 / ms)
        print(mode, f"{1e3/ms:.2f} tok/s", os.getloadavg()[0], flush=True)
import statistics
a, b = statistics.median(res["int16"]), statistics.median(res["int8"])
print(f"median int16 {a:.2f} int8 {b:.2f} ratio {b/a:.2f}")
