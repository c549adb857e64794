"""A few scalar metadata keys of a GGUF file, read from its header without gguf-py.

gguf-py's reader builds every field (the tokenizer's vocabulary one token at a time: seconds),
and a warm start never parses the file (gguf_index.py). The header is read by the validating
parser (gguf_header.py: every claimed length checked against the file before it is read, array
values skipped by their size), which keeps the scalar and string values.
"""

from __future__ import annotations

from pagedllm.models.gguf_header import read_gguf_header


def read_scalar_keys(path: str, prefix: str) -> dict[str, int | float | bool | str]:
    """The scalar (and string) metadata values whose keys start with `prefix`; ValueError for a
    file that is not a valid GGUF."""
    return {k: v for k, v in read_gguf_header(path).metadata.items() if k.startswith(prefix)}
