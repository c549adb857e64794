"""llama.cpp's `gpt-oss` GGUF files (models/gpt_oss.py's GGUFSpec): the config from the file's
`gpt-oss.*` keys (transformers' GGUF config reader fails on them), the o200k-shaped harmony
tokenizer and chat template from its tokenizer.* keys, MXFP4 experts kept as the file's blocks,
sinks and expert biases read; greedy equal to HF transformers (float32, DESIGN.md's tie rule
with test_moe.py's router-tie extension) on the HF checkpoint the file was written from.

The files are written by gpt_oss_gguf_utils.write_gpt_oss_gguf (gguf-py's writer, runs
everywhere); where PAGEDLLM_LLAMA_CPP_DIR names a llama.cpp tree, its own converter writes the
same checkpoints and the two files are compared key by key and tensor by tensor (bytes), and
the converter's file is loaded too."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from pagedllm.kernels import GGUFBlocks
from pagedllm.models.gpt_oss import GptOssMoE
from pagedllm.models.loader import load_model
from tests.models.gpt_oss_gguf_utils import (
    HARMONY_SPECIAL,
    gpt_oss_config,
    harmony_tokenizer,
    save_gpt_oss,
    write_gpt_oss_gguf,
)
from tests.models.test_moe import hf_greedy_router_ties
from tests.models.utils import bind_kv_caches, convert_with_llama_cpp, greedy_generate, llama_cpp_dir
from tests.utils import assert_greedy_match

NUM_STEPS = 16
TEXTS = [
    "Hello world, it's 12345 o'clock!",
    "<|start|>user<|message|>the thing<|end|><|start|>assistant",
    "  spaces\n\nand\ttabs... THE theory",
]


def _source(path: Path, mxfp4: bool) -> Any:
    """A random gpt-oss checkpoint (test_gpt_oss.py's shape, weights std 0.1, sinks N(1, 1) so
    they matter) over the harmony tokenizer, saved at `path`; its HF model. The float one sets
    YaRN's attention factor (1.25 for the default 1.35)."""
    from transformers import GptOssForCausalLM

    tokenizer = harmony_tokenizer()
    config = gpt_oss_config(len(tokenizer))
    if not mxfp4:  # YaRN's attention factor set (the converter's yarn_attn_factor key)
        config.rope_parameters = {**config.rope_parameters, "attention_factor": 1.25}
    torch.manual_seed(0)
    model = GptOssForCausalLM(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.copy_(1 + 0.1 * torch.randn_like(param))
            elif name.endswith("sinks"):
                param.copy_(1 + torch.randn_like(param))
            else:
                param.copy_(0.1 * torch.randn_like(param))
    save_gpt_oss(path, model, tokenizer, mxfp4)
    return model


@pytest.fixture(scope="module", params=[True, False], ids=["mxfp4", "float"])
def written(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Path, Path, bool]:
    """(HF model, HF directory, the GGUF written from it, MXFP4 experts?)."""
    root = tmp_path_factory.mktemp("gpt-oss-gguf")
    src = root / "src"
    src.mkdir()
    hf_model = _source(src, request.param)
    path = root / "tiny-gpt-oss.gguf"
    write_gpt_oss_gguf(src, path)
    return hf_model, src, path, request.param


PROMPT = torch.randint(0, 270, (20,), generator=torch.Generator().manual_seed(1)).tolist()


def _greedy(path: Path, quantization: str | None = None) -> tuple[Any, list[int]]:
    loaded = load_model(str(path), quantization=quantization)
    bind_kv_caches(loaded.model, num_blocks=8, block_size=16)
    with torch.inference_mode():
        return loaded, greedy_generate(loaded.model, PROMPT, NUM_STEPS).token_ids[len(PROMPT) :]


def test_transformers_cannot_read_the_config(written: tuple[Any, Path, Path, bool]) -> None:
    # Why the family reads its own config: transformers' GGUF reader fails on these keys (if
    # it ever reads them, the family's reader may go).
    from transformers import AutoConfig

    _, _, path, _ = written
    with pytest.raises(Exception):
        AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)


def test_config_and_tokenizer_from_the_file(written: tuple[Any, Path, Path, bool]) -> None:
    from transformers import AutoTokenizer

    hf_model, src, path, _ = written
    loaded = load_model(str(path))
    want, got = hf_model.config, loaded.hf_config
    for field in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                  "num_key_value_heads", "head_dim", "num_local_experts", "num_experts_per_tok", "sliding_window",
                  "max_position_embeddings", "layer_types", "swiglu_alpha", "swiglu_limit", "tie_word_embeddings"):
        assert getattr(got, field) == getattr(want, field), field
    assert got.rms_norm_eps == pytest.approx(want.rms_norm_eps)
    rope = {k: v for k, v in want.rope_parameters.items() if v is not None}
    assert {k: got.rope_parameters[k] for k in rope} == pytest.approx(rope)
    assert got.architectures == ["GptOssForCausalLM"]
    source = AutoTokenizer.from_pretrained(str(src))
    tokenizer = loaded.tokenizer
    for text in TEXTS:  # the o200k split, the merges, harmony's markers whole
        assert tokenizer.encode(text, add_special_tokens=False) == source.encode(text, add_special_tokens=False), text
        assert tokenizer.decode(source.encode(text, add_special_tokens=False)) == text
    ids = tokenizer.encode(TEXTS[1], add_special_tokens=False)
    assert ids[0] == tokenizer.convert_tokens_to_ids("<|start|>")
    assert tokenizer.convert_tokens_to_ids("<|message|>") in ids
    assert all(tokenizer.convert_tokens_to_ids(t) == source.convert_tokens_to_ids(t) for t in HARMONY_SPECIAL)
    assert (tokenizer.eos_token, tokenizer.bos_token) == ("<|return|>", "<|startoftext|>")
    chat = [{"role": "user", "content": "Hi"}]
    assert tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True, reasoning_effort="low") == (
        source.apply_chat_template(chat, tokenize=False, add_generation_prompt=True, reasoning_effort="low")
    )


def test_greedy_matches_hf(written: tuple[Any, Path, Path, bool]) -> None:
    hf_model, _, path, mxfp4 = written
    loaded, ours = _greedy(path)
    experts = [e for m in loaded.model.modules() if isinstance(m, GptOssMoE) for e in m.experts]
    assert experts
    if mxfp4:  # the file's MXFP4 blocks kept as they are, run by the GGUF kernels
        assert all(isinstance(e.gate_up_proj.blocks, GGUFBlocks) for e in experts)
        assert all(e.down_proj.blocks is not None and e.down_proj.blocks.type_name == "MXFP4" for e in experts)
    ref, gaps = hf_greedy_router_ties(hf_model, PROMPT, NUM_STEPS)
    assert_greedy_match(ours, ref, gaps, f"gpt-oss GGUF mxfp4={mxfp4}")


def test_greedy_matches_hf_dequantized(written: tuple[Any, Path, Path, bool]) -> None:
    # --quantization none: every tensor dequantized to float (MXFP4 exactly, by gguf-py), the
    # expert bias stacks split by the float reader.
    hf_model, _, path, mxfp4 = written
    _, ours = _greedy(path, quantization="none")
    ref, gaps = hf_greedy_router_ties(hf_model, PROMPT, NUM_STEPS)
    assert_greedy_match(ours, ref, gaps, f"gpt-oss GGUF dequantized mxfp4={mxfp4}")


@pytest.mark.slow  # the converter's own start (torch, transformers)
@pytest.mark.skipif(llama_cpp_dir() is None, reason="PAGEDLLM_LLAMA_CPP_DIR names no llama.cpp tree")
def test_written_as_llama_cpp_converter_writes(written: tuple[Any, Path, Path, bool]) -> None:
    """llama.cpp's convert_hf_to_gguf.py on the same HF directory: the same keys and values
    (but the pre-tokenizer's name, which the converter takes from a hash of known tokenizers'
    output: tests/models/utils.py's patch names it gpt-2), the same tensors (names, types,
    shapes, bytes); and its file loads and decodes as HF does."""
    import gguf
    import numpy as np

    hf_model, src, path, mxfp4 = written
    theirs_path = path.parent / "llama-cpp" / path.name
    theirs_path.parent.mkdir(exist_ok=True)
    convert_with_llama_cpp(src, theirs_path, "f32")
    ours, theirs = gguf.GGUFReader(str(path)), gguf.GGUFReader(str(theirs_path))

    def keys(reader: Any) -> dict[str, Any]:
        skip = ("GGUF.", "general.name", "general.size_label", "general.basename", "tokenizer.ggml.pre")
        return {k: f.contents() for k, f in reader.fields.items() if not k.startswith(skip)}

    assert keys(ours) == keys(theirs)
    assert theirs.fields["tokenizer.ggml.pre"].contents() == "gpt-2"
    tensors = {t.name: t for t in theirs.tensors}
    assert sorted(tensors) == sorted(t.name for t in ours.tensors)
    for t in ours.tensors:
        other = tensors[t.name]
        assert (t.tensor_type, list(t.shape)) == (other.tensor_type, list(other.shape)), t.name
        assert np.array_equal(np.asarray(t.data), np.asarray(other.data)), t.name
    assert {t.tensor_type.name for t in ours.tensors if "_exps.weight" in t.name} == {"MXFP4" if mxfp4 else "F32"}
    _, got = _greedy(theirs_path)
    ref, gaps = hf_greedy_router_ties(hf_model, PROMPT, NUM_STEPS)
    assert_greedy_match(got, ref, gaps, "gpt-oss GGUF by llama.cpp's converter")


def test_unsupported_rope_scaling_is_refused(tmp_path: Path) -> None:
    import gguf

    from pagedllm.models.gpt_oss_gguf import gpt_oss_metadata_from_gguf

    path = tmp_path / "bad.gguf"
    writer = gguf.GGUFWriter(str(path), "gpt-oss")
    writer.add_block_count(1)
    writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match=r"gpt-oss.rope.scaling.type 'linear' is not supported"):
        gpt_oss_metadata_from_gguf(gguf.GGUFReader(str(path)), str(tmp_path))


@pytest.mark.parametrize("num_reqs", [1, 2])
def test_fused_decode_runs_gpt_oss(written: tuple[Any, Path, Path, bool], num_reqs: int) -> None:
    # gpt-oss's decode steps in one compiled call (models/fused_decode.py): attention sinks, q/k/v/o
    # biases, YaRN's table, windowed (8) and full layers in KV cache groups of their own, the
    # biased router's softmax over the selected logits and the MXFP4 experts' grouped call with
    # their biases and clamped SwiGLU: the module path's floats exactly (the same kernels). Float
    # experts (no GGUF stacks) are refused by name and run module by module.
    from pagedllm.kernels import decode_layers_ops
    from pagedllm.kv_backends.paged.worker import allocate_kv_caches
    from pagedllm.layers.attention import Attention
    from tests.models.test_fused_decode import BLOCK_SIZE, _fused, compare_decode_steps

    if decode_layers_ops() is None:
        pytest.skip("the decode_layers extension did not build")
    _, _, path, mxfp4 = written
    loaded = load_model(str(path))
    layers = [m for m in loaded.model.modules() if isinstance(m, Attention)]
    assert all(layer.sinks is not None for layer in layers)
    groups = 1 + max(layer.kv_cache_group for layer in layers)
    allocate_kv_caches(layers, num_blocks=groups * 8 * num_reqs + 1, block_size=BLOCK_SIZE, dtype="float32")
    # The file's attention projections are float32: the fused kernel's sums against torch's
    # (float32 rounding; the hidden states are O(1), a dropped sink moves them by O(0.1)).
    calls = compare_decode_steps(loaded, num_reqs, steps=12, atol=1e-4, groups=groups)
    if mxfp4:
        assert calls == 12 and _fused(loaded)._unsupported is None
    else:
        assert calls == 0 and "not GGUF blocks" in _fused(loaded)._unsupported
