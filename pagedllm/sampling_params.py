"""SamplingParams: how to sample a request's output, validated at construction."""

from __future__ import annotations

import json as _json
from dataclasses import dataclass, field
from typing import Any

# Fields accepted for vLLM compatibility whose behaviour has not landed yet: a non-default
# value raises instead of being silently ignored. Remove a name when its behaviour lands.
_NOT_YET_SUPPORTED: dict[str, object] = {}

MAX_N = 128
"""Most sequences one request may ask for (vLLM's VLLM_MAX_N_SEQUENCES is 256)."""
MAX_LOGPROBS = 20
"""vLLM's default max_logprobs: the most top logprobs per position unless --max-logprobs says
otherwise (checked by InputProcessor.validate)."""


@dataclass
class StructuredOutputsParams:
    """Constrain the output to a JSON schema, JSON object, regex, choice, EBNF grammar or
    structural tag (as vLLM's). Exactly one must be given; the grammar decides where the
    output ends."""

    json: dict | str | type | None = None
    """A JSON schema: a dict, a JSON string, or a pydantic model class (its schema)."""
    regex: str | None = None
    """The whole output matches this regular expression."""
    choice: list[str] | None = None
    """The output is exactly one of these strings."""
    grammar: str | None = None
    """An EBNF grammar (GBNF style) whose start rule is ``root``."""
    json_object: bool | None = None
    """Any JSON object."""
    structural_tag: str | dict | None = None
    """xgrammar's structural tag (JSON text or a dict): ``{"type": "structural_tag", "format":
    {...}}``, or the older ``{"structures": [{"begin", "schema", "end"}], "triggers": [...]}``
    (free text until a trigger, then the tagged structure)."""
    reasoning_ended: bool | None = None
    """Only with a reasoning parser on the engine: whether the reasoning is over before the
    output starts. True: the grammar constrains from the first output token; False: from the
    token after the reasoning's end marker; None: decided from the prompt (the chat server
    decides from the prompt and chat_template_kwargs). Not part of the grammar (``key``)."""

    def __post_init__(self) -> None:
        if isinstance(self.json, type) and hasattr(self.json, "model_json_schema"):
            self.json = self.json.model_json_schema()  # a pydantic model class
        elif isinstance(self.json, str):
            try:
                self.json = _json.loads(self.json)
            except ValueError as e:
                raise ValueError(f"structured_outputs.json is not valid JSON: {e}") from None
        if self.json is not None and not isinstance(self.json, dict):
            raise ValueError(
                "structured_outputs.json must be a JSON schema (a dict, a JSON string or a "
                f"pydantic model class), got {type(self.json).__name__}"
            )
        if isinstance(self.structural_tag, str):
            try:
                self.structural_tag = _json.loads(self.structural_tag)
            except ValueError as e:
                raise ValueError(f"structured_outputs.structural_tag is not valid JSON: {e}") from None
        if self.structural_tag is not None and not isinstance(self.structural_tag, dict):
            raise ValueError("structured_outputs.structural_tag must be a JSON object (a dict or its JSON text)")
        given = [name for name in ("json", "regex", "choice", "grammar", "structural_tag")
                 if getattr(self, name) is not None]
        if self.json_object:
            given.append("json_object")
        if len(given) != 1:
            raise ValueError(
                "structured_outputs needs exactly one of json, regex, choice, grammar, "
                f"json_object or structural_tag, got {given or 'none'}"
            )
        if self.choice is not None:
            if not isinstance(self.choice, (list, tuple)) or not self.choice or not all(
                isinstance(c, str) and c for c in self.choice
            ):
                raise ValueError(
                    f"structured_outputs.choice must be a non-empty list of non-empty strings, got {self.choice!r}"
                )
            self.choice = list(self.choice)
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"structured_outputs.{name} must be a non-empty string, got {value!r}")

    @property
    def key(self) -> tuple[str, str]:
        """(kind, canonical spec): equal keys compile to the same grammar (the cache key)."""
        if self.json is not None:
            return "json", _json.dumps(self.json, sort_keys=True, separators=(",", ":"))
        if self.regex is not None:
            return "regex", self.regex
        if self.choice is not None:
            return "choice", _json.dumps(self.choice)
        if self.grammar is not None:
            return "grammar", self.grammar
        if self.structural_tag is not None:
            return "structural_tag", _json.dumps(self.structural_tag, sort_keys=True, separators=(",", ":"))
        return "json_object", ""


@dataclass
class SamplingParams:
    """Sampling parameters as vLLM users know them.

    Values kept for vLLM compatibility (``top_k=-1`` or ``0`` for "off") are accepted here and
    normalised: after construction ``top_k`` is ``None`` when off.
    """

    n: int = 1
    """Number of output sequences for the prompt (sharing its KV blocks)."""
    max_tokens: int | None = 16
    """Most tokens to generate (None: up to max_model_len)."""
    min_tokens: int = 0
    """EOS and stop_token_ids are not sampled before this many output tokens."""
    temperature: float = 1.0
    """0 means greedy."""
    top_p: float = 1.0
    """Nucleus sampling: keep the smallest set of tokens whose probability reaches top_p."""
    top_k: int | None = None
    """Keep the k most likely tokens; None, 0 or -1: off."""
    min_p: float = 0.0
    """Drop tokens less likely than min_p times the most likely one."""
    presence_penalty: float = 0.0
    """Subtracted from the logit of every token present in the output so far."""
    frequency_penalty: float = 0.0
    """Subtracted from a token's logit once per occurrence in the output so far."""
    repetition_penalty: float = 1.0
    """Divides positive (multiplies negative) logits of tokens in the prompt or output."""
    seed: int | None = None
    """Per-request seed: the same tokens whatever else is in the batch."""
    stop: list[str] | str | None = None
    """Strings that end the output (matched on the detokenized text)."""
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logprobs: int | None = None
    """Return this many top logprobs per output token (plus the sampled token's)."""
    prompt_logprobs: int | None = None
    """Return this many top logprobs per prompt token."""
    logit_bias: dict[int, float] | None = None
    """Added to the logits of the given token ids."""
    allowed_token_ids: list[int] | None = None
    """Only these token ids may be sampled."""
    bad_words: list[str] | None = None
    """Words (token sequences) that may never be generated."""
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    detokenize: bool = True
    structured_outputs: StructuredOutputsParams | None = None
    """Constrain the output (JSON schema, regex, choice, grammar); see StructuredOutputsParams."""
    thinking_token_budget: int | None = None
    """Output tokens the reasoning may take (the output starts inside it): once spent, the
    reasoning parser's end marker is forced and the answer follows (None: no limit)."""
    bad_words_token_ids: list[list[int]] | None = field(default=None, init=False, repr=False)
    """``bad_words`` as token sequences, set by the engine's input processor (its tokenizer)."""

    def __post_init__(self) -> None:
        if self.top_k in (0, -1):
            self.top_k = None
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self._validate()

    def _validate(self) -> None:
        for name, default in _NOT_YET_SUPPORTED.items():
            if getattr(self, name) != default:
                raise ValueError(f"{name}={getattr(self, name)!r} is not supported yet")
        if not isinstance(self.n, int) or not 1 <= self.n <= MAX_N:
            raise ValueError(f"n must be an integer in [1, {MAX_N}], got {self.n!r}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be >= 0, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens={self.min_tokens} must be <= max_tokens={self.max_tokens}"
            )
        if not 0.0 <= self.temperature <= 2.0 or self.temperature != self.temperature:
            raise ValueError(f"temperature must be in [0, 2], got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k is not None and self.top_k < 1:
            raise ValueError(f"top_k must be -1 or 0 (off) or >= 1, got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if not 0.0 < self.repetition_penalty <= 2.0:
            raise ValueError(
                f"repetition_penalty must be in (0, 2], got {self.repetition_penalty}"
            )
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            # The upper bound is the engine's max_logprobs (InputProcessor.validate).
            if value is not None and (not isinstance(value, int) or value < 0):
                raise ValueError(f"{name} must be None or an integer >= 0, got {value!r}")
        self._validate_token_lists()
        if self.seed is not None and not isinstance(self.seed, int):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError(f"stop must be a list of non-empty strings, got {self.stop!r}")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise ValueError(
                f"stop_token_ids must be non-negative integers, got {self.stop_token_ids!r}"
            )
        if self.thinking_token_budget is not None and (
                not isinstance(self.thinking_token_budget, int) or self.thinking_token_budget < 0):
            raise ValueError(f"thinking_token_budget must be a non-negative integer, got {self.thinking_token_budget!r}")
        if self.structured_outputs is not None:
            if not isinstance(self.structured_outputs, StructuredOutputsParams):
                raise ValueError(
                    "structured_outputs must be a StructuredOutputsParams, got "
                    f"{type(self.structured_outputs).__name__}"
                )
            if self.min_tokens > 0:
                raise ValueError(
                    f"min_tokens={self.min_tokens} cannot be combined with structured_outputs: "
                    "the grammar decides where the output ends; drop min_tokens"
                )

    def _validate_token_lists(self) -> None:
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise ValueError(f"logit_bias must be a dict of token id -> bias, got {self.logit_bias!r}")
            # JSON gives string keys; normalise to int -> float.
            try:
                self.logit_bias = {int(k): float(v) for k, v in self.logit_bias.items()}
            except (TypeError, ValueError) as e:
                raise ValueError(f"logit_bias must map token ids to numbers: {e}") from e
            for token_id, bias in self.logit_bias.items():
                if token_id < 0 or not -100.0 <= bias <= 100.0:
                    raise ValueError(
                        f"logit_bias maps token ids >= 0 to biases in [-100, 100], got {token_id}: {bias}"
                    )
        if self.allowed_token_ids is not None:
            ids = self.allowed_token_ids
            if not ids or any(not isinstance(t, int) or t < 0 for t in ids):
                raise ValueError(
                    f"allowed_token_ids must be a non-empty list of token ids >= 0, got {ids!r}"
                )
            self.allowed_token_ids = list(ids)
        if self.bad_words is not None:
            if any(not isinstance(w, str) or not w for w in self.bad_words):
                raise ValueError(f"bad_words must be a list of non-empty strings, got {self.bad_words!r}")
            self.bad_words = list(self.bad_words)

    def validate_vocab(self, vocab_size: int) -> None:
        """Token ids named by the user must exist in the model's vocabulary."""
        for name, ids in (
            ("logit_bias", list(self.logit_bias or ())),
            ("allowed_token_ids", self.allowed_token_ids or []),
        ):
            bad = [t for t in ids if t >= vocab_size]
            if bad:
                raise ValueError(f"{name} token id {bad[0]} is out of the vocabulary [0, {vocab_size})")

    def update_from_tokenizer(self, tokenizer: Any) -> None:
        """Turn ``bad_words`` into token sequences: each word as written and with a leading
        space (the form it takes inside a sentence), as vLLM does. Done once: the server runs
        it on its tokenizer thread before queueing the request."""
        if not self.bad_words or self.bad_words_token_ids is not None:
            return
        sequences: list[list[int]] = []
        for word in self.bad_words:
            for variant in (word, " " + word.lstrip()):
                ids = tokenizer.encode(variant, add_special_tokens=False)
                if ids and ids not in sequences:
                    sequences.append(ids)
        self.bad_words_token_ids = sequences

    @property
    def needs_penalties(self) -> bool:
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5
