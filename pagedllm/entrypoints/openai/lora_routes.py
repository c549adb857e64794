"""LoRA adapters on the OpenAI server: `model` names an adapter, /v1/models lists them, and
with runtime updating allowed (VLLM_ALLOW_RUNTIME_LORA_UPDATING, read by the CLI) adapters
load and unload through POST /v1/load_lora_adapter and /v1/unload_lora_adapter, as vLLM."""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel

from pagedllm.entrypoints.openai.serving_base import OpenAIError, bad_request
from pagedllm.lora.registry import LoRARegistry
from pagedllm.lora.request import LoRARequest

logger = logging.getLogger(__name__)


class LoadLoRAAdapterRequest(BaseModel):
    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(BaseModel):
    lora_name: str
    lora_int_id: int | None = None


def build_lora_registry(engine_args: Any, lora_modules: tuple[dict, ...], model_names: tuple[str, ...]) -> LoRARegistry | None:
    """The adapters of --lora-modules (None without --enable-lora); ValueError for a bad one."""
    if not engine_args.enable_lora:
        if lora_modules:
            raise ValueError("--lora-modules needs --enable-lora")
        return None
    registry = LoRARegistry(engine_args.max_lora_rank, model_names)
    for module in lora_modules:
        registry.add(module["name"], module["path"], module.get("base_model_name"))
    return registry


def resolve_model(name: str | None, model_names: tuple[str, ...], registry: LoRARegistry | None) -> LoRARequest | None:
    """The adapter a request's `model` names (None: the base model); a 404 for an unknown name."""
    if name is None or name in model_names:
        return None
    adapter = registry.get(name) if registry is not None else None
    if adapter is None:
        raise OpenAIError(f"The model `{name}` does not exist.", 404, "NotFoundError", "model")
    return adapter


def add_lora_routes(app: FastAPI, registry: LoRARegistry | None, allow_runtime_updating: bool) -> None:
    if registry is None or not allow_runtime_updating:
        return

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(body: LoadLoRAAdapterRequest) -> PlainTextResponse:
        try:
            adapter = registry.add(body.lora_name, body.lora_path)
        except ValueError as e:
            raise bad_request(str(e), "lora_name" if "already loaded" in str(e) else "lora_path") from None
        logger.info("LoRA adapter %s loaded from %s (id %d)", adapter.lora_name, adapter.lora_path, adapter.lora_int_id)
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(body: UnloadLoRAAdapterRequest) -> PlainTextResponse:
        try:
            registry.remove(body.lora_name)
        except KeyError:
            raise OpenAIError(f"The lora adapter '{body.lora_name}' cannot be found.", 404, "NotFoundError",
                              "lora_name") from None
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")
