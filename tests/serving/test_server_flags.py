"""The server's flags, generated from the configuration dataclasses: a full command line parses into the sections
and back, every field has exactly one flag, `--help` lists them once by section, and a bad value is a usage
error naming its flag (no traceback)."""

import dataclasses
import re
import subprocess
import sys
from pathlib import Path

import pytest

from serving.api.server import ServerArgs
from serving.engine.args import EngineArgs, field_names, flag_name
from serving.model_source import ModelArgs
from serving.server import ServeArgs, parse_args, parser
from serving.text.template_kwargs import ChatTemplateKwargs

ROOT = Path(__file__).resolve().parents[2]

FULL = ["--model", "small", "--served-model-name", "m", "--dtype", "bfloat16", "--no-engram-cpu-offload",
        "--host", "0.0.0.0", "--port", "9000", "--api-key", "k", "--max-request-body-bytes", "1000",
        "--compilation-cache-dir", "", "--compilation-cache-max-gb", "2", "--no-background-compile",
        "--no-keep-host-memory", "--disable-access-log", "--log-level", "debug", "--profile-dir", "traces",
        "--default-chat-template-kwargs", '{"thinking": false}', "--responses-store-max-entries", "8",
        "--responses-store-max-bytes", "4096",
        "--max-num-seqs", "16", "--max-num-batched-tokens", "256", "--max-model-len", "2048", "--block-size", "16",
        "--kv-cache-dtype", "release", "--kv-cache-memory", "1000000", "--no-swa-bounded-replay", "--tile", "4",
        "--fake-quant", "--max-top-k", "64", "--seed", "7", "--token-buckets", "8,16,256", "--kernel-impl", "xla",
        "--moe-small-steps", "tiles", "--kernel-tiles", "none",
        "--speculative-config", '{"method": "dspark", "num_speculative_tokens": 2}',
        "--long-prefill-token-threshold", "64", "--bucket-fit-min-tokens", "512", "--max-queued-requests", "10",
        "--scheduling-policy", "priority",
        "--no-enable-prefix-caching", "--no-async-scheduling", "--dp-routing-policy", "load", "--dp-max-inflight", "3",
        "-tp", "2", "-dp", "2", "--enable-expert-parallel", "-ep", "4", "--num-cpu-devices", "4",
        "--nnodes", "2", "--node-rank", "1", "--dist-init-addr", "h:1", "--dead-rank-timeout", "5",
        "--enable-eplb", "--eplb-window-size", "10", "--eplb-step-interval", "20", "--eplb-num-redundant-experts", "8"]


def _sections() -> dict[str, type]:
    """Title -> dataclass of every group of the server's flags."""
    return {"model: what to serve": ModelArgs, "server: HTTP, logging, compilation cache": ServerArgs,
            **{title: sec for sec, title in EngineArgs.sections().values()}}


def test_a_full_command_line_parses_into_the_sections_and_back():
    got = parse_args(FULL)
    assert got.model == ModelArgs("small", "m", "bfloat16", engram_cpu_offload=False)
    assert got.server == ServerArgs("0.0.0.0", 9000, "k", 1000, "", 2, False, False, True, "debug", "traces",
                                    '{"thinking": false}', 8, 4096)
    assert got.server.chat_template_defaults == ChatTemplateKwargs(thinking=False)
    assert got.engine == EngineArgs.of(
        max_num_seqs=16, max_num_batched_tokens=256, max_model_len=2048, block_size=16, kv_cache_dtype="release",
        kv_cache_memory=1000000, swa_bounded_replay=False, tile=4, fake_quant=True, max_top_k=64, seed=7,
        token_buckets=(8, 16, 256), kernel_impl="xla", moe_small_steps="tiles", kernel_tiles="none",
        long_prefill_token_threshold=64,
        bucket_fit_min_tokens=512, max_queued_requests=10,
        speculative_config='{"method": "dspark", "num_speculative_tokens": 2}',
        scheduling_policy="priority", enable_prefix_caching=False, async_scheduling=False, dp_routing_policy="load",
        dp_max_inflight=3, tensor_parallel_size=2, data_parallel_size=2, enable_expert_parallel=True,
        expert_parallel_size=4, num_cpu_devices=4, nnodes=2, node_rank=1, dist_init_addr="h:1", dead_rank_timeout=5,
        enable_eplb=True, eplb_window_size=10, eplb_step_interval=20,
        eplb_num_redundant_experts=8)
    # every field differs from its default: the way back names all of them, and parses to the same values
    back = got.to_cli_args()
    assert len({a for a in back if a.startswith("-")}) == sum(len(field_names(c)) for c in _sections().values())
    assert parse_args(back) == got
    assert parse_args([]) == ServeArgs(ModelArgs(), ServerArgs(), EngineArgs()) and ServeArgs(
        ModelArgs(), ServerArgs(), EngineArgs()).to_cli_args() == []


def test_every_field_has_exactly_one_flag():
    names = [n for sec in _sections().values() for n in field_names(sec)]
    assert len(names) == len(set(names)), "a field name is in two sections"
    actions = [a for a in parser()._actions if a.dest != "help"]
    assert sorted(a.dest for a in actions) == sorted(names)  # one flag per field, no flag for two fields
    strings = [s for a in actions for s in a.option_strings]
    assert len(strings) == len(set(strings))
    for sec in _sections().values():
        for f in dataclasses.fields(sec):
            (action,) = [a for a in actions if a.dest == f.name]
            assert flag_name(f) in action.option_strings
            assert action.default == f.default  # the dataclass default is the only default


def test_help_lists_every_flag_once_grouped_by_section():
    r = subprocess.run([sys.executable, "-m", "serving.server", "--help"], cwd=ROOT, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    groups = {}
    for block in r.stdout.split("\n\n"):
        title, _, body = block.partition("\n")
        groups[title.rstrip(":")] = re.findall(r"^  (--[\w-]+)", body, re.M)
    for title, sec in _sections().items():
        assert groups[title] == [flag_name(f) for f in dataclasses.fields(sec)], title
    listed = [f for flags in groups.values() for f in flags]
    assert len(listed) == len(set(listed))
    assert "-tp TENSOR_PARALLEL_SIZE" in r.stdout and "--no-enable-prefix-caching" in r.stdout


@pytest.mark.parametrize("argv, flag, message", [
    (["--max-num-seqs", "0"], "--max-num-seqs", "max_num_seqs must be positive, got 0"),
    (["--max-num-seqs", "64", "--max-num-batched-tokens", "32"], "--max-num-batched-tokens, --max-num-seqs",
     "max_num_batched_tokens must be >= max_num_seqs"),
    (["--token-buckets", "8,x"], "--token-buckets", "expected comma-separated integers"),
    (["--kernel-impl", "cuda"], "--kernel-impl", "invalid choice: 'cuda'"),
    (["--scheduling-policy", "x"], "--scheduling-policy", "invalid choice: 'x'"),
    (["--port", "70000"], "--port", "port must be in [0, 65535]"),
    (["--compilation-cache-max-gb", "-1"], "--compilation-cache-max-gb", "compilation_cache_max_gb must be >= 0"),
    (["--profile-dir", ""], "--profile-dir", "profile_dir must name a folder, got ''"),
    (["-tp", "3", "-dp", "2", "--enable-expert-parallel", "-ep", "4"], "--expert-parallel-size",
     "must divide the world size 6"),
    (["--eplb-step-interval", "0"], "--eplb-step-interval", "eplb_step_interval must be >= 1"),
    (["--enable-eplb"], "--enable-eplb, --enable-expert-parallel", "enable_eplb needs enable_expert_parallel"),
    (["--num-cpu-devices", "0"], "--num-cpu-devices", "num_cpu_devices must be >= 1"),
    (["--speculative-config", '{"method": "eagle"}'], "--speculative-config", "method 'eagle'"),
    (["--speculative-config", "{5"], "--speculative-config", "not valid JSON"),
    (["--default-chat-template-kwargs", "{5"], "--default-chat-template-kwargs", "not valid JSON"),
    (["--default-chat-template-kwargs", '{"think": false}'], "--default-chat-template-kwargs", "unknown key(s)"),
    (["--default-chat-template-kwargs", '{"reasoning_effort": 0}'], "--default-chat-template-kwargs",
     "reasoning_effort: must be"),
    (["--responses-store-max-entries", "0"], "--responses-store-max-entries", "must be >= 1"),
])
def test_bad_values_are_usage_errors_naming_the_flag(capsys, argv, flag, message):
    with pytest.raises(SystemExit) as exit_:
        parse_args(argv)
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and f"argument {flag}" in err and message in err, err
    assert "Traceback" not in err


def test_a_bad_value_exits_before_loading_anything():
    r = subprocess.run([sys.executable, "-m", "serving.server", "--max-num-seqs", "0"], cwd=ROOT,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and "argument --max-num-seqs: max_num_seqs must be positive" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr and "loading" not in r.stderr
