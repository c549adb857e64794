"""pagedllm: an LLM inference and serving engine with PagedAttention, CPU first."""

from pagedllm.engine.beam_search import BeamSearchOutput, BeamSearchParams, BeamSearchSequence
from pagedllm.entrypoints.llm import LLM
from pagedllm.outputs import CompletionOutput, RequestOutput
from pagedllm.sampling_params import SamplingParams

__all__ = [
    "LLM", "SamplingParams", "RequestOutput", "CompletionOutput",
    "BeamSearchParams", "BeamSearchOutput", "BeamSearchSequence",
]
__version__ = "0.1.0"
