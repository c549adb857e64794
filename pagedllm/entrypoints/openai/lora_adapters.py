"""LoRA adapters on the OpenAI server: `model` names an adapter, /v1/models lists them, and
with runtime updating allowed (VLLM_ALLOW_RUNTIME_LORA_UPDATING, read by the CLI) adapters
load and unload through POST /v1/load_lora_adapter and /v1/unload_lora_adapter, as vLLM
(those routes: routers/admin.py). Here: the registry from --lora-modules, and the name
resolution every route uses."""

from __future__ import annotations

import logging
from typing import Any

from pagedllm.entrypoints.openai.serving_base import OpenAIError
from pagedllm.lora.registry import LoRARegistry
from pagedllm.lora.request import LoRARequest

logger = logging.getLogger(__name__)


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


async def check_in_engine(engine: Any, registry: LoRARegistry | None) -> None:
    """Once the engine is ready, load the --lora-modules adapters in its core, where their
    shapes are checked against the model; one refused there is unlisted (logged why)."""
    if registry is None or not registry.adapters():
        return
    try:
        await engine.wait_ready()
    except Exception:  # noqa: BLE001 -- the server stops on its own
        return
    for adapter in registry.adapters():
        try:
            await engine.add_lora(adapter)
        except ValueError as e:
            registry.remove(adapter.lora_name)
            logger.error("--lora-modules %s is refused and not served: %s", adapter.lora_name, e)
        except Exception as e:  # noqa: BLE001 -- a dead engine: the server stops
            logger.error("could not load --lora-modules %s in the engine: %s", adapter.lora_name, e)
            return


def resolve_model(name: str | None, model_names: tuple[str, ...], registry: LoRARegistry | None) -> LoRARequest | None:
    """The adapter a request's `model` names (None: the base model); a 404 for an unknown name."""
    if name is None or name in model_names:
        return None
    adapter = registry.get(name) if registry is not None else None
    if adapter is None:
        raise OpenAIError(f"The model `{name}` does not exist.", 404, "NotFoundError", "model")
    return adapter
