"""EngineArgs -> EngineConfig: flags generated from the fields (every old flag name and vLLM
alias still parses), one default per field, every check in create_engine_config, settings
that used to be environment variables read at import now configuration. Model-free."""

from __future__ import annotations

import argparse
import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest

from pagedllm import faults
from pagedllm.config import SCHEDULER_DEFAULTS, AttentionConfig, CacheConfig, EngineConfig, SamplingConfig
from pagedllm.engine.arg_flags import flag_spec
from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.entrypoints.cli import _engine_args, build_parser
from pagedllm.platforms.isa import resolve_isa

REPO = Path(__file__).resolve().parents[2]

# Every engine flag the hand-written parser had (and the vLLM aliases), with a value.
OLD_FLAGS: dict[str, tuple[list[str], str, object]] = {
    "revision": (["--revision", "v1"], "revision", "v1"),
    "download-dir": (["--download-dir", "/tmp/hub"], "download_dir", "/tmp/hub"),
    "dtype": (["--dtype", "half"], "dtype", "half"),
    "tokenizer": (["--tokenizer", "tok"], "tokenizer", "tok"),
    "max-model-len": (["--max-model-len", "512"], "max_model_len", 512),
    "block-size": (["--block-size", "32"], "block_size", 32),
    "kv-cache-memory-bytes": (["--kv-cache-memory-bytes", "1GiB"], "kv_cache_memory_bytes", "1GiB"),
    "device": (["--device", "cpu"], "device", "cpu"),
    "gpu-memory-utilization": (["--gpu-memory-utilization", "0.5"], "gpu_memory_utilization", 0.5),
    "cuda-graph-sizes": (["--cuda-graph-sizes", "1", "4"], "cuda_graph_sizes", [1, 4]),
    "max-num-seqs": (["--max-num-seqs", "7"], "max_num_seqs", 7),
    "max-num-batched-tokens": (["--max-num-batched-tokens", "99"], "max_num_batched_tokens", 99),
    "enable-prefix-caching": (["--enable-prefix-caching"], "enable_prefix_caching", True),
    "no-enable-prefix-caching": (["--no-enable-prefix-caching"], "enable_prefix_caching", False),
    "kv-cache-backend": (["--kv-cache-backend", "vattention"], "kv_cache_backend", "vattention"),
    "kv-cache-dtype": (["--kv-cache-dtype", "int8"], "kv_cache_dtype", "int8"),
    "vattention-hugepages": (["--vattention-hugepages"], "vattention_hugepages", True),
    "no-vattention-deferred-reclaim": (["--no-vattention-deferred-reclaim"], "vattention_deferred_reclaim", False),
    "attention-backend": (["--attention-backend", "reference"], "attention_backend", "reference"),
    "seed": (["--seed", "3"], "seed", 3),
    "quantization": (["--quantization", "int4"], "quantization", "int4"),
    "-q": (["-q", "int8"], "quantization", "int8"),
    "prefill-activations": (["--prefill-activations", "int8"], "matmul_activations", "int8"),
    "prefill-activations-float": (["--prefill-activations", "float"], "matmul_activations", "float32"),
    "matmul-activations": (["--matmul-activations", "bf16"], "matmul_activations", "bf16"),
    "kv-transfer-config": (["--kv-transfer-config", '{"kv_role": "kv_producer"}'], "kv_transfer_config",
                           '{"kv_role": "kv_producer"}'),
    "speculative-config": (["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2}'],
                           "speculative_config", {"method": "ngram", "num_speculative_tokens": 2}),
    "tensor-parallel-size": (["--tensor-parallel-size", "2"], "tensor_parallel_size", 2),
    "-tp": (["-tp", "2"], "tensor_parallel_size", 2),
    "distributed-executor-backend": (["--distributed-executor-backend", "mp"], "distributed_executor_backend", "mp"),
    "reasoning-parser": (["--reasoning-parser", "qwen3"], "reasoning_parser", "qwen3"),
    "scheduling-policy": (["--scheduling-policy", "priority"], "scheduling_policy", "priority"),
    "max-logprobs": (["--max-logprobs", "5"], "max_logprobs", 5),
    "generation-config": (["--generation-config", "vllm"], "generation_config", "vllm"),
    "override-generation-config": (["--override-generation-config", '{"temperature": 0.5}'],
                                   "override_generation_config", {"temperature": 0.5}),
    "disable-log-stats": (["--disable-log-stats"], "disable_log_stats", True),
    "enable-lora": (["--enable-lora"], "enable_lora", True),
    "max-loras": (["--max-loras", "2"], "max_loras", 2),
    "max-lora-rank": (["--max-lora-rank", "8"], "max_lora_rank", 8),
    "max-cpu-loras": (["--max-cpu-loras", "4"], "max_cpu_loras", 4),
}


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)
    return parser


@pytest.mark.parametrize("name", list(OLD_FLAGS))
def test_every_old_flag_and_alias_still_parses(name: str) -> None:
    argv, field, value = OLD_FLAGS[name]
    assert getattr(EngineArgs.from_cli_args(_parser().parse_args(argv)), field) == value


def test_every_flag_is_generated_from_a_field() -> None:
    parser = _parser()
    by_dest = {a.dest: a for a in parser._actions if a.dest != "help"}
    flagged = [f for f in dataclasses.fields(EngineArgs) if flag_spec(f) is not None]
    assert {f.name for f in flagged} == set(by_dest)  # no flag without a field, no field without its flag
    for f in flagged:
        action = by_dest[f.name]
        assert action.default is None, f"--{f.name}: the parser holds no default of its own"
        assert action.help and action.help.startswith(flag_spec(f)["help"])
        if f.default is not None:
            assert f"(default: {f.default})" in action.help
    assert set(OLD_FLAGS[n][1] for n in OLD_FLAGS) <= set(by_dest)
    # Nothing given: the arguments are EngineArgs' own defaults.
    assert EngineArgs.from_cli_args(parser.parse_args([])) == EngineArgs()


def test_one_default_per_field() -> None:
    args = EngineArgs()
    assert args.block_size == CacheConfig.block_size and args.kv_cache_backend == CacheConfig.kv_cache_backend
    assert args.max_logprobs == SamplingConfig.max_logprobs
    assert args.compiled_kernels == AttentionConfig.compiled_kernels
    offline = args.create_engine_config(environ={}).scheduler_config
    assert (offline.max_num_seqs, offline.max_num_batched_tokens) == SCHEDULER_DEFAULTS["offline"]
    for command, usage in (("serve", "serve"), ("generate", "offline")):
        cli_args = _engine_args(build_parser().parse_args([command]), command)
        sched = cli_args.create_engine_config(environ={}).scheduler_config
        assert (sched.max_num_seqs, sched.max_num_batched_tokens) == SCHEDULER_DEFAULTS[usage], command
    # A given max_num_seqs above the default token budget raises the budget to it.
    big = EngineArgs(max_num_seqs=5000).create_engine_config(environ={}).scheduler_config
    assert big.max_num_batched_tokens == 5000


def test_the_config_is_frozen_and_whole() -> None:
    config = EngineArgs(enable_lora=True, reasoning_parser="qwen3", seed=7).create_engine_config(environ={})
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.seed = 1  # type: ignore[misc]
    assert config.lora_config is not None and config.lora_config.max_loras == 1
    assert config.structured_output_config.reasoning_parser == "qwen3"
    transfer = EngineArgs(kv_transfer_config='{"kv_role": "kv_producer"}').create_engine_config(environ={})
    assert transfer.kv_transfer_config is not None and transfer.kv_transfer_config.kv_role == "kv_producer"
    assert config.device_config.device == "cpu" and config.attention_config.backend == "torch"
    assert config.device_config.cpu_isa == resolve_isa(None)  # the platform filled the level in
    assert config.model_config is None and config.num_blocks == 0  # filled in at build


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"enable_lora": True, "tensor_parallel_size": 2}, "--enable-lora does not run with tensor parallelism"),
        ({"kv_cache_backend": "vattention", "enable_prefix_caching": True}, "prefix caching shares KV blocks"),
        ({"tensor_parallel_size": 2, "speculative_config": {"method": "ngram", "num_speculative_tokens": 2}},
         "does not support speculative_config"),
        ({"generation_config": "/no/such/dir"}, "generation_config='/no/such/dir'"),
        ({"max_logprobs": -1}, "max_logprobs=-1"),
        ({"device": "tpu"}, "device='tpu' is not one of"),
        ({"cpu_isa": "sse9"}, "'sse9' is not one of generic, avx2, avx512, amx"),
        ({"inject_fault": "nowhere:x"}, "inject_fault='nowhere:x'"),
        ({"max_num_seqs": 8, "max_num_batched_tokens": 4}, "must be at least max_num_seqs=8"),
        ({"kv_cache_backend": "vattention", "kv_offload_cpu_bytes": "1GiB"},
         "KV offload tiers .* are not supported with --kv-cache-backend vattention"),
        ({"kv_offload_dir": "/tmp/x", "enable_prefix_caching": False}, "they need prefix caching"),
        ({"kv_offload_cpu_bytes": "1GiB", "tensor_parallel_size": 2}, "do not run with tensor_parallel_size=2"),
        ({"kv_offload_disk_bytes": "1GiB"}, "needs kv_offload_dir"),
        ({"kv_offloading_backend": "lmcache"}, "lmcache is not supported"),
        ({"kv_offloading_size": 1.0, "kv_offload_cpu_bytes": "1GiB"}, "not both"),
    ],
)
def test_checks_run_in_create_engine_config(kwargs: dict, match: str) -> None:
    args = EngineArgs(**kwargs)  # constructing checks nothing
    with pytest.raises(ValueError, match=match):
        args.create_engine_config(environ={})


def test_kv_offload_flags() -> None:
    vllm_names = EngineArgs(kv_offloading_size=1.5, kv_offloading_backend="native").create_engine_config(environ={})
    assert vllm_names.cache_config.kv_offload_cpu_bytes == int(1.5 * 2**30)
    ours = EngineArgs(kv_offload_cpu_bytes="64MiB", kv_offload_dir="/tmp/kv", kv_offload_disk_bytes="1GB")
    cache = ours.create_engine_config(environ={}).cache_config
    assert (cache.kv_offload_cpu_bytes, cache.kv_offload_dir, cache.kv_offload_disk_bytes) == (
        64 * 2**20, "/tmp/kv", 10**9)
    assert not EngineArgs().create_engine_config(environ={}).cache_config.kv_offload


def test_former_environment_switches_are_configuration() -> None:
    config = EngineArgs().create_engine_config(environ={
        "PAGEDLLM_FUSED_DECODE": "0", "PAGEDLLM_CPU_KERNELS": "0", "PAGEDLLM_INJECT_FAULT": "sample:x",
        "PAGEDLLM_CPU_ISA": "generic"})
    assert config.device_config.cpu_isa == "generic"
    assert not config.attention_config.fused_decode and not config.attention_config.compiled_kernels
    assert config.observability_config.inject_fault == "sample:x"
    config = EngineArgs(fused_decode=False, inject_fault="add:y").create_engine_config(environ={})
    assert not config.attention_config.fused_decode and config.observability_config.inject_fault == "add:y"
    assert EngineArgs().create_engine_config(environ={}).observability_config.inject_fault is None


def test_faults_are_installed_not_read_at_import() -> None:
    try:
        faults.configure("sample:poison@2")
        faults.maybe_raise("sample", "req-poison")  # the first pass goes through
        with pytest.raises(faults.InjectedFault):
            faults.maybe_raise("sample", "req-poison")
        faults.maybe_raise("sample", "req-clean")
        faults.configure(None)
        faults.maybe_raise("sample", "req-poison")
    finally:
        faults.configure(None)


def test_creating_the_config_imports_no_torch() -> None:
    """The server's front end checks the configuration before the core process starts."""
    code = (
        "import sys\n"
        "from pagedllm.engine.arg_utils import EngineArgs\n"
        "EngineArgs(speculative_config={'method': 'ngram', 'num_speculative_tokens': 2}).create_engine_config()\n"
        "assert 'torch' not in sys.modules, 'torch imported'\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120,
                         env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr


def test_engine_config_defaults_are_its_sub_configs() -> None:
    config = EngineConfig()
    assert config.cache_config == CacheConfig() and config.attention_config == AttentionConfig()
