"""vLLM's current launch lines: `--model` beside the positional model, no abbreviated flags,
the newer serve flags (no-ops with their notice, or working: TLS, --root-path), vLLM's thread
binding variable, and every user error at start-up as one line with exit status 2."""

from __future__ import annotations

import argparse
import logging
import subprocess
import sys
import time

import httpx
import pytest

from pagedllm.entrypoints.cli import _engine_args, build_parser
from tests.entrypoints.utils import REPO_ROOT, SMALL_SERVER_ARGS, RemoteServer


def parse(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["serve", *argv])


def _parsers(parser: argparse.ArgumentParser):
    yield parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                yield from _parsers(sub)


def test_no_parser_takes_abbreviations():
    parsers = list(_parsers(build_parser()))
    assert len(parsers) > 5 and all(p.allow_abbrev is False for p in parsers)
    with pytest.raises(SystemExit) as exc:
        parse("--model-imp", "auto")  # not read as --model-impl
    assert exc.value.code == 2


def test_model_flag_as_vllm(caplog):
    with caplog.at_level(logging.WARNING):
        assert _engine_args(parse("--model", "Qwen/Qwen3-0.6B"), "serve").model == "Qwen/Qwen3-0.6B"
    assert not caplog.records  # nothing read as --model-impl
    assert _engine_args(parse("Qwen/Qwen3-0.6B"), "serve").model == "Qwen/Qwen3-0.6B"
    assert _engine_args(parse("a", "--model", "a"), "serve").model == "a"
    with pytest.raises(SystemExit, match="the model is given twice"):
        _engine_args(parse("a", "--model", "b"), "serve")


def test_newer_vllm_flags_are_notices(caplog):
    with caplog.at_level(logging.WARNING):
        _engine_args(parse("m", "--async-scheduling", "--max-cudagraph-capture-size", "512",
                           "--structured-outputs-config.backend", "xgrammar",
                           "--structured-outputs-config", '{"backend": "auto"}'), "serve")
    text = caplog.text
    for flag in ("--async-scheduling", "--max-cudagraph-capture-size 512",
                 "--structured-outputs-config.backend xgrammar", "--structured-outputs-config"):
        assert f"{flag}" in text and "changes nothing here" in text, text
    with pytest.raises(SystemExit, match="--structured-outputs-config.backend outlines is not supported"):
        _engine_args(parse("m", "--structured-outputs-config.backend", "outlines"), "serve")
    with pytest.raises(SystemExit, match="is not supported: structured outputs always run on xgrammar"):
        _engine_args(parse("m", "--structured-outputs-config", '{"disable_any_whitespace": true}'), "serve")


def test_vllm_thread_binding_variable(monkeypatch):
    from pagedllm.distributed.cpu_bind import rank_cpus

    monkeypatch.delenv("PAGEDLLM_CPU_BIND", raising=False)
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0-3|4-5,7")
    assert rank_cpus(1, 2) == [4, 5, 7]
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    assert rank_cpus(0, 2) is None
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "auto")
    assert rank_cpus(0, 2, available=[0, 1, 2, 3]) == [0, 1]
    monkeypatch.setenv("PAGEDLLM_CPU_BIND", "2|3")  # pagedllm's own wins
    assert rank_cpus(0, 2) == [2]


START_ERRORS = [
    (["--model", "Qwen/Qwen3-0.6B"], "has no complete snapshot of revision main of 'Qwen/Qwen3-0.6B'"),
    (["/no/such/model.gguf"], "no such file or directory"),
    (["--max-model-len", "0"], "max_model_len=0"),
    (["--ssl-keyfile", "key.pem"], "--ssl-keyfile and --ssl-certfile go together"),
    (["--enable-sleep-mode"], "--enable-sleep-mode is not supported"),
]


@pytest.mark.parametrize("argv, message", START_ERRORS, ids=["offline-hub-id", "path", "max-model-len", "ssl",
                                                              "missing-feature"])
def test_start_errors_are_one_line_and_exit_2(tmp_path, argv, message):
    env = {"HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(tmp_path), "PATH": "/usr/bin:/bin"}
    proc = subprocess.run([sys.executable, "-m", "pagedllm.entrypoints.cli", "serve", *argv], cwd=REPO_ROOT,
                          env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("pagedllm serve: ") and message in lines[0], proc.stderr


def test_tool_call_parser_without_a_parser_is_refused(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "pagedllm.entrypoints.cli", "serve", "--tool-call-parser",
                           "glm45"], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "invalid choice: 'glm45'" in proc.stderr.strip().splitlines()[-1]


class _HTTPSServer(RemoteServer):
    def _wait_healthy(self, timeout_s: float) -> None:
        self.url = self.url.replace("http://", "https://")
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, self.log()
            try:
                if httpx.get(self.url + "/health", timeout=2, verify=False).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        raise RuntimeError(self.log())


@pytest.mark.slow
def test_tls_and_root_path(tmp_path):
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out",
                    str(cert), "-days", "1", "-subj", "/CN=127.0.0.1",
                    "-addext", "subjectAltName=IP:127.0.0.1"], check=True, capture_output=True)
    srv = _HTTPSServer([*SMALL_SERVER_ARGS, "--ssl-keyfile", str(key), "--ssl-certfile", str(cert),
                        "--root-path", "/api"])
    try:
        r = httpx.post(srv.url + "/v1/completions", verify=str(cert), timeout=60,
                       json={"prompt": "Hello", "max_tokens": 2, "temperature": 0})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
        assert httpx.get(srv.url + "/openapi.json", verify=False).json()["servers"] == [{"url": "/api"}]
        with pytest.raises(httpx.HTTPError):
            httpx.get(srv.url.replace("https://", "http://") + "/health", timeout=5)
        # Not in dev mode (VLLM_SERVER_DEV_MODE unset): no /reset_prefix_cache, as vLLM.
        assert httpx.post(srv.url + "/reset_prefix_cache", verify=False).status_code == 404
    finally:
        srv.stop()
