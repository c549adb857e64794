"""`pagedllm bench latency` measures real decode steps and leaves the engine empty."""

from __future__ import annotations

from pagedllm import LLM
from pagedllm.benchmarks.latency import _linear_weights, measure_decode


def test_measure_decode_counts_and_frees(tiny_llama_dir):
    llm = LLM(tiny_llama_dir, dtype="float32", max_model_len=256, kv_cache_memory_bytes="8MiB")
    engine = llm.llm_engine
    result, profile = measure_decode(llm, batch_size=3, context_len=40, num_steps=5, seed=0, profile_steps=4)
    assert result.batch_size == 3 and result.step_ms > 0
    assert abs(result.decode_tok_s - 3 / (result.step_ms / 1e3)) < 1e-6 * result.decode_tok_s
    # Linear FLOPs count the projections and the head (tied or not), not the embedding table.
    model = engine.engine_core.runner.model
    vocab, hidden = model.model.embed_tokens.weight.shape
    numel, nbytes = _linear_weights(model)
    assert vocab * hidden + 2 * 4 * hidden * hidden < numel  # the head, 2 layers' attention at least
    assert numel < sum(p.numel() for p in model.parameters())
    assert nbytes == 4 * numel  # float32
    # The profile splits real steps into parts that add up to the step, and unhooks itself.
    assert profile is not None and profile.steps == 4
    parts = profile.per_step_ms()
    # Every profiled step decoded the whole batch (the requests outlive the profiled steps).
    assert profile.request_outputs == 3 * 4
    common = ("schedule", "prepare inputs", "norms", "LM head", "sampling", "scheduler update", "output processing")
    # Decode steps run every layer in one compiled call (models/fused_decode.py)...
    for part in (*common, "decoder layers (fused)"):
        assert parts[part] > 0, part
    assert parts["linear projections"] == parts["attention (+ KV write)"] == 0
    assert abs(sum(parts.values()) - profile.step_seconds / 4 * 1e3) < 1e-6 * profile.step_seconds * 1e3 + 1e-9
    # ...and module by module with it off, each module type its own part.
    model.model.fused_layers.enabled = False
    try:
        _, profile = measure_decode(llm, batch_size=3, context_len=40, num_steps=2, seed=0, profile_steps=2)
    finally:
        model.model.fused_layers.enabled = True
    assert profile is not None and profile.request_outputs == 3 * 2
    parts = profile.per_step_ms()
    for part in (*common, "linear projections", "attention (+ KV write)"):
        assert parts[part] > 0, part
    assert parts["decoder layers (fused)"] == 0
    assert "forward" not in vars(model) and "schedule" not in vars(engine.scheduler)
    assert all(not m._forward_hooks for m in model.modules())
    assert not engine.has_unfinished_requests()
    assert engine.scheduler.kv_cache_manager.num_free_blocks == engine.scheduler.kv_cache_manager.block_pool.num_blocks - 1
