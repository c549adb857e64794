"""Well-behaved streams against one server while it is attacked (issue 48's proof, from outside).

Starts `pagedllm serve` with `--api-key` and a LoRA slot with runtime loading (or, with
`--kv-consumer`, a KV-consumer connector instead: the two do not run together), so those
surfaces are open, then runs the same steady load twice:
STREAMS well-behaved clients, each streaming ROUNDS greedy completions of MAX_TOKENS tokens.
The first run is attack-free; during the second, attackers send:

- 32 (`--stalled-clients`) streaming clients that read one chunk and then stop reading (their connections stay open);
- a 64 MiB request body;
- a fake KV producer: a loopback ROUTER answering every pull with a junk header and an 8 MiB
  frame, named in client-sent `kv_transfer_params`;
- a LoRA adapter whose weights are all NaN (`/v1/load_lora_adapter`);
- malformed bodies (bad JSON, wrong types, lone surrogates, lists over their caps), requests
  without the key, `/metrics` without the key.

Then it reports: whether every well-behaved output is identical to the attack-free run's, the
streams' inter-token latency p99 in both runs and their ratio, the server's RSS (front end and
engine core together) before, at most during, and after, each attack's answers, the KV usage
gauge once the attackers are gone, and the exit status and time of a SIGTERM stop. Exit status
1 if an output differs, an attack got a 5xx or a 2xx where a refusal was due, or a block stays
in use. docs/reliability.md keeps the figures.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

API_KEY = "attack-bench-key"
PROMPTS = [
    "Once upon a time", "The capital of France is", "Write a haiku about autumn:",
    "def fibonacci(n):", "The three laws of robotics are", "In 1969, the first",
    "My favourite recipe for bread", "Explain photosynthesis in simple words:",
    "The quick brown fox", "A list of prime numbers: 2, 3, 5,",
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tree_rss_bytes(pid: int) -> int:
    """RSS of pid and its descendants, from /proc."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except OSError:
            continue
        children.setdefault(ppid, []).append(int(entry))
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        todo.extend(children.get(p, ()))
        try:
            with open(f"/proc/{p}/statm") as f:
                total += int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        except OSError:
            pass
    return total


def _nan_adapter(directory: Path) -> None:
    """A rank-8 q_proj adapter for a 576-wide model (SmolLM2-135M) whose weights are NaN."""
    import torch
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    (directory / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": 8, "lora_alpha": 16, "target_modules": ["q_proj"], "bias": "none"}))
    tensors = {}
    for layer in range(30):
        prefix = f"base_model.model.model.layers.{layer}.self_attn.q_proj"
        tensors[f"{prefix}.lora_A.weight"] = torch.full((8, 576), float("nan"))
        tensors[f"{prefix}.lora_B.weight"] = torch.full((576, 8), float("nan"))
    save_file(tensors, str(directory / "adapter_model.safetensors"))


class FakeProducer:
    """A loopback ROUTER answering every pull with a junk header and an 8 MiB frame."""

    def __init__(self) -> None:
        import zmq

        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        self.pulls = 0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        header = json.dumps({"ok": True, "transfer_id": "t", "runs": [[0, 1]], "block_size": 16}).encode()
        while not self.stop.is_set():
            if not self.sock.poll(100):
                continue
            identity, *_ = self.sock.recv_multipart()
            self.pulls += 1
            self.sock.send_multipart([identity, header, b"\x7f" * (8 << 20)])

    def close(self) -> None:
        self.stop.set()
        self.thread.join(5)
        self.sock.close()
        self.ctx.term()


class Server:
    def __init__(self, model: str, extra: list[str], kv_consumer: bool) -> None:
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile("w+", prefix="pagedllm-attack-", suffix=".log", delete=False)
        cmd = [sys.executable, "-m", "pagedllm.entrypoints.cli", "serve", model, "--port", str(self.port),
               "--api-key", API_KEY, *extra]
        cmd += (["--kv-transfer-config", json.dumps({"kv_role": "kv_consumer", "kv_remote_wait_timeout_s": 5})]
                if kv_consumer else ["--enable-lora", "--max-lora-rank", "8"])
        env = dict(os.environ) if kv_consumer else dict(os.environ, VLLM_ALLOW_RUNTIME_LORA_UPDATING="True")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env)

    def wait_healthy(self, timeout_s: float = 300) -> None:
        import httpx

        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with {self.proc.returncode}: {self.tail()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        raise RuntimeError("the server was not healthy in time")

    def tail(self) -> str:
        return Path(self.log.name).read_text()[-3000:]

    def rss(self) -> int:
        return _tree_rss_bytes(self.proc.pid)


HEADERS = {"Authorization": f"Bearer {API_KEY}"}


async def _good_client(client, url: str, model: str, c: int, rounds: int, max_tokens: int,
                       texts: dict, gaps: list[float]) -> None:
    for k in range(rounds):
        body = {"model": model, "prompt": PROMPTS[(c + k) % len(PROMPTS)], "max_tokens": max_tokens,
                "temperature": 0.0, "ignore_eos": True, "stream": True}
        text, last = [], None
        async with client.stream("POST", url + "/v1/completions", json=body, headers=HEADERS) as r:
            assert r.status_code == 200, await r.aread()
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    now = time.monotonic()
                    event = json.loads(line[6:])
                    if "error" in event:
                        raise RuntimeError(f"a well-behaved stream failed: {event}")
                    text.append(event["choices"][0]["text"])
                    if last is not None:
                        gaps.append(now - last)
                    last = now
        texts[(c, k)] = "".join(text)


async def _load(url: str, model: str, streams: int, rounds: int, max_tokens: int) -> tuple[dict, list[float]]:
    import httpx

    texts: dict = {}
    gaps: list[float] = []
    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=streams + 4)) as client:
        await asyncio.gather(*(_good_client(client, url, model, c, rounds, max_tokens, texts, gaps)
                               for c in range(streams)))
    return texts, gaps


def _p99(xs: list[float]) -> float:
    return statistics.quantiles(xs, n=100)[98] if len(xs) >= 2 else float("nan")


def _malformed_bodies(model: str, n: int) -> list[tuple[str, bytes]]:
    rng = random.Random(48)
    good = {"model": model, "prompt": "hi", "max_tokens": 1}
    variants = [
        b"{", b"[]", b"null", b'{"prompt": }', b"\xff\xfe", b'{"prompt": "\xed\xb3\xbf"}',
        b'{"prompt": "a\\udcffb", "model": "x"}', json.dumps({**good, "max_tokens": "many"}).encode(),
        json.dumps({**good, "stop": ["x"] * 100}).encode(), json.dumps({**good, "n": -3}).encode(),
        json.dumps({**good, "prompt": [[1, 2], "mixed"]}).encode(), json.dumps({**good, "logit_bias": {"a": 1}}).encode(),
        json.dumps({**good, "temperature": "hot"}).encode(), json.dumps({**good, "prompt": [-5]}).encode(),
        json.dumps({**good, "bad_words": ["y"] * 1000}).encode(),
        json.dumps({**good, "guided_regex": "(" * 50}).encode(),
        json.dumps({**good, "prompt": "lorem " * 2_000_000}).encode(),
    ]
    paths = ["/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize", "/v1/messages", "/v1/responses"]
    return [(rng.choice(paths), rng.choice(variants)) for _ in range(n)]


async def _attacks(url: str, model: str, adapter: Path, producer: FakeProducer, stop: asyncio.Event,
                   report: dict, stalled_clients: int, stalled_n: int, stalled_tokens: int,
                   malformed: int) -> None:
    import httpx

    statuses: dict[str, list[int]] = {}

    def note(name: str, status: int) -> None:
        statuses.setdefault(name, []).append(status)

    async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=64)) as client:
        # 32 clients that read one chunk and then stop reading, connections held open.
        stalled: list = []
        for i in range(stalled_clients):
            body = {"model": model, "prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": stalled_tokens,
                    "n": stalled_n, "ignore_eos": True, "stream": True}
            cm = client.stream("POST", url + "/v1/completions", json=body, headers=HEADERS)
            r = await cm.__aenter__()
            note("stalled readers", r.status_code)
            lines = r.aiter_lines()
            if r.status_code == 200:
                await lines.__anext__()
            stalled.append(cm)
        # A 64 MiB body.
        r = await client.post(url + "/v1/completions", content=b"{" + b" " * (64 << 20) + b"}",
                              headers={**HEADERS, "Content-Type": "application/json"})
        note("64 MiB body", r.status_code)
        # A fake KV producer on loopback (trusted by default: only loopback is).
        for i in range(4):
            params = {"do_remote_prefill": True, "remote_host": "127.0.0.1", "remote_port": producer.port,
                      "remote_transfer_id": f"fake-{i}", "remote_num_blocks": 2}
            r = await client.post(url + "/v1/completions", headers=HEADERS, json={
                "model": model, "prompt": "x " * 40, "max_tokens": 2, "kv_transfer_params": params})
            note("fake KV producer", r.status_code)
        # Kv params naming a host outside the trust (blind SSRF).
        r = await client.post(url + "/v1/completions", headers=HEADERS, json={
            "model": model, "prompt": "hi", "max_tokens": 2, "kv_transfer_params": {
                "do_remote_prefill": True, "remote_host": "169.254.169.254", "remote_port": 80,
                "remote_transfer_id": "x", "remote_num_blocks": 1}})
        note("untrusted KV host", r.status_code)
        # A NaN adapter.
        r = await client.post(url + "/v1/load_lora_adapter", headers=HEADERS,
                              json={"lora_name": "nan-adapter", "lora_path": str(adapter)})
        note("NaN adapter", r.status_code)
        models = (await client.get(url + "/v1/models", headers=HEADERS)).json()
        report["nan_adapter_listed"] = any(m["id"] == "nan-adapter" for m in models["data"])
        # Malformed bodies, no key, /metrics without the key.
        for path, raw in _malformed_bodies(model, malformed):
            r = await client.post(url + path, content=raw, headers={**HEADERS, "Content-Type": "application/json"})
            note("malformed bodies", r.status_code)
        for _ in range(20):
            r = await client.post(url + "/v1/completions", json={"model": model, "prompt": "hi", "max_tokens": 1})
            note("no key", r.status_code)
        note("/metrics without the key", (await client.get(url + "/metrics")).status_code)
        await stop.wait()  # the stalled readers hold on until the well-behaved load is done
        for cm in stalled:
            await cm.__aexit__(None, None, None)
    report["statuses"] = statuses


def _summarize(statuses: list[int]) -> str:
    counts: dict[int, int] = {}
    for s in statuses:
        counts[s] = counts.get(s, 0) + 1
    return ", ".join(f"{n} x {s}" for s, n in sorted(counts.items()))


def _kv_usage(url: str) -> float | None:
    import httpx

    text = httpx.get(url + "/metrics", headers=HEADERS, timeout=10).text
    for line in text.splitlines():
        if line.startswith("pagedllm:kv_cache_usage_perc"):
            return float(line.rsplit(" ", 1)[1])
    return None


def run(args: argparse.Namespace) -> None:
    import logging

    logging.getLogger("httpx").setLevel(logging.WARNING)
    extra = args.serve_args[1:] if args.serve_args[:1] == ["--"] else args.serve_args
    server = Server(args.model, extra, args.kv_consumer)
    producer = FakeProducer()
    failures: list[str] = []
    try:
        server.wait_healthy()
        url = server.url
        with tempfile.TemporaryDirectory() as tmp:
            adapter = Path(tmp) / "nan-adapter"
            _nan_adapter(adapter)
            asyncio.run(_load(url, args.model, args.streams, 1, 8))  # warm-up
            rss_start = server.rss()
            t0 = time.monotonic()
            clean_texts, clean_gaps = asyncio.run(_load(url, args.model, args.streams, args.rounds, args.max_tokens))
            clean_s = time.monotonic() - t0
            rss_peak = [server.rss()]
            sampling = threading.Event()

            def sample_rss() -> None:
                while not sampling.is_set():
                    rss_peak.append(server.rss())
                    time.sleep(0.25)

            sampler = threading.Thread(target=sample_rss, daemon=True)
            sampler.start()
            report: dict = {}

            async def attacked() -> tuple[dict, list[float]]:
                stop = asyncio.Event()
                attack = asyncio.create_task(_attacks(url, args.model, adapter, producer, stop, report,
                                                      args.stalled_clients, args.stalled_n,
                                                      args.stalled_max_tokens, args.malformed))
                await asyncio.sleep(args.lead_s)
                try:
                    return await _load(url, args.model, args.streams, args.rounds, args.max_tokens)
                finally:
                    stop.set()
                    await attack

            t0 = time.monotonic()
            texts, gaps = asyncio.run(attacked())
            attacked_s = time.monotonic() - t0
            sampling.set()
            sampler.join()
        deadline = time.monotonic() + 60
        usage = _kv_usage(url)
        while usage and time.monotonic() < deadline:
            time.sleep(0.5)
            usage = _kv_usage(url)
        rss_end = server.rss()
        same = sum(texts.get(k) == v for k, v in clean_texts.items())
        p99_clean, p99_attack = _p99(clean_gaps), _p99(gaps)
        print(f"well-behaved: {args.streams} streams x {args.rounds} rounds x {args.max_tokens} tokens")
        print(f"  outputs identical to the attack-free run: {same}/{len(clean_texts)}")
        print(f"  ITL p99: attack-free {p99_clean * 1000:.1f} ms, attacked {p99_attack * 1000:.1f} ms "
              f"({p99_attack / p99_clean:.2f}x); median {statistics.median(clean_gaps) * 1000:.1f} / "
              f"{statistics.median(gaps) * 1000:.1f} ms; run {clean_s:.1f} / {attacked_s:.1f} s")
        print(f"  server RSS: {rss_start / 2**20:.0f} MiB before, at most {max(rss_peak) / 2**20:.0f} MiB "
              f"during the attacks, {rss_end / 2**20:.0f} MiB after")
        print(f"  KV usage gauge after the attackers left: {usage}")
        for name, statuses in report.get("statuses", {}).items():
            print(f"  {name}: {_summarize(statuses)}")
            if any(s >= 500 for s in statuses) and name not in ("fake KV producer", "stalled readers"):
                failures.append(f"{name}: a 5xx")
        print(f"  fake producer pulls answered: {producer.pulls}; NaN adapter listed: "
              f"{report.get('nan_adapter_listed')}")
        if same != len(clean_texts):
            failures.append("outputs differ")
        if usage:
            failures.append(f"KV usage {usage} after the attacks")
        if report.get("nan_adapter_listed"):
            failures.append("the NaN adapter was listed")
        for name, ok in (("64 MiB body", {413}), ("NaN adapter", {404} if args.kv_consumer else {400}),
                         ("no key", {401}),
                         ("/metrics without the key", {401}), ("untrusted KV host", {400})):
            got = set(report.get("statuses", {}).get(name, []))
            if not got <= ok:
                failures.append(f"{name}: {sorted(got)}")
        t0 = time.monotonic()
        server.proc.send_signal(signal.SIGTERM)
        code = server.proc.wait(120)
        print(f"  SIGTERM: exit {code} after {time.monotonic() - t0:.1f} s")
        if code != 0:
            failures.append(f"exit status {code}")
    finally:
        producer.close()
        if server.proc.poll() is None:
            server.proc.kill()
            server.proc.wait()
        print(f"  server log: {server.log.name}")
    if failures:
        print("FAILED: " + "; ".join(failures))
        raise SystemExit(1)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="SmolLM2-135M-Instruct")
    p.add_argument("--streams", type=int, default=8, help="well-behaved streaming clients")
    p.add_argument("--rounds", type=int, default=3, help="completions each well-behaved client streams in turn")
    p.add_argument("--max-tokens", type=int, default=64, help="tokens per well-behaved completion")
    p.add_argument("--kv-consumer", action="store_true",
                   help="serve as a KV consumer (the fake producer's pulls reach the connector) instead of "
                        "with runtime LoRA loading (the NaN adapter reaches the checks)")
    p.add_argument("--stalled-clients", type=int, default=32, help="streaming clients that stop reading")
    p.add_argument("--malformed", type=int, default=300, help="malformed bodies sent")
    p.add_argument("--stalled-n", type=int, default=1, help="n of each of the 32 stalled readers' requests")
    p.add_argument("--stalled-max-tokens", type=int, default=256, help="max_tokens of each stalled reader's request")
    p.add_argument("--lead-s", type=float, default=3.0, help="seconds the attacks run before the load starts")
    p.add_argument("serve_args", nargs=argparse.REMAINDER, help="after --: more `pagedllm serve` flags")
