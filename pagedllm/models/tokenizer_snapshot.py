"""A GGUF model's config and tokenizer without importing transformers (a warm start's path).

Importing transformers and building its config and tokenizer took 2-3.5 s of a 4-7 s start
of the default model. The first load of a GGUF file's cache directory, which builds both
with transformers anyway, writes a snapshot of them beside its metadata: `snapshot.json`,
holding the config's full `to_dict()` and what the tokenizer's answers depend on (special
tokens and ids, added vocabulary, vocabulary size, clean-up setting, chat template), and
`snapshot_tokenizer.json`, the `tokenizers` state the transformers tokenizer runs on. Later
loads (with the same snapshot format and transformers version) build `SnapshotConfig` and
`SnapshotTokenizer` from these:
- encoding and decoding run on the same `tokenizers.Tokenizer` state as transformers' does,
  with its defaults (special tokens added, cleaned-up spaces where it would clean them);
- chat templates render as transformers renders them (chat_template.py) for plain data;
- anything else (a method not written here, callable tools, a tokenized chat, xgrammar's
  vocabulary) goes to the transformers tokenizer of the same directory, built on first use
  (`hf_tokenizer()`).
tests/models/test_tokenizer_snapshot.py checks the answers against transformers'.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any

logger = logging.getLogger(__name__)

SNAPSHOT_FILE = "snapshot.json"
TOKENIZER_FILE = "snapshot_tokenizer.json"
# Raised when what a snapshot holds or means changes: older snapshots are then rewritten.
_SNAPSHOT_VERSION = 2  # 2: the config's attribute aliases

# apply_chat_template's parameters that only transformers handles, at their defaults: a call
# that sets any other value goes to transformers.
_TRANSFORMERS_ONLY_ARGS: dict[str, Any] = dict(
    sanitize_control_tokens=False, padding=False, truncation=False, max_length=None, return_tensors=None,
    return_dict=True, return_assistant_tokens_mask=False, tokenizer_kwargs=None,
)


class SnapshotConfig:
    """The HF config's fields as attributes (what the families and the loader read), and its
    class's `attribute_map` aliases (Qwen3-MoE's and Mixtral's `num_experts` is the field
    `num_local_experts`; GPT-2's `hidden_size` is `n_embd`)."""

    def __init__(self, fields: dict[str, Any], aliases: dict[str, str] | None = None) -> None:
        self.__dict__.update(fields)
        self.__dict__["_aliases"] = dict(aliases or {})

    def __getattr__(self, name: str) -> Any:  # only for names that are not fields
        field = self.__dict__.get("_aliases", {}).get(name)
        if field is None or field not in self.__dict__:
            raise AttributeError(f"'SnapshotConfig' object has no attribute '{name}'")
        return self.__dict__[field]

    def to_dict(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k != "_aliases"}

    def __repr__(self) -> str:
        return f"SnapshotConfig({json.dumps(self.to_dict(), sort_keys=True, default=str)})"


class SnapshotTokenizer:
    """The tokenizer of an HF-format directory, answering as transformers' TokenizersBackend
    over the same state (see the module docstring)."""

    def __init__(self, backend: Any, meta: dict[str, Any], source_dir: str) -> None:
        self._backend = backend  # tokenizers.Tokenizer
        self._meta = meta
        self.source_dir = source_dir
        self._hf: Any = None
        self.chat_template: str | dict | None = meta["chat_template"]
        self.special_tokens_map: dict[str, str] = meta["special_tokens_map"]
        self.all_special_ids: list[int] = meta["all_special_ids"]
        self.all_special_tokens: list[str] = meta["all_special_tokens"]
        self.added_tokens_encoder: dict[str, int] = meta["added_tokens_encoder"]
        self.vocab_size: int = meta["vocab_size"]
        self.clean_up_tokenization_spaces: bool = meta["clean_up_tokenization_spaces"]
        for name in ("bos", "eos", "unk", "pad"):
            setattr(self, f"{name}_token", self.special_tokens_map.get(f"{name}_token"))
            setattr(self, f"{name}_token_id", meta["special_token_ids"].get(f"{name}_token"))

    def __len__(self) -> int:
        return self._meta["len"]

    def get_vocab(self) -> dict[str, int]:
        # as transformers' fast tokenizer answers it (its backend's, added tokens included)
        return self._backend.get_vocab(with_added_tokens=True)

    def get_added_vocab(self) -> dict[str, int]:
        return dict(self._meta["added_vocab"])

    def encode(self, text: str, add_special_tokens: bool = True, **kwargs: Any) -> list[int]:
        if kwargs or not isinstance(text, str):
            return self.hf_tokenizer().encode(text, add_special_tokens=add_special_tokens, **kwargs)
        return self._backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids: Any, skip_special_tokens: bool = False,
               clean_up_tokenization_spaces: bool | None = None, **kwargs: Any) -> Any:
        if kwargs:
            return self.hf_tokenizer().decode(token_ids, skip_special_tokens=skip_special_tokens,
                                              clean_up_tokenization_spaces=clean_up_tokenization_spaces, **kwargs)
        if hasattr(token_ids, "tolist"):  # a tensor or array
            token_ids = token_ids.tolist()
        if isinstance(token_ids, int):
            token_ids = [token_ids]
        if token_ids and isinstance(token_ids[0], (list, tuple)):
            return [self._decode_one(list(s), skip_special_tokens, clean_up_tokenization_spaces) for s in token_ids]
        return self._decode_one(list(token_ids), skip_special_tokens, clean_up_tokenization_spaces)

    def batch_decode(self, sequences: Any, skip_special_tokens: bool = False,
                     clean_up_tokenization_spaces: bool | None = None, **kwargs: Any) -> list[str]:
        if kwargs:
            return self.hf_tokenizer().batch_decode(sequences, skip_special_tokens=skip_special_tokens,
                                                    clean_up_tokenization_spaces=clean_up_tokenization_spaces, **kwargs)
        return [self._decode_one(list(s), skip_special_tokens, clean_up_tokenization_spaces) for s in sequences]

    def _decode_one(self, ids: list[int], skip_special_tokens: bool, clean_up: bool | None) -> str:
        text = self._backend.decode(ids, skip_special_tokens=skip_special_tokens)
        if clean_up is None:
            clean_up = self.clean_up_tokenization_spaces
        if clean_up and self._meta["clean_up_applies"]:
            text = _clean_up_spaces(text)
        return text

    def apply_chat_template(
        self, conversation: Any, tools: Any = None, documents: Any = None, chat_template: Any = None,
        add_generation_prompt: bool = False, continue_final_message: bool | str = False, tokenize: bool = True,
        sanitize_control_tokens: bool = False, padding: Any = False, truncation: bool = False,
        max_length: int | None = None, return_tensors: Any = None, return_dict: bool = True,
        return_assistant_tokens_mask: bool = False, tokenizer_kwargs: dict[str, Any] | None = None, **kwargs: Any,
    ) -> Any:
        """Rendered here when untokenized, over plain data and a single template; else by
        transformers (the named parameters are transformers' own, so callers that tell
        template variables from call parameters by this signature see the same ones)."""
        args = dict(tools=tools, documents=documents, chat_template=chat_template,
                    add_generation_prompt=add_generation_prompt, continue_final_message=continue_final_message,
                    tokenize=tokenize, sanitize_control_tokens=sanitize_control_tokens, padding=padding,
                    truncation=truncation, max_length=max_length, return_tensors=return_tensors,
                    return_dict=return_dict, return_assistant_tokens_mask=return_assistant_tokens_mask,
                    tokenizer_kwargs=tokenizer_kwargs)
        rendered = self._render_natively(conversation, args, kwargs)
        if rendered is not None:
            return rendered
        return self.hf_tokenizer().apply_chat_template(conversation, **args, **kwargs)

    def _render_natively(self, conversation: Any, args: dict[str, Any], kwargs: dict[str, Any]) -> Any:
        from pagedllm.models import chat_template as ct

        template = args["chat_template"] if args["chat_template"] is not None else self.chat_template
        if (args["tokenize"] or any(args[k] != v for k, v in _TRANSFORMERS_ONLY_ARGS.items())
                or not isinstance(template, str) or isinstance(self.chat_template, dict)
                or not isinstance(conversation, (list, tuple)) or not conversation):
            return None
        batched = isinstance(conversation[0], (list, tuple))
        conversations = list(conversation) if batched else [conversation]
        inputs = (conversations, args["tools"], args["documents"], kwargs)
        if not ct.is_plain(inputs) or not all(type(m) is dict for c in conversations for m in c):
            return None
        if args["continue_final_message"] and args["add_generation_prompt"]:
            return None  # transformers' error
        texts = ct.render(template, conversations, self.special_tokens_map, tools=args["tools"],
                          documents=args["documents"], add_generation_prompt=args["add_generation_prompt"],
                          continue_final_message=args["continue_final_message"], variables=kwargs)
        return texts if batched else texts[0]

    def hf_tokenizer(self) -> Any:
        """The transformers tokenizer of the same directory (imports transformers: seconds)."""
        if self._hf is None:
            from transformers import AutoTokenizer

            logger.info("building the transformers tokenizer of %s", self.source_dir)
            self._hf = AutoTokenizer.from_pretrained(self.source_dir)
        return self._hf

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.hf_tokenizer()(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self.hf_tokenizer(), name)

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_hf": None}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)


def transformers_tokenizer(tokenizer: Any) -> Any:
    """`tokenizer` as a transformers tokenizer (for libraries that read one's internals, such
    as xgrammar's vocabulary): a SnapshotTokenizer's own, built on first use."""
    return tokenizer.hf_tokenizer() if isinstance(tokenizer, SnapshotTokenizer) else tokenizer


def _clean_up_spaces(text: str) -> str:
    """transformers' clean_up_tokenization: no space before punctuation and contractions."""
    for spaced, joined in ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"),
                           (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re")):
        text = text.replace(spaced, joined)
    return text


def write_snapshot(hf_config: Any, hf_tokenizer: Any, out_dir: str) -> bool:
    """Write the snapshot of a config and tokenizer transformers built from `out_dir`; False
    (nothing written) where the snapshot could not answer as they do: a config with nested
    configs, a tokenizer not backed by `tokenizers`, or an unwritable directory."""
    backend = getattr(hf_tokenizer, "_tokenizer", None)
    if (getattr(hf_config, "sub_configs", None) or backend is None or not hasattr(backend, "to_str")
            or not _answers_from_backend(type(hf_tokenizer))):
        return False
    model_kind = type(backend.model).__name__
    force_clean = getattr(hf_tokenizer, "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output", False)
    special = dict(hf_tokenizer.special_tokens_map)
    meta = {
        "special_tokens_map": special,
        "special_token_ids": {k: hf_tokenizer.convert_tokens_to_ids(v) for k, v in special.items()},
        "all_special_ids": list(hf_tokenizer.all_special_ids),
        "all_special_tokens": list(hf_tokenizer.all_special_tokens),
        "added_tokens_encoder": dict(hf_tokenizer.added_tokens_encoder),
        "added_vocab": dict(hf_tokenizer.get_added_vocab()),
        "vocab_size": int(hf_tokenizer.vocab_size),
        "len": len(hf_tokenizer),
        "clean_up_tokenization_spaces": bool(hf_tokenizer.clean_up_tokenization_spaces),
        "clean_up_applies": model_kind != "BPE" or bool(force_clean),
        "chat_template": hf_tokenizer.chat_template,
    }
    aliases = dict(getattr(type(hf_config), "attribute_map", None) or {})
    snapshot = {"version": _SNAPSHOT_VERSION, "transformers": _transformers_version(), "config": hf_config.to_dict(),
                "config_aliases": aliases, "tokenizer": meta}
    try:
        text = json.dumps(snapshot)
    except (TypeError, ValueError):  # a config value that is not JSON: keep transformers' path
        return False
    try:
        _write_atomically(os.path.join(out_dir, TOKENIZER_FILE), backend.to_str())
        _write_atomically(os.path.join(out_dir, SNAPSHOT_FILE), text)  # last: its presence means complete
    except OSError as e:
        logger.info("no config/tokenizer snapshot in %s: %s", out_dir, e)
        return False
    return True


# The methods whose answers the snapshot reproduces from the backend's state.
_SNAPSHOT_METHODS = ("encode", "decode", "_decode", "batch_decode", "_encode_plus", "apply_chat_template",
                     "get_added_vocab", "convert_tokens_to_string")


def _answers_from_backend(cls: type) -> bool:
    """Whether a transformers tokenizer class encodes, decodes and renders as its
    `tokenizers`-backed base does (the families' classes only build the backend in
    __init__); a class that overrides one of those gets no snapshot."""
    base = next((c for c in cls.__mro__ if c.__name__ in ("TokenizersBackend", "PreTrainedTokenizerFast")), None)
    return base is not None and all(getattr(cls, m, None) is getattr(base, m, None) for m in _SNAPSHOT_METHODS)


def load_snapshot(model_dir: str) -> tuple[SnapshotConfig, SnapshotTokenizer] | None:
    """The config and tokenizer of a snapshot in `model_dir`, or None where there is none
    (or an older version)."""
    try:
        with open(os.path.join(model_dir, SNAPSHOT_FILE)) as f:
            snapshot = json.load(f)
    except (OSError, ValueError):
        return None
    if snapshot.get("version") != _SNAPSHOT_VERSION or snapshot.get("transformers") != _transformers_version():
        return None  # written by other code: transformers answers, and the snapshot is rewritten
    from tokenizers import Tokenizer

    backend = Tokenizer.from_file(os.path.join(model_dir, TOKENIZER_FILE))
    return (SnapshotConfig(snapshot["config"], snapshot["config_aliases"]),
            SnapshotTokenizer(backend, snapshot["tokenizer"], model_dir))


def _transformers_version() -> str | None:
    """The installed transformers' version, read from its package metadata (no import)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("transformers")
    except PackageNotFoundError:
        return None


def _write_atomically(path: str, text: str) -> None:
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)
