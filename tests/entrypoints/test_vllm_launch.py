"""A vLLM CPU launch line, with only the command name changed, starts `pagedllm serve` and
serves the openai client; and vLLM's flags, environment, request fields and generation
defaults behave as docs/vllm_compatibility.md says.

One server on a tiny random checkpoint whose generation_config.json sets sampling defaults,
whose tokenizer adds a BOS, under a chat template that renders `documents`.
"""

from __future__ import annotations

import json
import logging
import re
import shutil
import time
import uuid
from pathlib import Path

import httpx
import openai
import pytest

from pagedllm.entrypoints.cli import _engine_args, _engine_config, build_parser
from pagedllm.entrypoints.vllm_flags import api_keys_from, kv_cache_bytes_from_env
from tests.entrypoints.utils import RemoteServer

pytestmark = pytest.mark.slow

API_KEY = "vllm-env-key"
# The checkpoint's sampling defaults; the request fields they stand for.
GENERATION_CONFIG = {"temperature": 0.7, "top_p": 0.9, "top_k": 20, "repetition_penalty": 1.2, "max_new_tokens": 9}
AS_REQUEST = {"temperature": 0.7, "top_p": 0.9, "top_k": 20, "repetition_penalty": 1.2, "max_tokens": 9}
NEUTRAL = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "repetition_penalty": 1.0, "max_tokens": 9}
BOS = 0  # the tokenizer below adds <|endoftext|> (id 0) before every text prompt
DOC_TEMPLATE = (
    "{% for d in documents or [] %}[doc] {{ d['text'] }}\n{% endfor %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
LAUNCH_LINE = [
    "--dtype", "bfloat16", "--max-model-len", "512", "--enable-chunked-prefill", "--trust-remote-code",
    "--disable-log-requests", "--swap-space", "4", "--served-model-name", "a", "b",
    "--scheduling-policy", "priority", "--max-logprobs", "5", "--load-format", "auto",
    "--allowed-origins", '["http://example.com"]', "--max-num-seqs", "8", "--disable-log-stats",
]
LAUNCH_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_API_KEY": API_KEY}


def bos_checkpoint(src: str, dst) -> str:
    """The tiny Llama with sampling defaults and a tokenizer that adds a BOS."""
    shutil.copytree(src, dst)
    (dst / "generation_config.json").write_text(json.dumps(GENERATION_CONFIG))
    tokenizer_json = dst / "tokenizer.json"
    spec = json.loads(tokenizer_json.read_text())
    bos = {"SpecialToken": {"id": "<|endoftext|>", "type_id": 0}}
    spec["post_processor"] = {
        "type": "TemplateProcessing",
        "single": [bos, {"Sequence": {"id": "A", "type_id": 0}}],
        "pair": [bos, {"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": {"<|endoftext|>": {"id": "<|endoftext|>", "ids": [BOS], "tokens": ["<|endoftext|>"]}},
    }
    tokenizer_json.write_text(json.dumps(spec))
    return str(dst)


@pytest.fixture(scope="module")
def checkpoint(tiny_llama_dir, tmp_path_factory):
    return bos_checkpoint(tiny_llama_dir, tmp_path_factory.mktemp("vllm-launch") / "model")


@pytest.fixture(scope="module")
def server(checkpoint, tmp_path_factory):
    template = tmp_path_factory.mktemp("template") / "docs.jinja"
    template.write_text(DOC_TEMPLATE)
    srv = RemoteServer([*LAUNCH_LINE, "--chat-template", str(template)], model=checkpoint, env=LAUNCH_ENV)
    srv.healthy_at = time.monotonic()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url, api_key=API_KEY, max_retries=0, timeout=120)


def complete(client, prompt="Once upon a time", **body):
    return client.completions.create(model="a", prompt=prompt, extra_body=body or None)


def test_the_launch_line_serves_under_every_served_name(server, client):
    out = client.completions.create(model="b", prompt="Hello", max_tokens=3, temperature=0)
    assert out.model == "a" and out.usage.completion_tokens >= 1  # the first name is reported
    chat = client.chat.completions.create(model="a", messages=[{"role": "user", "content": "Hi"}], max_tokens=2)
    assert chat.model == "a" and chat.choices[0].message.content is not None
    assert [m.id for m in client.models.list().data] == ["a", "b"]
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="c", prompt="Hello", max_tokens=1)
    log = server.log_path.read_text()
    for flag in ("--enable-chunked-prefill", "--trust-remote-code", "--swap-space 4.0", "--disable-log-requests",
                 "--load-format auto"):
        assert f"{flag} changes nothing here" in log, flag
    assert "KV cache budget 1024.0 MiB" in log  # VLLM_CPU_KVCACHE_SPACE=1 (GiB)
    assert "Received request" not in log  # requests are logged only with --enable-log-requests


def test_vllm_api_key_from_the_environment(server):
    r = httpx.post(server.base_url + "/completions", json={"prompt": "Hi", "max_tokens": 1}, timeout=60)
    assert r.status_code == 401
    for method in ("GET", "POST"):  # vLLM's /ping, open as /health is
        assert httpx.request(method, server.url + "/ping", timeout=30).status_code == 200
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.base_url, api_key="wrong", max_retries=0).models.list()


def test_generation_config_defaults_equal_the_same_values_given_explicitly(server, client):
    log = server.log_path.read_text()
    assert "sampling defaults from the checkpoint" in log and "top_k=20" in log and "max_tokens=9" in log
    for seed in (1, 2):
        bare = complete(client, seed=seed, ignore_eos=True, return_token_ids=True)
        explicit = complete(client, seed=seed, ignore_eos=True, return_token_ids=True, **AS_REQUEST)
        neutral = complete(client, seed=seed, ignore_eos=True, return_token_ids=True, **NEUTRAL)
        ids = [o.choices[0].model_extra["token_ids"] for o in (bare, explicit, neutral)]
        assert len(ids[0]) == 9  # max_new_tokens
        assert ids[0] == ids[1]
        assert ids[0] != ids[2]  # the negative control: other values sample other tokens
    chat = client.chat.completions.create(model="a", messages=[{"role": "user", "content": "Hi"}], seed=3,
                                          extra_body={"ignore_eos": True})
    assert chat.usage.completion_tokens == 9
    assert complete(client, max_tokens=4, ignore_eos=True).usage.completion_tokens == 4  # the request wins


def test_priority_is_accepted_under_the_priority_policy(client):
    assert complete(client, max_tokens=2, priority=-5).usage.completion_tokens >= 1
    assert complete(client, max_tokens=2, priority=7).usage.completion_tokens >= 1


def test_max_logprobs(client):
    assert len(complete(client, max_tokens=1, logprobs=5).choices[0].logprobs.top_logprobs[0]) == 5
    with pytest.raises(openai.BadRequestError, match="max_logprobs=5"):
        complete(client, max_tokens=1, logprobs=6)


def test_add_special_tokens(client):
    with_bos = complete(client, "Hello there", max_tokens=1, return_token_ids=True).choices[0]
    without = complete(client, "Hello there", max_tokens=1, return_token_ids=True,
                       add_special_tokens=False).choices[0]
    assert with_bos.model_extra["prompt_token_ids"] == [BOS, *without.model_extra["prompt_token_ids"]]
    messages = [{"role": "user", "content": "Hi"}]
    chat = [client.chat.completions.create(model="a", messages=messages, max_tokens=1,
                                           extra_body={"return_token_ids": True, "add_special_tokens": add})
            for add in (False, True)]
    plain, added = (c.model_extra["prompt_token_ids"] for c in chat)
    assert plain[0] != BOS and added == [BOS, *plain]  # chat's default: the template's tokens only


def test_documents_reach_the_chat_template(client, checkpoint):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    messages = [{"role": "user", "content": "Capital?"}]
    docs = [{"title": "geo", "text": "Paris is the capital of France."}]
    usage = [client.chat.completions.create(model="a", messages=messages, max_tokens=1,
                                            extra_body=extra).usage.prompt_tokens
             for extra in ({}, {"documents": docs})]
    doc_tokens = len(tokenizer.encode("[doc] Paris is the capital of France.\n", add_special_tokens=False))
    assert usage[1] - usage[0] == doc_tokens


def test_cors(server):
    preflight = {"Origin": "http://example.com", "Access-Control-Request-Method": "POST"}
    r = httpx.options(server.base_url + "/completions", headers=preflight, timeout=30)  # no key needed
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "http://example.com"
    r = httpx.options(server.base_url + "/completions", headers={**preflight, "Origin": "http://evil.example"})
    assert r.status_code == 400 and "access-control-allow-origin" not in r.headers


def test_enable_log_requests_logs_one_line_per_request(keyed_server, default_tokenizer):
    from tests.entrypoints.conftest import API_KEY as KEYED_API_KEY, SERVED_NAME

    client = openai.OpenAI(base_url=keyed_server.base_url, api_key=KEYED_API_KEY, max_retries=0, timeout=120)
    request_id = f"logged-{uuid.uuid4().hex}"
    client.completions.create(model=SERVED_NAME, prompt="Hello there", max_tokens=2,
                              extra_body={"request_id": request_id})
    lines = [line for line in keyed_server.log_path.read_text().splitlines()
             if f"Received request {request_id}-" in line]  # the engine id: the client's + a suffix
    assert len(lines) == 1, lines
    assert f"num_prompt_tokens: {len(default_tokenizer.encode('Hello there'))}," in lines[0]
    assert "max_tokens=2" in lines[0]


def test_disable_log_stats(server, client):
    from pagedllm.metrics import LOG_INTERVAL_S

    # Past one stats interval of serving, a server without the flag has logged a stats line.
    time.sleep(max(0.0, server.healthy_at + LOG_INTERVAL_S + 1 - time.monotonic()))
    complete(client, max_tokens=2)
    time.sleep(1.0)
    assert "Engine: running" not in server.log_path.read_text()


# ---- without a server: the flags and the environment ------------------------------------------


def parse(*argv: str):
    return build_parser().parse_args(["serve", "some-model", *argv])


@pytest.mark.parametrize("argv,message", [
    (["--lora-modules", "a=/no/such/dir"], "--lora-modules needs --enable-lora"),
    (["--enable-sleep-mode"], "--enable-sleep-mode is not supported: no sleep mode"),
    (["-pp", "2"], "--pipeline-parallel-size 2 is not supported: no pipeline parallelism"),
    (["--no-enable-chunked-prefill"], "--no-enable-chunked-prefill is not supported: chunked prefill is always on"),
    (["--load-format", "dummy"], "--load-format dummy is not supported"),
    (["--gpu-memory-utilization", "0.9"], "--kv-cache-memory-bytes"),
    (["--generation-config", "/no/such/dir"], "generation_config='/no/such/dir'"),
    (["--hf-overrides", '{"rope_theta": 5}'], "hf_overrides rope_theta cannot be applied; supported: Qwen3-Reranker"),
], ids=["lora", "sleep", "pp", "no-chunked-prefill", "load-format", "gpu-memory", "generation-config", "hf-overrides"])
def test_flags_for_what_is_missing_stop_the_start(argv, message):
    with pytest.raises(SystemExit) as exc:
        _engine_config(parse(*argv), "serve")
    assert message in str(exc.value)


def _documented_unrecognized_engine_flags() -> list[str]:
    """The flags of docs/vllm_compatibility.md's engine-flag rows marked unrecognized."""
    doc = (Path(__file__).resolve().parents[2] / "docs" / "vllm_compatibility.md").read_text()
    flags = []
    for line in doc.splitlines():
        cells = line.split(" | ")
        if len(cells) == 2 and cells[0].startswith(("| Engine flags", "| Flags older")) and cells[1].startswith(
                "unrecognized"):
            flags += [f for f in re.findall(r"`(-[^`\s]+)`", cells[0])]
    return flags


def test_documented_unrecognized_engine_flags_are_argparse_errors(capsys):
    """Each vLLM engine flag the table calls unrecognized is argparse's error naming it."""
    flags = _documented_unrecognized_engine_flags()
    assert len(flags) > 50 and "--stream-interval" in flags
    for flag in flags:
        with pytest.raises(SystemExit):
            parse(f"{flag}=1")
        assert f"unrecognized arguments: {flag}=1" in capsys.readouterr().err, flag


def test_hf_overrides_takes_the_qwen3_reranker_recipe():
    recipe = {"architectures": ["Qwen3ForSequenceClassification"], "classifier_from_token": ["no", "yes"],
              "is_original_qwen3_reranker": True}
    _, config = _engine_config(parse("--hf-overrides", json.dumps(recipe)), "serve")
    assert config.load_config.hf_overrides == recipe


@pytest.mark.parametrize("value", ["auto", "int8", "fp8", "fp8_e4m3", "fp8_e5m2"])
def test_kv_cache_dtype_is_an_engine_argument(value):
    assert _engine_args(parse("--kv-cache-dtype", value), "serve").kv_cache_dtype == value


def test_harmless_values_of_missing_feature_flags_pass_silently(caplog):
    with caplog.at_level(logging.WARNING):
        args = _engine_args(parse("--kv-cache-dtype", "auto", "-pp", "1", "-dp", "1", "--task", "generate"), "serve")
    assert args.model == "some-model" and not caplog.records


def test_vllm_dtypes_map_to_what_the_cpu_does(caplog):
    from pagedllm.engine.core_builder import resolve_dtype
    from pagedllm.platforms.cpu import CpuPlatform

    with caplog.at_level(logging.WARNING):
        _, config = _engine_config(parse("--dtype", "half"), "serve")
    assert config.load_config.dtype == "auto"
    assert resolve_dtype(config.load_config, CpuPlatform()) in ("bfloat16", "float32")
    assert "dtype=half: no float16 compute here" in caplog.text
    assert _engine_config(parse("--dtype", "float"), "serve")[1].load_config.dtype == "float32"


def test_vllm_cpu_kvcache_space():
    assert kv_cache_bytes_from_env({"VLLM_CPU_KVCACHE_SPACE": "2"}, None) == 2 << 30
    assert kv_cache_bytes_from_env({"VLLM_CPU_KVCACHE_SPACE": "0"}, None) is None  # vLLM: 0 = the default
    assert kv_cache_bytes_from_env({}, None) is None
    assert kv_cache_bytes_from_env({"VLLM_CPU_KVCACHE_SPACE": "2"}, "1GiB") == "1GiB"  # the flag wins
    for bad in ("-1", "1.5", "lots"):
        with pytest.raises(ValueError, match="VLLM_CPU_KVCACHE_SPACE"):
            kv_cache_bytes_from_env({"VLLM_CPU_KVCACHE_SPACE": bad}, None)


def test_api_keys():
    assert api_keys_from(["k1", "k2"], {"VLLM_API_KEY": "env"}) == ("k1", "k2")
    assert api_keys_from(None, {"VLLM_API_KEY": "env", "PAGEDLLM_API_KEY": "p"}) == ("env",)
    assert api_keys_from(None, {"PAGEDLLM_API_KEY": "p"}) == ("p",)
    assert api_keys_from(None, {}) == ()


def test_several_api_keys_each_open_the_server():
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    from pagedllm.entrypoints.openai.api_server import APIKeyMiddleware

    app = FastAPI()
    app.get("/v1/models")(lambda: {"ok": True})
    app.add_middleware(APIKeyMiddleware, api_keys=(b"k1", b"k2"))
    client = TestClient(app)
    for key, status in (("k1", 200), ("k2", 200), ("k3", 401), ("", 401)):
        assert client.get("/v1/models", headers={"Authorization": f"Bearer {key}"}).status_code == status, key


def test_offline_priority_runs_lower_values_first(checkpoint):
    from pagedllm import LLM, SamplingParams

    llm = LLM(checkpoint, max_num_seqs=1, scheduling_policy="priority", kv_cache_memory_bytes="16MiB",
              max_model_len=256)
    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    outs = llm.generate(["one", "two", "three"], params, use_tqdm=False, priority=[2, 0, 1])
    finished = [o.metrics["finished_time"] for o in outs]
    assert finished[1] < finished[2] < finished[0]
    # The checkpoint's defaults apply when no SamplingParams are given, as vLLM.
    defaults = llm.get_default_sampling_params()
    assert (defaults.temperature, defaults.top_k, defaults.max_tokens) == (0.7, 20, 9)
    with pytest.raises(ValueError, match="priorities for 3 prompts"):
        llm.generate(["one", "two", "three"], params, use_tqdm=False, priority=[0])
    llm.shutdown()
    fcfs = LLM(checkpoint, kv_cache_memory_bytes="16MiB", max_model_len=256, generation_config="vllm")
    with pytest.raises(ValueError, match="--scheduling-policy priority"):
        fcfs.generate(["one"], params, use_tqdm=False, priority=[1])
    assert fcfs.get_default_sampling_params().temperature == 1.0  # vllm: no checkpoint defaults


def test_tokenizer_flag_replaces_the_models(tiny_llama_dir, checkpoint):
    from pagedllm import LLM, SamplingParams

    params = SamplingParams(max_tokens=1, temperature=0)
    own = LLM(tiny_llama_dir, kv_cache_memory_bytes="16MiB", max_model_len=256)
    other = LLM(tiny_llama_dir, tokenizer=checkpoint, kv_cache_memory_bytes="16MiB", max_model_len=256)
    (a,) = own.generate(["Hello there"], params, use_tqdm=False)
    (b,) = other.generate(["Hello there"], params, use_tqdm=False)
    assert b.prompt_token_ids == [BOS, *a.prompt_token_ids]  # the other tokenizer adds a BOS
