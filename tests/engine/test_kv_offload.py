"""KV offload tiers behind the prefix cache (docs/kv_offload.md): blocks evicted from a small
pool come back from host memory or from disk instead of being recomputed, and outputs are
the same as with the tiers off; the disk tier survives a new engine and refuses corrupt,
truncated and foreign files."""

from __future__ import annotations

import os
import threading

import numpy as np
import pytest

from pagedllm import LLM, SamplingParams

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
SEEDED = SamplingParams(max_tokens=8, temperature=1.0, seed=1234, ignore_eos=True)
POOL = "256KiB"  # the tiny Llama: 2 layers x 2 KV heads x 16 dims, float32: 8 KiB a block of 16


def _ids(n: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(100, 40000, size=n).tolist()


def _llm(model_dir: str, **kwargs) -> LLM:
    return LLM(model_dir, dtype="float32", kv_cache_memory_bytes=POOL, max_model_len=448, **kwargs)


def _computed(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """Tokens the model computes per request id."""
    runner = llm.llm_engine.engine_core.runner
    counts: dict[str, int] = {}
    execute = runner.execute

    def counting(so):
        for req_id, n in so.num_scheduled_tokens.items():
            counts[req_id] = counts.get(req_id, 0) + n
        return execute(so)

    monkeypatch.setattr(runner, "execute", counting)
    return counts


def _run(llm: LLM, prompt: list[int], params: SamplingParams):
    return llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]


def _evict_all(llm: LLM) -> None:
    """Fill the pool with other prompts, so every cached block of earlier ones is evicted."""
    for seed in range(3):
        _run(llm, _ids(400, seed=900 + seed), GREEDY)


def _store(llm: LLM):
    return llm.llm_engine.scheduler.kv_cache_manager.offload


PROMPT = _ids(300, seed=5)  # 18 full blocks and a partial one


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_cpu_tier_reloads_evicted_prefix(tiny_llama_dir, params, monkeypatch):
    off = _llm(tiny_llama_dir)
    first_off = _run(off, PROMPT, params)
    _evict_all(off)
    again_off = _run(off, PROMPT, params)
    assert again_off.num_cached_tokens == 0  # the small pool lost it: recomputed
    del off

    on = _llm(tiny_llama_dir, kv_offload_cpu_bytes="4MiB")
    counts = _computed(on, monkeypatch)
    first = _run(on, PROMPT, params)
    _evict_all(on)
    again = _run(on, PROMPT, params)
    assert again.num_cached_tokens == 288  # every full block but the last token's, from the CPU tier
    assert counts[again.request_id] == 300 - 288 + params.max_tokens - 1
    assert first.outputs[0].token_ids == first_off.outputs[0].token_ids
    assert again.outputs[0].token_ids == again_off.outputs[0].token_ids == first.outputs[0].token_ids
    stats = _store(on).take_stats()
    assert stats["cpu"]["hits"] >= 18 and stats["cpu"]["stores"] >= 18


def _block_files(llm: LLM, prompt: list[int]) -> list[str]:
    """The disk tier's files of ``prompt``'s full blocks, in order."""
    from pagedllm.kv_backends.paged.kv_cache_utils import first_block_extra_keys, hash_request_tokens

    manager = llm.llm_engine.scheduler.kv_cache_manager
    hashes = hash_request_tokens(prompt, manager.block_size, first_block_extra_keys(manager.hash_extra_keys, None))
    return [manager.offload.path(manager.offload.key(h)) for h in hashes]


@pytest.fixture(scope="module")
def written_dir(tiny_llama_dir, tmp_path_factory):
    """A disk tier holding PROMPT's blocks, written by an engine that is gone, and that
    engine's outputs for PROMPT."""
    path = str(tmp_path_factory.mktemp("kv-offload"))
    llm = _llm(tiny_llama_dir, kv_offload_dir=path)
    outputs = {p.seed: _run(llm, PROMPT, p).outputs[0].token_ids for p in (GREEDY, SEEDED)}
    _evict_all(llm)
    assert _store(llm).flush()
    files = _block_files(llm, PROMPT)
    assert all(os.path.exists(f) for f in files[:18])
    assert not [n for n in os.listdir(path) if n.endswith(".tmp")]
    del llm
    return path, outputs


def _copy_dir(src: str, dst) -> str:
    import shutil

    return shutil.copytree(src, str(dst / "tier"))


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_disk_tier_serves_a_new_engine(tiny_llama_dir, written_dir, tmp_path, params, monkeypatch):
    path = _copy_dir(written_dir[0], tmp_path)
    llm = _llm(tiny_llama_dir, kv_offload_dir=path)
    counts = _computed(llm, monkeypatch)
    out = _run(llm, PROMPT, params)
    assert out.num_cached_tokens == 288  # from disk: this engine never computed them
    assert counts[out.request_id] == 300 - 288 + params.max_tokens - 1
    assert out.outputs[0].token_ids == written_dir[1][params.seed]
    stats = _store(llm).take_stats()
    assert stats["disk"]["hits"] == 18 and stats["disk"]["rejected"] == 0


def _damage(path: str, how: str) -> None:
    import json
    import struct
    import zlib

    raw = bytearray(open(path, "rb").read())
    if how == "corrupt":  # one flipped byte in the payload
        raw[-100] ^= 0xFF
    elif how == "truncated":
        raw = raw[: len(raw) - 1000]
    elif how == "foreign":  # a well-formed file of another geometry (block size 32)
        _, _, header_len = struct.unpack_from("<4sII", raw)
        header = json.loads(raw[12 : 12 + header_len])
        header["geometry"]["block_size"] = 32
        payload = bytes(raw[12 + header_len :]) * 2
        header["payload_bytes"], header["crc32"] = len(payload), zlib.crc32(payload)
        body = json.dumps(header).encode()
        raw = bytearray(struct.pack("<4sII", b"PGKV", 1, len(body)) + body + payload)
    with open(path, "wb") as f:
        f.write(raw)


@pytest.mark.parametrize("how", ["corrupt", "truncated", "foreign"])
def test_damaged_block_file_is_recomputed_never_served(tiny_llama_dir, written_dir, tmp_path, how):
    path = _copy_dir(written_dir[0], tmp_path)
    llm = _llm(tiny_llama_dir, kv_offload_dir=path)
    damaged = _block_files(llm, PROMPT)[10]
    _damage(damaged, how)
    out = _run(llm, PROMPT, GREEDY)
    assert out.num_cached_tokens == 10 * 16  # blocks 0..9 from disk; 10 on recomputed
    assert out.outputs[0].token_ids == written_dir[1][GREEDY.seed]
    stats = _store(llm).take_stats()
    assert stats["disk"]["rejected"] == 1 and stats["disk"]["hits"] == 10
    assert not os.path.exists(damaged)  # removed: the recomputed block is written anew later


def test_concurrent_writers_of_the_same_blocks(tmp_path):
    from pagedllm.kv_backends.paged.offload import BlockGeometry, OffloadStore

    geometry = BlockGeometry(layers=2, kv_heads=2, head_size=16, block_size=16, dtype="float32", row_bytes=64)
    namespace = b"n" * 32
    hashes = [bytes([i]) * 32 for i in range(40)]
    images = [np.random.default_rng(i).integers(0, 256, geometry.block_bytes, dtype=np.uint8) for i in range(40)]
    stores = [OffloadStore(geometry, namespace, disk_dir=str(tmp_path)) for _ in range(4)]

    def write(store):
        for h, image in zip(hashes, images):
            store.store(h, image)
        assert store.flush()

    threads = [threading.Thread(target=write, args=(s,)) for s in stores]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(os.listdir(tmp_path)) == sorted(stores[0].key(h).hex() + ".kvb" for h in hashes)
    reader = OffloadStore(geometry, namespace, disk_dir=str(tmp_path))
    for h, image in zip(hashes, images):
        assert np.array_equal(reader.lookup(h), image)
    assert reader.take_stats()["disk"] == {"hits": 40, "misses": 0, "stores": 0, "rejected": 0,
                                           "bytes": sum(os.path.getsize(tmp_path / n) for n in os.listdir(tmp_path))}


def test_tiers_are_bounded_lru(tmp_path):
    from pagedllm.kv_backends.paged.offload import BlockGeometry, OffloadStore

    geometry = BlockGeometry(layers=1, kv_heads=1, head_size=16, block_size=16, dtype="float32", row_bytes=64)
    image = np.zeros(geometry.block_bytes, dtype=np.uint8)
    store = OffloadStore(geometry, b"n" * 32, cpu_bytes=3 * geometry.block_bytes, disk_dir=str(tmp_path),
                         disk_bytes=int(2.5 * (geometry.block_bytes + 400)))
    hashes = [bytes([i]) * 32 for i in range(5)]
    for h in hashes[:3]:
        store.store(h, image)
    store.lookup(hashes[0])  # most recently used now
    store.store(hashes[3], image)  # the CPU tier drops hashes[1]
    assert store.flush()
    with store._lock:
        assert list(store._cpu) == [store.key(h) for h in (hashes[2], hashes[0], hashes[3])]
    # The disk holds two files (the budget), the most recently written ones.
    assert sorted(os.listdir(tmp_path)) == sorted(store.key(h).hex() + ".kvb" for h in hashes[2:4])


def test_many_requests_through_a_small_pool_agree_with_hf(tiny_llama_dir, hf_tiny_llama, tmp_path):
    """Shared system prompts, a pool far too small for them: preemptions, evictions into both
    tiers and reloads in one run; every output matches HF's greedy one (tie-aware)."""
    from tests.utils import assert_greedy_match, hf_greedy

    llm = _llm(tiny_llama_dir, kv_offload_cpu_bytes="96KiB", kv_offload_dir=str(tmp_path))  # CPU tier: 12 blocks
    systems = [_ids(60 + 40 * i, seed=300 + i) for i in range(5)]
    prompts = [systems[i % 5] + _ids(3 + i, seed=400 + i) for i in range(20)]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    outs = []
    for wave in range(4):
        outs += llm.generate([{"prompt_token_ids": p} for p in prompts[wave * 5:(wave + 1) * 5]], params,
                             use_tqdm=False)
    stats = _store(llm).take_stats()
    assert stats["cpu"]["hits"] > 0 and stats["disk"]["hits"] > 0 and stats["disk"]["stores"] > 0
    assert sum(o.num_cached_tokens for o in outs[5:]) > 0
    for i, (p, out) in enumerate(zip(prompts, outs)):
        ref, gaps = hf_greedy(hf_tiny_llama, p, 6)
        assert_greedy_match(out.outputs[0].token_ids, ref, gaps, f"prompt {i}")


def test_prefetch_reads_a_waiting_requests_blocks_ahead(tiny_llama_dir, written_dir, tmp_path, monkeypatch):
    """A queued request's prefix is read from disk in the background; its lookup then needs
    no file (they are removed here before the engine steps)."""
    path = _copy_dir(written_dir[0], tmp_path)
    llm = _llm(tiny_llama_dir, kv_offload_dir=path)
    engine = llm.llm_engine
    engine.add_request({"prompt_token_ids": PROMPT}, GREEDY, "waiting")
    assert _store(llm).wait_prefetched()
    for name in os.listdir(path):
        if name.endswith(".kvb"):
            os.unlink(os.path.join(path, name))
    outputs = []
    while engine.has_unfinished_requests():
        outputs += [o for o in engine.step() if o.finished]
    assert outputs[0].num_cached_tokens == 288
    assert outputs[0].outputs[0].token_ids == written_dir[1][GREEDY.seed]
    assert _store(llm).take_stats()["disk"]["hits"] == 18


_WRITER = """
import os
import sys
import numpy as np
from pagedllm.kv_backends.paged.offload import BlockGeometry, OffloadStore
geometry = BlockGeometry(layers=2, kv_heads=2, head_size=16, block_size=16, dtype="float32", row_bytes=64)
store = OffloadStore(geometry, b"n" * 32, disk_dir=sys.argv[1])
for rep in range(3):
    for i in range(40):
        store.store(bytes([i]) * 32, np.random.default_rng(i).integers(0, 256, geometry.block_bytes, dtype=np.uint8))
    assert store.flush()
    for name in os.listdir(sys.argv[1]):  # remove the block files (an LRU bound would), write again
        if name.endswith(".kvb"):
            try:
                os.unlink(os.path.join(sys.argv[1], name))
            except FileNotFoundError:
                pass
    store._disk.clear()
    store._disk_total = 0
for i in range(40):
    store.store(bytes([i]) * 32, np.random.default_rng(i).integers(0, 256, geometry.block_bytes, dtype=np.uint8))
assert store.flush()
"""


def test_processes_writing_while_another_reads(tmp_path):
    """Three processes write (and delete and rewrite) the same blocks while this one reads:
    a read finds a whole, correct block or nothing, never a torn one."""
    import subprocess
    import sys

    from pagedllm.kv_backends.paged.offload import BlockGeometry, OffloadStore

    geometry = BlockGeometry(layers=2, kv_heads=2, head_size=16, block_size=16, dtype="float32", row_bytes=64)
    images = [np.random.default_rng(i).integers(0, 256, geometry.block_bytes, dtype=np.uint8) for i in range(40)]
    writers = [subprocess.Popen([sys.executable, "-c", _WRITER, str(tmp_path)]) for _ in range(3)]
    reader = OffloadStore(geometry, b"n" * 32, disk_dir=str(tmp_path))
    found = 0
    while any(w.poll() is None for w in writers):
        for i in range(40):
            data = reader._read_disk(reader.key(bytes([i]) * 32), bytes([i]) * 32)
            if data is not None:
                assert np.array_equal(data, images[i])
                found += 1
    assert [w.wait() for w in writers] == [0, 0, 0]
    assert reader.stats["disk"].rejected == 0 and found > 0
    assert sorted(os.listdir(tmp_path)) == sorted(reader.key(bytes([i]) * 32).hex() + ".kvb" for i in range(40))


def test_save_by_name_needs_a_disk_tier(tiny_llama_dir):
    core = _llm(tiny_llama_dir).llm_engine.engine_core
    with pytest.raises(ValueError, match=r"needs the KV offload tiers \(--kv-offload-dir\)"):
        core.save_kv("x", PROMPT)
    with pytest.raises(ValueError, match=r"needs the KV offload tiers \(--kv-offload-dir\)"):
        core.restore_kv("x")


def test_shutdown_writes_the_pools_cached_blocks(tiny_llama_dir, tmp_path):
    llm = _llm(tiny_llama_dir, kv_offload_dir=str(tmp_path))
    _run(llm, PROMPT, GREEDY)  # cached in the pool, nothing evicted
    assert not list(tmp_path.glob("*.kvb"))
    llm.shutdown()
    names = {os.path.basename(f) for f in _block_files(llm, PROMPT)}
    assert names <= {p.name for p in tmp_path.glob("*.kvb")}
