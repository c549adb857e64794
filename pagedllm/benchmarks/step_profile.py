"""Where an engine step's time goes: `pagedllm bench latency --profile`.

Times each part of `LLMEngine.step()` in wall-clock time: scheduling, input preparation, the
model forward split by layer type (linear projections, attention with its KV write, norms,
rotary, activations, embedding), the LM head, sampling, the scheduler's update and the output
processing (detokenization). The parts are timed by wrapping the engine's own objects for the
profiled steps only (forward hooks on the model's leaf modules, wrappers on the scheduler,
runner and output processor), then unwrapped. The hooks cost a few microseconds per module
call, so a profiled step is slightly slower than a timed one; the breakdown is what to read.
The offline engine runs its core in process, so there is no IPC here; the server adds one
ZMQ round trip per step between its front end and core.
"""

from __future__ import annotations

import time
from collections import defaultdict
from contextlib import contextmanager
from typing import Any, Callable, Iterator

# Leaf module class name -> its part of the forward.
_MODULE_PARTS = {
    "Linear": "linear projections",
    "MergedLinear": "linear projections",
    "QKVLinear": "linear projections",
    "ColumnParallelLinear": "linear projections",
    "RowParallelLinear": "linear projections",
    "Attention": "attention (+ KV write)",
    "RMSNorm": "norms",
    "LayerNorm": "norms",
    "GemmaRMSNorm": "norms",
    "RotaryEmbedding": "rotary",
    "SiluAndMul": "activation",
    "GeluAndMul": "activation",
    "Gelu": "activation",
    "VocabEmbedding": "embedding",
    "LearnedPositionEmbedding": "embedding",
    # Decode steps of Llama-shaped models run every layer in one compiled call
    # (models/fused_decode.py; PAGEDLLM_FUSED_DECODE=0 shows the per-module parts instead).
    "FusedDecoderLayers": "decoder layers (fused)",
}
# Parts in print order; "model glue" is the forward minus its timed modules (Python between
# layers, splits, residual adds), "other" the step minus every timed part.
PART_ORDER = (
    "schedule", "prepare inputs", "embedding", "norms", "linear projections", "rotary",
    "attention (+ KV write)", "activation", "decoder layers (fused)", "model glue", "LM head", "sampling",
    "scheduler update", "output processing", "other",
)


class StepProfile:
    """Accumulated seconds per part over `steps` profiled steps."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.steps = 0
        self.step_seconds = 0.0
        self.request_outputs = 0
        """Request outputs the profiled steps returned (batch size x steps when all decode)."""

    def per_step_ms(self) -> dict[str, float]:
        return {part: self.seconds.get(part, 0.0) / max(self.steps, 1) * 1e3 for part in PART_ORDER}

    def table(self) -> str:
        total_ms = self.step_seconds / max(self.steps, 1) * 1e3
        lines = [f"step breakdown over {self.steps} profiled steps ({total_ms:.2f} ms/step with hooks):"]
        for part, ms in self.per_step_ms().items():
            if ms > 0:
                lines.append(f"  {part:<24} {ms:8.3f} ms  {100 * ms / total_ms:5.1f}%")
        return "\n".join(lines)


class _Timed:
    """Calls `fn`, adding the time taken to `part`; other attributes read through to `fn`'s
    (so an object such as the sampler keeps working where its attributes are read)."""

    def __init__(self, profile: StepProfile, part: str, fn: Callable) -> None:
        self._profile, self._part, self._fn = profile, part, fn

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return self._fn(*args, **kwargs)
        finally:
            self._profile.seconds[self._part] += time.perf_counter() - start

    def __getattr__(self, name: str) -> Any:
        return getattr(self._fn, name)


@contextmanager
def profiling(engine: Any, profile: StepProfile) -> Iterator[Callable[[], None]]:
    """Instrument `engine` (an LLMEngine); yields `step()`, which runs and times one step."""
    runner = engine.engine_core.runner
    model = runner.model
    forward = StepProfile()  # the model forward's own total, to find the glue between modules
    patched: list[tuple[Any, str, Any, bool]] = []  # (object, name, original, instance attribute?)

    def patch(obj: Any, name: str, part: str, into: StepProfile = profile) -> None:
        original = getattr(obj, name)
        patched.append((obj, name, original, name in vars(obj)))
        setattr(obj, name, _Timed(into, part, original))

    patch(engine.scheduler, "schedule", "schedule")
    patch(engine.scheduler, "update_from_output", "scheduler update")
    patch(runner, "prepare_inputs", "prepare inputs")
    patch(runner, "sampler", "sampling")
    patch(engine.output_processor, "process_outputs", "output processing")
    patch(model, "compute_logits", "LM head")
    patch(model, "forward", "forward", into=forward)
    handles = []
    starts: dict[int, float] = {}

    def pre(module: Any, _inputs: Any) -> None:
        starts[id(module)] = time.perf_counter()

    def post_for(part: str) -> Callable:
        def post(module: Any, _inputs: Any, _output: Any) -> None:
            profile.seconds[part] += time.perf_counter() - starts.pop(id(module))

        return post

    module_parts = set()
    for module in model.modules():
        part = _MODULE_PARTS.get(type(module).__name__)
        if part is not None:
            module_parts.add(part)
            handles.append(module.register_forward_pre_hook(pre))
            handles.append(module.register_forward_hook(post_for(part)))

    def step() -> None:
        before = dict(profile.seconds)
        forward_before = forward.seconds["forward"]
        start = time.perf_counter()
        outputs = engine.step()
        elapsed = time.perf_counter() - start
        profile.request_outputs += len(outputs)
        in_modules = sum(profile.seconds[p] - before.get(p, 0.0) for p in module_parts)
        profile.seconds["model glue"] += forward.seconds["forward"] - forward_before - in_modules
        timed = sum(profile.seconds.values()) - sum(before.values())
        profile.seconds["other"] += elapsed - timed
        profile.steps += 1
        profile.step_seconds += elapsed

    try:
        yield step
    finally:
        for handle in handles:
            handle.remove()
        for obj, name, original, was_instance_attribute in reversed(patched):
            if was_instance_attribute:
                setattr(obj, name, original)
            else:
                delattr(obj, name)  # the class's method shows again
