"""pagedllm: an LLM inference and serving engine with PagedAttention, CPU first."""

from typing import TYPE_CHECKING, Any

from pagedllm.thread_wait import set_default_spin_count

# Before anything imports torch (and with it libgomp, which reads this once): thread_wait.py.
set_default_spin_count()

from pagedllm.engine.beam_search import BeamSearchOutput, BeamSearchParams, BeamSearchSequence
from pagedllm.outputs import CompletionOutput, PoolingOutput, PoolingRequestOutput, RequestOutput
from pagedllm.pooling_params import PoolerConfig, PoolingParams
from pagedllm.sampling_params import SamplingParams, StructuredOutputsParams

if TYPE_CHECKING:
    from pagedllm.entrypoints.llm import LLM

__all__ = [
    "LLM", "SamplingParams", "StructuredOutputsParams", "RequestOutput", "CompletionOutput",
    "BeamSearchParams", "BeamSearchOutput", "BeamSearchSequence",
    "PoolingParams", "PoolerConfig", "PoolingOutput", "PoolingRequestOutput",
]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    # LLM imports torch and the model code: loaded on first use, so the server's front end
    # can start its engine-core process before paying for those imports.
    if name == "LLM":
        from pagedllm.entrypoints.llm import LLM

        return LLM
    raise AttributeError(f"module 'pagedllm' has no attribute {name!r}")
