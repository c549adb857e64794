"""Idefics3 / SmolVLM: a SigLIP vision tower, a pixel-shuffle connector, a Llama.

Forward-only, HF parameter names (``model.vision_model.*``, ``model.connector.*``,
``model.text_model.*``, ``lm_head``). The language model is plain causal (models/llama.py's
modules); images enter as embeddings: ``encode_images(pixel_values)`` gives each image's
rows, which the runner writes over the image placeholders (worker/mm_embeds.py) and hands
to ``forward(..., inputs_embeds=...)``.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Iterable

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.layers.embedding import LMHead
from pagedllm.layers.utils import default_dtype
from pagedllm.models.family import ArchConfig, ModelFamily
from pagedllm.models.llama import PACKED_MODULES, LlamaModel, llama_arch_config
from pagedllm.layers.utils import get_weight_loader
from pagedllm.models.utils import load_named_weights
from pagedllm.multimodal.spec import ImageSpec

_TEXT_PREFIX = "model.text_model."


class VisionEmbeddings(nn.Module):
    """Patches -> [P, N, D] plus learned positions. Every patch of a tile is real (the image
    processor fills whole tiles), so position ids are 0..N-1 (HF buckets them only for
    partly padded tiles)."""

    def __init__(self, vc: Any) -> None:
        super().__init__()
        self.patch_embedding = nn.Conv2d(vc.num_channels, vc.hidden_size, vc.patch_size, stride=vc.patch_size)
        self.position_embedding = nn.Embedding((vc.image_size // vc.patch_size) ** 2, vc.hidden_size)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        # pixel_values: [P, C, H, W] -> [P, N, D]
        x = self.patch_embedding(pixel_values).flatten(2).transpose(1, 2)
        return x + self.position_embedding.weight[: x.shape[1]]


class VisionAttention(nn.Module):
    """Bidirectional multi-head attention over one tile's patches."""

    def __init__(self, vc: Any) -> None:
        super().__init__()
        d = vc.hidden_size
        self.num_heads = vc.num_attention_heads
        self.q_proj, self.k_proj, self.v_proj, self.out_proj = (nn.Linear(d, d) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [P, N, D] -> q, k, v: [P, H, N, D / H] -> [P, N, D]
        p, n, d = x.shape
        q, k, v = (proj(x).view(p, n, self.num_heads, -1).transpose(1, 2)
                   for proj in (self.q_proj, self.k_proj, self.v_proj))
        out = F.scaled_dot_product_attention(q, k, v)
        return self.out_proj(out.transpose(1, 2).reshape(p, n, d))


class VisionMLP(nn.Module):
    def __init__(self, vc: Any) -> None:
        super().__init__()
        self.fc1 = nn.Linear(vc.hidden_size, vc.intermediate_size)
        self.fc2 = nn.Linear(vc.intermediate_size, vc.hidden_size)
        # SigLIP's gelu_pytorch_tanh is GELU's tanh approximation.
        self.approximate = "tanh" if "tanh" in vc.hidden_act else "none"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x), approximate=self.approximate))


class VisionEncoderLayer(nn.Module):
    def __init__(self, vc: Any) -> None:
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(vc.hidden_size, eps=vc.layer_norm_eps)
        self.self_attn = VisionAttention(vc)
        self.layer_norm2 = nn.LayerNorm(vc.hidden_size, eps=vc.layer_norm_eps)
        self.mlp = VisionMLP(vc)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class VisionEncoder(nn.Module):
    def __init__(self, vc: Any) -> None:
        super().__init__()
        self.layers = nn.ModuleList(VisionEncoderLayer(vc) for _ in range(vc.num_hidden_layers))


class VisionTransformer(nn.Module):
    def __init__(self, vc: Any) -> None:
        super().__init__()
        self.embeddings = VisionEmbeddings(vc)
        self.encoder = VisionEncoder(vc)
        self.post_layernorm = nn.LayerNorm(vc.hidden_size, eps=vc.layer_norm_eps)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        # pixel_values: [P, C, H, W] -> [P, N, D]
        x = self.embeddings(pixel_values)
        for layer in self.encoder.layers:
            x = layer(x)
        return self.post_layernorm(x)


class ModalityProjection(nn.Module):
    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__()
        self.proj = nn.Linear(in_features, out_features, bias=False)


class Connector(nn.Module):
    """Pixel shuffle (each s x s block of patches becomes one token of s^2 * D features),
    then a linear map into the language model's hidden size."""

    def __init__(self, hf: Any) -> None:
        super().__init__()
        self.scale_factor = hf.scale_factor
        d = hf.vision_config.hidden_size * hf.scale_factor**2
        self.modality_projection = ModalityProjection(d, hf.text_config.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [P, N, D] with N = side^2 -> [P, N / s^2, D * s^2] -> [P, N / s^2, hidden]
        p, n, d = x.shape
        s, side = self.scale_factor, int(n**0.5)
        x = x.view(p, side, side // s, d * s)  # rows, column groups
        x = x.permute(0, 2, 1, 3).reshape(p, side // s, side // s, d * s * s)  # row groups
        x = x.permute(0, 2, 1, 3).reshape(p, n // (s * s), d * s * s)
        return self.modality_projection.proj(x)


class Idefics3Model(nn.Module):
    def __init__(self, arch: ArchConfig) -> None:
        super().__init__()
        hf = arch.hf
        self.vision_model = VisionTransformer(hf.vision_config)
        self.connector = Connector(hf)
        self.text_model = LlamaModel(arch)


class Idefics3ForConditionalGeneration(nn.Module):
    def __init__(self, arch: ArchConfig, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.config = arch.hf
        self.arch = arch
        with default_dtype(dtype):
            self.model = Idefics3Model(arch)
            self.lm_head = LMHead(arch.vocab_size, arch.hidden_size)
        if arch.tie_word_embeddings:
            self.lm_head.tie(self.model.text_model.embed_tokens)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, inputs_embeds: torch.Tensor | None = None
    ) -> torch.Tensor:
        # input_ids, positions: [T]; inputs_embeds: [T, hidden] (image rows written in) -> [T, hidden]
        return self.model.text_model(input_ids, positions, inputs_embeds)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        # input_ids: [T] -> [T, hidden]
        return self.model.text_model.embed_tokens(input_ids)

    def encode_images(self, pixel_values: torch.Tensor) -> torch.Tensor:
        # pixel_values: [P, C, H, W] (one image's tiles) -> [P * image_seq_len, hidden]
        x = pixel_values.to(self.model.connector.modality_projection.proj.weight.dtype)
        return self.model.connector(self.model.vision_model(x)).flatten(0, 1)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        # hidden_states: [N, hidden] -> logits: [N, vocab] float32
        return self.lm_head(hidden_states).float()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """The vision tower, connector and head by name; the Llama through its fused
        projections (models/utils.py). ValueError for a parameter the checkpoint lacks."""
        direct = {n: p for n, p in self.named_parameters() if not n.startswith(_TEXT_PREFIX)}
        filled: set[str] = set()

        def route(name: str, tensor: torch.Tensor) -> tuple[str, torch.Tensor] | None:
            if name.startswith(_TEXT_PREFIX):
                return name[len(_TEXT_PREFIX):], tensor
            if name == "lm_head.weight" and self.arch.tie_word_embeddings:
                return None
            param = direct.get(name)
            if param is None:
                raise ValueError(f"checkpoint tensor {name} has no parameter in {type(self).__name__}")
            get_weight_loader(param)(param, tensor, None)
            filled.add(name)
            return None

        text = load_named_weights(self.model.text_model, weights, stacked=PACKED_MODULES, transform=route)
        missing = sorted(set(direct) - filled)
        if missing:
            raise ValueError(f"checkpoint has no tensor for parameters: {', '.join(missing[:8])}")
        return {_TEXT_PREFIX + n for n in text} | filled


def _arch_config(hf: Any) -> ArchConfig:
    # The language model's facts; the vision tower reads hf.vision_config itself.
    tied = bool(getattr(hf, "tie_word_embeddings", False))
    return replace(llama_arch_config(hf.text_config, tie_word_embeddings=tied), hf=hf)


def _image_seq_len(hf: Any) -> int:
    vc = hf.vision_config
    return (vc.image_size // vc.patch_size) ** 2 // hf.scale_factor**2


FAMILIES = (
    ModelFamily(
        name="Idefics3",
        architectures=("Idefics3ForConditionalGeneration",),
        model_class=Idefics3ForConditionalGeneration,
        arch_config=_arch_config,
        packed_modules=PACKED_MODULES,
        image=ImageSpec(
            image_token=lambda hf: hf.image_token_id,
            embeds_per_tile=_image_seq_len,
            image_end_token="<global-img>",
        ),
    ),
)
