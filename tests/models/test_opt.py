"""OPT's tiny checkpoints (pre-norm, and post-norm with projected embeddings as OPT-350m) for
the family test (test_families.py)."""

from __future__ import annotations

from typing import Any

from tests.models.utils import TINY_BOS_ID, TINY_EOS_ID, FamilyCase


def tiny_opt_config(post_norm: bool = False) -> Any:
    from transformers import OPTConfig

    return OPTConfig(
        vocab_size=262, hidden_size=64, ffn_dim=128, num_hidden_layers=2,
        num_attention_heads=4, max_position_embeddings=256, pad_token_id=1,
        word_embed_proj_dim=32 if post_norm else 64, do_layer_norm_before=not post_norm,
        bos_token_id=TINY_BOS_ID, eos_token_id=TINY_EOS_ID,
    )  # fmt: skip


FAMILY_CASES = [
    FamilyCase("opt", tiny_opt_config, fused=False),
    FamilyCase("opt-post-norm", lambda: tiny_opt_config(post_norm=True), fused=False),
]
