"""Incremental detokenization.

Decoding one token at a time is wrong for byte-level and byte-fallback tokenizers: a character
may span several tokens, and a lone piece decodes to U+FFFD. We decode a small window
(`prefix_offset:`) and emit only the text beyond what the window's head (`prefix_offset:
read_offset`) already produced, holding back while the tail is an incomplete character. The
pieces then concatenate to exactly the decoding of all ids at once.

`spaces_between_special_tokens=False` (with `skip_special_tokens=False`, as in vLLM) keeps the
tokenizer's decoder from putting a space between two adjacent added tokens (WordPiece-style
decoders join every token with one): the ids are decoded in runs cut between such pairs, and
the runs concatenated. Byte-level decoders put no space there, so for them it changes nothing.
"""

from __future__ import annotations

from typing import Any

# Prompt tokens kept as left context, so the first output token decodes with its spacing.
_CONTEXT_TOKENS = 5


def added_token_ids(tokenizer: Any) -> frozenset[int]:
    """Ids of the tokenizer's added tokens (special or not), which decode to their content."""
    return frozenset(tokenizer.get_added_vocab().values())


class IncrementalDetokenizer:
    __slots__ = ("tokenizer", "token_ids", "prefix_offset", "read_offset", "skip_special_tokens", "join_added_ids")

    def __init__(
        self, tokenizer: Any, prompt_token_ids: list[int], skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        # Added-token ids to decode without a space between neighbours; empty: plain decode.
        self.join_added_ids: frozenset[int] = (
            frozenset() if skip_special_tokens or spaces_between_special_tokens else added_token_ids(tokenizer)
        )
        self.token_ids = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.token_ids)

    def _decode(self, ids: list[int]) -> str:
        added = self.join_added_ids
        if not added:
            return self._decode_run(ids)
        # Cut between two adjacent added tokens; each run decodes with its own spacing.
        cuts = [i for i in range(1, len(ids)) if ids[i] in added and ids[i - 1] in added]
        bounds = [0, *cuts, len(ids)]
        return "".join(self._decode_run(ids[a:b]) for a, b in zip(bounds, bounds[1:]))

    def _decode_run(self, ids: list[int]) -> str:
        return self.tokenizer.decode(
            ids, skip_special_tokens=self.skip_special_tokens, clean_up_tokenization_spaces=False
        )

    def update(self, new_token_ids: list[int]) -> str:
        """Append tokens; return the newly completed text (possibly empty)."""
        self.token_ids.extend(new_token_ids)
        prefix_text = self._decode(self.token_ids[self.prefix_offset : self.read_offset])
        full_text = self._decode(self.token_ids[self.prefix_offset :])
        if len(full_text) <= len(prefix_text) or full_text.endswith("\ufffd"):
            return ""  # nothing new yet, or an incomplete character: wait for more tokens
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.token_ids)
        return full_text[len(prefix_text) :]

    def flush(self) -> str:
        """At the end of a request: whatever is still held back (even an incomplete character)."""
        prefix_text = self._decode(self.token_ids[self.prefix_offset : self.read_offset])
        full_text = self._decode(self.token_ids[self.prefix_offset :])
        self.prefix_offset = self.read_offset = len(self.token_ids)
        return full_text[len(prefix_text) :]
