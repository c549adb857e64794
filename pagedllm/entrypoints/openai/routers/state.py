"""What the routes share: the engine, the served names and the serving objects."""

from __future__ import annotations

from dataclasses import dataclass

from fastapi import Request

from pagedllm.engine.async_llm import AsyncLLM
from pagedllm.entrypoints.openai.lora_adapters import resolve_model
from pagedllm.entrypoints.openai.serving_chat import OpenAIServingChat
from pagedllm.entrypoints.openai.serving_completion import OpenAIServingCompletion
from pagedllm.lora.registry import LoRARegistry
from pagedllm.lora.request import LoRARequest


@dataclass(frozen=True)
class ServerState:
    """One app's serving objects (``app.state.server``)."""

    engine: AsyncLLM
    model_names: tuple[str, ...]
    """What clients may send as `model`; the first is the one reported."""
    loras: LoRARegistry | None
    """The adapters (None without --enable-lora)."""
    completion: OpenAIServingCompletion
    chat: OpenAIServingChat

    def resolve_model(self, name: str | None) -> LoRARequest | None:
        """The adapter `name` names (None: the base model); a 404 for an unknown name."""
        return resolve_model(name, self.model_names, self.loras)

    def check_ready(self) -> None:
        """A 503 with Retry-After until the engine is loaded (EngineNotReadyError)."""
        self.engine._check_ready()


def server_state(request: Request) -> ServerState:
    """The FastAPI dependency through which every handler reads its app's state."""
    return request.app.state.server
