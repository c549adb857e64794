"""GPT-2's tiny checkpoint for the family test (test_families.py) and its own errors."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from pagedllm.models.loader import load_model
from tests.models.utils import TINY_BOS_ID, TINY_EOS_ID, FamilyCase, save_random_model


def tiny_gpt2_config() -> Any:
    from transformers import GPT2Config

    return GPT2Config(
        vocab_size=262, n_embd=64, n_layer=2, n_head=4, n_positions=256,
        bos_token_id=TINY_BOS_ID, eos_token_id=TINY_EOS_ID,
    )  # fmt: skip


FAMILY_CASES = [FamilyCase("gpt2", tiny_gpt2_config, fused=False)]


def test_unknown_activation_is_a_clear_error(tmp_path: Path) -> None:
    config = tiny_gpt2_config()
    config.activation_function = "swishy"
    save_random_model(tmp_path, tiny_gpt2_config())
    config.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="activation 'swishy' is not supported; supported: relu"):
        load_model(str(tmp_path))
