"""The GPU check (issue 32), run by scripts/gpu_check.sh on the GPU machine after the kernel
tests. Each check writes its result into one JSON file (and a markdown summary for
docs/gpu.md); a failing check is recorded and the next one still runs.

Checks:
- ``big_pool``: paged attention over a KV pool of more than 2^31 elements, reading the
  top blocks, against float64 on the host (the int64 offsets, on real memory).
- ``greedy``: random weights of the default model's shape (SmolLM2-135M: Llama, 30 layers,
  hidden 576, GQA 9/3, vocab 49152), built here; our engine on CUDA in float32 against HF
  transformers on the same GPU (TF32 off), greedy by DESIGN.md's tie rule.
- ``syncs``: host syncs per engine step under ``torch.cuda.set_sync_debug_mode("warn")``,
  counted per ``ModelRunner.execute``: the step may make one (the sampled tokens' copy).
- ``graphs``: greedy with CUDA graphs equal to eager, and decode step time both ways.
- ``w1_offline`` / ``w1_served``: W1 (random prompts of 32-480 tokens, 128 output tokens)
  through ``LLM.generate`` and through ``pagedllm serve`` + ``pagedllm bench serve``, against
  HF transformers' static batching (batch 16) on the same GPU, output tokens/s.

``--dry-run-cpu`` runs the device-neutral checks (greedy, W1 offline and served) on the CPU
with a 2-layer model of the same vocabulary, to check this script before a GPU call.
"""

from __future__ import annotations

import argparse
import gc
import inspect
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
import urllib.request
import warnings
from typing import Any, Callable

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/ helpers

from pagedllm import LLM, SamplingParams  # noqa: E402
from pagedllm.benchmarks.workloads import random_prompts  # noqa: E402

VOCAB = 49152
DEVICE = "cuda"  # --dry-run-cpu: "cpu"
DEFAULT_SHAPE = dict(
    vocab_size=VOCAB, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
    num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192, rope_theta=100000.0,
    rms_norm_eps=1e-5, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2,
)


def save_word_tokenizer(path: str) -> None:
    """A word-level tokenizer with one word per id of the vocabulary, so every sampled id
    detokenizes to text (the served benchmark counts streamed text)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<unk>", "<s>", "</s>"] + [f"w{i}" for i in range(3, VOCAB)]
    tok = Tokenizer(models.WordLevel(vocab={w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(path)


def build_checkpoint(path: str, **overrides: Any) -> str:
    """Random weights of the default model's shape (seed 0) and a word-level tokenizer."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**(DEFAULT_SHAPE | overrides))).eval()
    with torch.no_grad():  # HF initialises with std 0.02: scale up so greedy steps are decided
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(2.0)
    model.save_pretrained(path, safe_serialization=True)
    save_word_tokenizer(path)
    return path


def hf_model(path: str, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(DEVICE).eval()


@torch.inference_mode()
def hf_greedy(model, prompt: list[int], steps: int) -> tuple[list[int], list[float]]:
    """HF greedy with its KV cache on the GPU: tokens and each step's top-2 logprob gap."""
    # transformers 5.2x names the cache argument "cache", earlier ones "past_key_values".
    cache_arg = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    tokens, gaps = [], []
    out = model(torch.tensor([prompt], device=DEVICE), use_cache=True, logits_to_keep=1)
    for _ in range(steps):
        top2 = torch.log_softmax(out.logits[0, -1].float(), -1).topk(2)
        token = int(top2.indices[0])
        tokens.append(token)
        gaps.append(float(top2.values[0] - top2.values[1]))
        out = model(torch.tensor([[token]], device=DEVICE), use_cache=True, **{cache_arg: out.past_key_values})
    return tokens, gaps


def check_big_pool() -> dict[str, Any]:
    from pagedllm.kernels.triton import triton_ops

    hkv, d, bs = 8, 128, 16
    per_block = bs * hkv * d
    num_blocks = (1 << 31) // per_block + 64  # each of K and V past 2^31 elements (8.6 GB each)
    cache = torch.zeros(2, num_blocks, bs, hkv, d, dtype=torch.float32, device="cuda")
    seq_len, group = 100, 4
    ids = torch.arange(num_blocks - 7, num_blocks, device="cuda")  # the top 7 blocks
    gen = torch.Generator(device="cuda").manual_seed(0)
    cache[:, ids] = torch.randn(2, len(ids), bs, hkv, d, generator=gen, device="cuda")
    q = torch.randn(1, hkv * group, d, generator=gen, device="cuda")
    table = ids.view(1, -1)
    got = triton_ops("cuda").paged_attention(
        q, cache, table, torch.tensor([seq_len], device="cuda"), torch.tensor([0, 1], device="cuda"), 1, d**-0.5
    )
    k = cache[0, ids].reshape(-1, hkv, d)[:seq_len].double().cpu()
    v = cache[1, ids].reshape(-1, hkv, d)[:seq_len].double().cpu()
    qh = q[0].double().cpu().view(hkv, group, d)
    want = torch.softmax(torch.einsum("hgd,shd->hgs", qh, k) * d**-0.5, -1)
    want = torch.einsum("hgs,shd->hgd", want, v).reshape(1, hkv * group, d)
    err = float((got.double().cpu() - want).abs().max())
    del cache
    torch.cuda.empty_cache()
    return {"ok": err < 1e-4, "elements_per_half": num_blocks * per_block, "max_abs_err": err}


def _engine(path: str, kv_cache_memory_bytes: str | None = "16GiB", **kwargs: Any) -> LLM:
    """An engine with a fixed KV pool (several share the GPU in one check); None sizes it
    from gpu_memory_utilization (the greedy check, the first engine, does)."""
    return LLM(path, device=DEVICE, max_model_len=2048, seed=0, kv_cache_memory_bytes=kv_cache_memory_bytes, **kwargs)


def _sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def check_greedy(path: str, steps: int = 48) -> dict[str, Any]:
    from tests.utils import assert_greedy_match

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    prompts = random_prompts(8 if DEVICE == "cuda" else 3, 16, 300, VOCAB, seed=1)
    hf = hf_model(path, torch.float32)
    refs = [hf_greedy(hf, p, steps) for p in prompts]
    del hf
    llm = _engine(path, kv_cache_memory_bytes=None if DEVICE == "cuda" else "1GiB", dtype="float32")
    config = llm.llm_engine.config
    params = SamplingParams(max_tokens=steps, temperature=0.0, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    failures = []
    for i, (out, (ref, gaps)) in enumerate(zip(outs, refs)):
        try:
            assert_greedy_match(out.outputs[0].token_ids, ref, gaps, f"prompt {i}")
        except AssertionError as e:
            failures.append(str(e)[:500])
    identical = sum(o.outputs[0].token_ids == r for o, (r, _) in zip(outs, refs))
    return {
        "ok": not failures, "prompts": len(prompts), "identical": identical, "failures": failures,
        "kv_cache_bytes_from_utilization": config.cache_config.kv_cache_memory_bytes,
        "num_blocks": config.num_blocks,
    }


def check_syncs(path: str) -> dict[str, Any]:
    llm = _engine(path, dtype="bfloat16")
    runner = llm.llm_engine.engine_core.runner
    counts: list[int] = []
    execute = runner.execute

    def counted(so):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                out = execute(so)
            finally:
                torch.cuda.set_sync_debug_mode("default")
        if not so.is_empty:
            counts.append(sum("synchroniz" in str(w.message) for w in caught))
        return out

    runner.execute = counted
    llm.generate([{"prompt_token_ids": p} for p in random_prompts(4, 20, 60, VOCAB, seed=2)],
                 SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True), use_tqdm=False)  # warm-up
    counts.clear()
    llm.generate([{"prompt_token_ids": p} for p in random_prompts(6, 20, 200, VOCAB, seed=3)],
                 SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True), use_tqdm=False)
    return {"ok": bool(counts) and max(counts) <= 1, "syncs_per_step": sorted(set(counts)), "steps": len(counts)}


def _decode_ms(llm: LLM, batch: int, steps: int = 64) -> float:
    prompts = random_prompts(batch, 64, 64, VOCAB, seed=4)
    params = SamplingParams(max_tokens=steps, temperature=0.0, ignore_eos=True)
    llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)  # warm-up
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return (time.perf_counter() - t0) / steps * 1e3


def check_graphs(path: str) -> dict[str, Any]:
    sizes = [1, 2, 4, 8, 16, 32, 64]
    eager, graphs = _engine(path, dtype="bfloat16"), _engine(path, dtype="bfloat16", cuda_graph_sizes=sizes)
    prompts = random_prompts(5, 10, 200, VOCAB, seed=5)
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    a = [o.outputs[0].token_ids for o in eager.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)]
    b = [o.outputs[0].token_ids for o in graphs.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)]
    times = {n: {"eager_ms": _decode_ms(eager, n), "graphs_ms": _decode_ms(graphs, n)} for n in (1, 16, 64)}
    return {"ok": a == b, "same_greedy": a == b, "step_ms_by_batch": times}


def w1_prompts(num: int) -> list[list[int]]:
    return random_prompts(num, 32, 480, VOCAB, seed=0)


def check_w1_offline(path: str, num: int) -> dict[str, Any]:
    prompts = w1_prompts(num)
    params = SamplingParams(max_tokens=128, temperature=0.0, ignore_eos=True)
    dtype = "bfloat16" if DEVICE == "cuda" else "float32"
    llm = _engine(path, dtype=dtype)
    llm.generate([{"prompt_token_ids": p} for p in prompts[:8]], params, use_tqdm=False)  # warm-up
    t0 = time.perf_counter()
    llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    ours = num * 128 / (time.perf_counter() - t0)
    del llm
    hf = hf_model(path, getattr(torch, dtype))
    t0 = time.perf_counter()
    for start in range(0, num, 16):  # static batches of 16, left-padded
        batch = prompts[start : start + 16]
        width = max(map(len, batch))
        ids = torch.tensor([[0] * (width - len(p)) + p for p in batch], device=DEVICE)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch], device=DEVICE)
        hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=128, min_new_tokens=128,
                    do_sample=False, pad_token_id=0)
    _sync()
    theirs = num * 128 / (time.perf_counter() - t0)
    return {"ok": True, "prompts": num, "pagedllm_tok_s": ours, "hf_static_batch16_tok_s": theirs}


def check_w1_served(path: str, num: int, out_dir: str) -> dict[str, Any]:
    port = 18123
    server = subprocess.Popen(
        [sys.executable, "-m", "pagedllm.entrypoints.cli", "serve", path, "--device", DEVICE,
         "--dtype", "bfloat16" if DEVICE == "cuda" else "float32", "--max-model-len", "2048",
         "--kv-cache-memory-bytes", "16GiB" if DEVICE == "cuda" else "1GiB",
         "--host", "127.0.0.1", "--port", str(port)],
        stdout=open(os.path.join(out_dir, "serve.log"), "w"), stderr=subprocess.STDOUT,
    )
    try:
        deadline = time.time() + 180
        while time.time() < deadline:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
                break
            except OSError:
                time.sleep(1)
        results = {}
        for concurrency in (1, 16, 64) if DEVICE == "cuda" else (4,):
            filename = os.path.join(tempfile.gettempdir(), f"w1-c{concurrency}.json")
            subprocess.run(
                [sys.executable, "-m", "pagedllm.entrypoints.cli", "bench", "serve",
                 "--base-url", f"http://127.0.0.1:{port}", "--num-prompts", str(min(num, 4 * concurrency + 16)),
                 "--random-input-len", "256", "--random-range-ratio", "0.875", "--random-output-len", "128",
                 "--vocab-size", str(VOCAB), "--max-concurrency", str(concurrency), "--seed", str(concurrency),
                 "--save-result", "--result-filename", filename],
                check=True, timeout=240,
            )
            with open(filename) as f:
                summary = json.load(f)
            results[concurrency] = {k: v for k, v in summary.items() if "throughput" in k or "ttft" in k or "tpot" in k}
        return {"ok": True, "by_concurrency": results}
    finally:
        server.terminate()
        server.wait(30)


def main() -> None:
    parser = argparse.ArgumentParser(allow_abbrev=False)
    parser.add_argument("--out", required=True, help="directory for gpu_check.json and gpu_check.md")
    parser.add_argument("--checks", default="big_pool,greedy,syncs,graphs,w1_offline,w1_served")
    parser.add_argument("--w1-prompts", type=int, default=128)
    parser.add_argument("--dry-run-cpu", action="store_true", help="greedy and W1 on the CPU, 2 layers")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    global DEVICE
    overrides: dict[str, Any] = {}
    if args.dry_run_cpu:
        DEVICE = "cpu"
        overrides = dict(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                         num_key_value_heads=2)
        if args.checks == parser.get_default("checks"):
            args.checks = "greedy,w1_offline,w1_served"
    path = build_checkpoint(tempfile.mkdtemp(prefix="default-shape-"), **overrides)
    checks: dict[str, Callable[[], dict[str, Any]]] = {
        "big_pool": check_big_pool,
        "greedy": lambda: check_greedy(path),
        "syncs": lambda: check_syncs(path),
        "graphs": lambda: check_graphs(path),
        "w1_offline": lambda: check_w1_offline(path, args.w1_prompts),
        "w1_served": lambda: check_w1_served(path, args.w1_prompts, args.out),
    }
    report: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "device": torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu (dry run)",
        "torch": torch.__version__,
    }
    for name in args.checks.split(","):
        t0 = time.perf_counter()
        try:
            report[name] = checks[name]()
        except Exception:  # noqa: BLE001 -- recorded; the next check still runs
            report[name] = {"ok": False, "error": traceback.format_exc()[-2000:]}
        report[name]["seconds"] = round(time.perf_counter() - t0, 1)
        print(name, json.dumps(report[name])[:600], flush=True)
        gc.collect()  # the check's engines and models, before the next one sizes its memory
        if DEVICE == "cuda":
            torch.cuda.empty_cache()
    with open(os.path.join(args.out, "gpu_check.json"), "w") as f:
        json.dump(report, f, indent=2)
    with open(os.path.join(args.out, "gpu_check.md"), "w") as f:
        f.write(f"GPU check, {report['date']}, {report['device']}, torch {report['torch']}\n\n")
        for name in args.checks.split(","):
            f.write(f"- {name}: {'ok' if report[name].get('ok') else 'FAILED'} {json.dumps(report[name])[:400]}\n")


if __name__ == "__main__":
    main()
