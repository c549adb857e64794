"""pagedllm: an LLM inference and serving engine with PagedAttention, CPU first."""

from pagedllm.engine.beam_search import BeamSearchOutput, BeamSearchParams, BeamSearchSequence
from pagedllm.entrypoints.llm import LLM
from pagedllm.outputs import CompletionOutput, RequestOutput
from pagedllm.sampling_params import SamplingParams, StructuredOutputsParams

__all__ = [
    "LLM", "SamplingParams", "StructuredOutputsParams", "RequestOutput", "CompletionOutput",
    "BeamSearchParams", "BeamSearchOutput", "BeamSearchSequence",
]
__version__ = "0.1.0"
