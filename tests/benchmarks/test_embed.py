"""`pagedllm bench embed` runs end to end on a tiny BERT checkpoint (pagedllm beside
sentence-transformers) and writes its figures."""

from __future__ import annotations

import json
from pathlib import Path

from pagedllm.entrypoints.cli import build_parser
from tests.models.pooling_utils import save_encoder


def test_bench_embed_writes_both_engines(tmp_path: Path) -> None:
    model = tmp_path / "bert"
    save_encoder(model, "BertModel", "mean")
    out = tmp_path / "embed.json"
    args = build_parser().parse_args([
        "bench", "embed", str(model), "--dtype", "float32", "--num-texts", "4", "--input-len", "16",
        "--num-iters", "1", "--short-iters", "2", "--sentence-transformers", "--save-json", str(out),
    ])
    args.func(args)
    results = json.loads(out.read_text())
    assert [r["engine"] for r in results] == ["pagedllm", "sentence-transformers float32"]
    assert all(r["texts_per_s"] > 0 and r["p50_short_ms"] > 0 for r in results)
