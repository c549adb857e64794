"""The tokenizer `pagedllm bench serve` measures prompts with: the served model's own, through
the server's /tokenize and /detokenize (vLLM and pagedllm answer both alike), or a local one
given by `--tokenizer` (an HF name or directory, a .gguf file, or a pagedllm model name)."""

from __future__ import annotations

from typing import Any, Protocol

FIRST_PLAIN_TOKEN_ID = 100
"""Synthetic prompts draw ids from [this, vocab_size): tokenizers keep special tokens low."""


class BenchTokenizer(Protocol):
    vocab_size: int
    special_ids: frozenset[int]

    def encode(self, text: str) -> list[int]:
        """Token ids of text, no special tokens added."""
        ...

    def decode(self, token_ids: list[int]) -> str: ...

    def chat_prompt(self, content: str) -> str:
        """The model's chat template around one user message, with the generation prompt."""
        ...


class ServerTokenizer:
    """The served model's tokenizer over HTTP (``vocab_size`` is not served: it is given)."""

    def __init__(self, client: Any, base_url: str, model: str, headers: dict, vocab_size: int) -> None:
        self._client = client  # an httpx.Client
        self._base_url = base_url
        self._model = model
        self._headers = headers
        self.vocab_size = vocab_size
        self.special_ids: frozenset[int] = frozenset()

    def _post(self, path: str, body: dict) -> dict:
        r = self._client.post(self._base_url + path, json={"model": self._model, **body}, headers=self._headers)
        if r.status_code != 200:
            raise RuntimeError(f"{path} answered {r.status_code}: {r.text[:200]}")
        return r.json()

    def encode(self, text: str) -> list[int]:
        return self._post("/tokenize", {"prompt": text, "add_special_tokens": False})["tokens"]

    def decode(self, token_ids: list[int]) -> str:
        return self._post("/detokenize", {"tokens": token_ids})["prompt"]

    def chat_prompt(self, content: str) -> str:
        tokens = self._post("/tokenize", {
            "messages": [{"role": "user", "content": content}], "add_generation_prompt": True,
        })["tokens"]
        return self.decode(tokens)


class LocalTokenizer:
    """A transformers tokenizer loaded here."""

    def __init__(self, name: str) -> None:
        from transformers import AutoTokenizer

        from pagedllm.models.gguf_loader import gguf_to_hf_dir
        from pagedllm.models.loader import resolve_checkpoint

        try:  # a pagedllm model name, a .gguf file or an HF directory
            gguf_path, model_dir = resolve_checkpoint(name)
            path = gguf_to_hf_dir(gguf_path) if gguf_path is not None else model_dir
        except ValueError:
            path = name  # a name for transformers to resolve
        self._tok = AutoTokenizer.from_pretrained(path)
        self.vocab_size = int(self._tok.vocab_size)
        self.special_ids = frozenset(self._tok.all_special_ids)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False)

    def decode(self, token_ids: list[int]) -> str:
        return self._tok.decode(token_ids)

    def chat_prompt(self, content: str) -> str:
        return self._tok.apply_chat_template(
            [{"role": "user", "content": content}], add_generation_prompt=True, tokenize=False,
        )
