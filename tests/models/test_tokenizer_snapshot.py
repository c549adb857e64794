"""The snapshot config and tokenizer of a GGUF cache (models/tokenizer_snapshot.py) answer as
transformers' config and tokenizer of the same directory, and a warm start of the default
model never imports transformers."""

from __future__ import annotations

import json
import os
import pickle
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from pagedllm.models.gguf_loader import gguf_to_hf_dir
from pagedllm.models.loader import _load_config, _load_tokenizer, resolve_checkpoint
from pagedllm.models.tokenizer_snapshot import SNAPSHOT_FILE, SnapshotTokenizer, load_snapshot
from tests.conftest import DEFAULT_MODEL

TEXTS = [
    "Hello, my name is",
    "",
    " leading and trailing spaces  ",
    "Line one\nline two\n\n\ttabbed",
    "Ünïcödé: naïve café, 日本語のテキスト, emoji 🤖🚀, Ελληνικά",
    "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n",
    "text with <|endoftext|> inside and <repo_name> too",
    "don't won't they're I'm it's we've . , ! ?",
    "def f(x):\n    return x ** 2  # code\n",
    "a" * 300,
]

CONVERSATIONS: list[list[dict[str, Any]]] = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
     {"role": "assistant", "content": "Hello! How can I help?"}, {"role": "user", "content": "Tell me a joke."}],
    [{"role": "user", "content": "Ünïcödé 🤖", "name": None}],
    [{"role": "user", "content": "Think first."}, {"role": "assistant", "content": "Sure", "reasoning": "hmm"}],
]

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]

# A template that reads what transformers puts in a template's reach: special tokens, tools,
# documents, variables, tojson's non-ASCII output, namespace, loop controls and the reasoning aliases.
PROBE_TEMPLATE = (
    "{{ bos_token }}{% set ns = namespace(n=0) %}"
    "{% for m in messages %}{% if m.role == 'system' %}{% continue %}{% endif %}{% set ns.n = ns.n + 1 %}"
    "[{{ m.role }}|{{ m.content }}|{{ m.thinking }}|{{ m.reasoning_content }}|{{ m | tojson }}]\n"
    "{% endfor %}{{ ns.n }}|{{ tools | tojson }}|{{ documents | tojson(indent=2) }}|{{ flag }}|{{ eos_token }}"
    "{% generation %}G{% endgeneration %}{% if add_generation_prompt %}<gen>{% endif %}"
)


@pytest.fixture(scope="module")
def model_dir() -> str:
    gguf_path, _ = resolve_checkpoint(DEFAULT_MODEL)
    assert gguf_path is not None
    directory = gguf_to_hf_dir(gguf_path)
    if load_snapshot(directory) is None:  # the loader's first load writes it
        _load_tokenizer(directory, _load_config(directory, from_gguf=False)[0])
    return directory


@pytest.fixture(scope="module")
def pair(model_dir: str) -> tuple[Any, SnapshotTokenizer]:
    from transformers import AutoTokenizer

    snapshot = load_snapshot(model_dir)
    assert snapshot is not None, f"no {SNAPSHOT_FILE} in {model_dir}"
    return AutoTokenizer.from_pretrained(model_dir), snapshot[1]


def test_config_matches_transformers(model_dir: str) -> None:
    from transformers import AutoConfig

    hf = AutoConfig.from_pretrained(model_dir).to_dict()
    snap = load_snapshot(model_dir)
    assert snap is not None
    ours = snap[0].to_dict()
    for key in ("architectures", "model_type", "hidden_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "intermediate_size", "vocab_size", "max_position_embeddings",
                "rms_norm_eps", "rope_parameters", "tie_word_embeddings", "bos_token_id", "eos_token_id"):
        assert ours[key] == hf[key], key
    assert set(ours) == set(hf)


def test_encode_matches_transformers(pair: tuple[Any, SnapshotTokenizer]) -> None:
    hf, ours = pair
    for text in TEXTS:
        for special in (True, False):
            assert ours.encode(text, add_special_tokens=special) == hf.encode(text, add_special_tokens=special), text


def test_decode_matches_transformers(pair: tuple[Any, SnapshotTokenizer]) -> None:
    hf, ours = pair
    rng = random.Random(0)
    sequences = [hf.encode(t) for t in TEXTS]
    sequences += [[rng.randrange(len(hf)) for _ in range(rng.randrange(1, 40))] for _ in range(50)]
    sequences += [[0, 1, 2, 1, 2], [2], [5, 9, 16]]  # special and added tokens only
    for ids in sequences:
        for skip in (True, False):
            for clean in (None, True, False):
                assert ours.decode(ids, skip_special_tokens=skip, clean_up_tokenization_spaces=clean) == hf.decode(
                    ids, skip_special_tokens=skip, clean_up_tokenization_spaces=clean), ids
    assert ours.decode(7) == hf.decode(7)
    assert ours.batch_decode(sequences[:5]) == hf.batch_decode(sequences[:5])
    assert ours.decode(sequences[:3]) == hf.decode(sequences[:3])


def test_vocabulary_facts_match_transformers(pair: tuple[Any, SnapshotTokenizer]) -> None:
    hf, ours = pair
    for name in ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id", "bos_token", "eos_token",
                 "vocab_size", "all_special_ids", "all_special_tokens", "special_tokens_map",
                 "added_tokens_encoder", "chat_template", "clean_up_tokenization_spaces"):
        assert getattr(ours, name) == getattr(hf, name), name
    assert ours.get_added_vocab() == hf.get_added_vocab()
    assert ours.get_vocab() == hf.get_vocab()  # the input processor bounds prompt characters by it
    assert len(ours) == len(hf)
    # Not written here: answered by transformers' tokenizer of the same directory.
    assert ours.convert_ids_to_tokens([1, 2, 300]) == hf.convert_ids_to_tokens([1, 2, 300])
    assert ours(TEXTS[0])["input_ids"] == hf(TEXTS[0])["input_ids"]


@pytest.mark.parametrize("template", [None, PROBE_TEMPLATE], ids=["model", "probe"])
def test_chat_template_matches_transformers(pair: tuple[Any, SnapshotTokenizer], template: str | None) -> None:
    hf, ours = pair
    calls: list[dict[str, Any]] = []
    for conv in CONVERSATIONS:
        calls += [dict(add_generation_prompt=True), dict(add_generation_prompt=False), dict(tools=TOOLS),
                  dict(documents=[{"title": "T", "text": "Ü"}], flag=[1, "x"])]
        if conv[-1]["role"] == "assistant":
            calls.append(dict(continue_final_message=True))
        for kwargs in calls:
            want = hf.apply_chat_template(conv, chat_template=template, tokenize=False, **kwargs)
            assert ours.apply_chat_template(conv, chat_template=template, tokenize=False, **kwargs) == want, kwargs
    batch = ours.apply_chat_template(CONVERSATIONS, chat_template=template, tokenize=False)
    assert batch == hf.apply_chat_template(CONVERSATIONS, chat_template=template, tokenize=False)
    assert CONVERSATIONS[3][-1] == {"role": "assistant", "content": "Sure", "reasoning": "hmm"}, "input edited"


def test_chat_template_errors_and_tokenized_calls_match_transformers(pair: tuple[Any, SnapshotTokenizer]) -> None:
    hf, ours = pair
    conv = CONVERSATIONS[1]
    assert ours.apply_chat_template(conv, tokenize=True, return_dict=False) == hf.apply_chat_template(
        conv, tokenize=True, return_dict=False)
    for bad in ("{{ raise_exception('no') }}", "{% set ns = namespace(_x=1) %}"):
        with pytest.raises(Exception) as ours_error:
            ours.apply_chat_template(conv, chat_template=bad, tokenize=False)
        with pytest.raises(Exception) as hf_error:
            hf.apply_chat_template(conv, chat_template=bad, tokenize=False)
        assert type(ours_error.value) is type(hf_error.value)
    with pytest.raises(ValueError):
        ours.apply_chat_template([], tokenize=False)


def test_pickles_without_transformers_state(pair: tuple[Any, SnapshotTokenizer]) -> None:
    _, ours = pair
    ours.hf_tokenizer()  # built: not part of the pickle
    copy = pickle.loads(pickle.dumps(ours))
    assert copy._hf is None
    assert copy.encode(TEXTS[4]) == ours.encode(TEXTS[4])
    assert copy.apply_chat_template(CONVERSATIONS[0], tokenize=False) == ours.apply_chat_template(
        CONVERSATIONS[0], tokenize=False)


@pytest.mark.slow
def test_warm_start_of_the_default_model_imports_no_transformers(model_dir: str) -> None:
    """LLM(default model) and a first token in a fresh process, the cache warm (model_dir
    wrote the snapshot): transformers is never imported."""
    code = (
        "import sys\n"
        "from pagedllm import LLM, SamplingParams\n"
        f"llm = LLM({DEFAULT_MODEL!r}, max_model_len=256, kv_cache_memory_bytes='64MiB')\n"
        "out = llm.chat([{'role': 'user', 'content': 'Hi'}], SamplingParams(max_tokens=2, temperature=0))\n"
        "assert out[0].outputs[0].token_ids, out\n"
        "print('TRANSFORMERS', 'transformers' in sys.modules)\n"
    )
    root = Path(__file__).resolve().parents[2]
    env = dict(os.environ, PYTHONPATH=str(root))
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "TRANSFORMERS False" in done.stdout, done.stdout + done.stderr[-3000:]


def test_no_snapshot_for_a_tokenizer_class_with_its_own_decoding(tmp_path: Path, model_dir: str) -> None:
    """A transformers class that overrides how it decodes (or encodes, renders) is not what
    the backend's state alone answers: no snapshot, transformers keeps answering."""
    from transformers import AutoConfig, AutoTokenizer

    from pagedllm.models.tokenizer_snapshot import write_snapshot

    hf = AutoTokenizer.from_pretrained(model_dir)
    config = AutoConfig.from_pretrained(model_dir)

    class Shouting(type(hf)):  # type: ignore[misc]
        def _decode(self, *args: Any, **kwargs: Any) -> str:
            return super()._decode(*args, **kwargs).upper()

    hf.__class__ = Shouting
    assert not write_snapshot(config, hf, str(tmp_path))
    assert load_snapshot(str(tmp_path)) is None
    hf.__class__ = Shouting.__mro__[1]
    assert write_snapshot(config, hf, str(tmp_path)) and load_snapshot(str(tmp_path)) is not None


def test_a_snapshot_from_another_transformers_version_is_not_used(tmp_path: Path, model_dir: str) -> None:
    import json
    import shutil

    for name in (SNAPSHOT_FILE, "snapshot_tokenizer.json"):
        shutil.copy(os.path.join(model_dir, name), tmp_path / name)
    assert load_snapshot(str(tmp_path)) is not None
    snapshot = json.loads((tmp_path / SNAPSHOT_FILE).read_text())
    snapshot["transformers"] = "0.0.1"
    (tmp_path / SNAPSHOT_FILE).write_text(json.dumps(snapshot))
    assert load_snapshot(str(tmp_path)) is None


@pytest.mark.parametrize("config_class", ["Qwen3MoeConfig", "MixtralConfig", "GPT2Config"])
def test_snapshot_config_answers_the_config_class_aliases(tmp_path: Path, model_dir: str, config_class: str) -> None:
    """A config class's attribute_map aliases (Qwen3-MoE's num_experts is num_local_experts,
    GPT-2's hidden_size is n_embd) answer from the snapshot as from transformers; a name that
    is neither a field nor an alias is an AttributeError."""
    import transformers
    from transformers import AutoTokenizer

    from pagedllm.models.tokenizer_snapshot import write_snapshot

    config = getattr(transformers, config_class)()
    assert config.attribute_map  # the case under test
    assert write_snapshot(config, AutoTokenizer.from_pretrained(model_dir), str(tmp_path))
    snap = load_snapshot(str(tmp_path))
    assert snap is not None
    snap_config = snap[0]
    for alias in config.attribute_map:
        assert getattr(snap_config, alias) == getattr(config, alias), alias
    assert snap_config.to_dict() == json.loads(json.dumps(config.to_dict()))
    with pytest.raises(AttributeError):
        snap_config.no_such_field
    assert pickle.loads(pickle.dumps(snap_config)).to_dict() == snap_config.to_dict()
