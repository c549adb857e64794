"""Multi-LoRA serving: many PEFT adapters over one base model, mixed in one batch (docs/lora.md).

torch-free here and in request.py / config.py (the control plane imports them); the worker
side (checkpoint.py, layers.py, manager.py) imports torch.
"""

from pagedllm.lora.config import LoRAConfig
from pagedllm.lora.request import LoRARequest

__all__ = ["LoRAConfig", "LoRARequest"]
