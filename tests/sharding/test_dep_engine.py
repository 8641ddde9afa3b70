"""The serving engine on DEP8 (8 virtual CPU devices, in a subprocess: this process may have initialised jax
with another device count): requests routed to data-parallel ranks, each rank with its own slots, blocks
and prefix cache, give the single-device engine's greedy outputs; a session's second turn goes back to its
rank and hits the prefix cache there. EPLB (8 redundant expert slots) rearranges every `interval` steps,
the weights migrate between steps without recompiling, and the balancedness and rearrangement count are in
the rendered /metrics registry. Without EPLB a dp4 x tp2 engine schedules async with the same outputs. Also: EPLB
without expert parallelism is refused by name."""

import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import dsv41
from serving.engine.args import EngineArgs
from serving.engine.engine import Engine
from tests.conftest import HANG_TIMEOUT_S, XLA_CACHE, xla_env
from tests.sharding.dep_engine_worker import INTERVAL

pytestmark = pytest.mark.slow  # the second tier (`make test-slow`; tests/README.md)

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def served():
    env = xla_env(8)
    proc = subprocess.run([sys.executable, "-m", "tests.sharding.dep_engine_worker", "--compilation-cache-dir",
                           str(XLA_CACHE)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=HANG_TIMEOUT_S)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_data_parallel_ranks_serve_sessions_where_their_cache_is(served):
    assert served["eplb"] == served["ref"] and served["dep_turn2"] == served["ref_turn2"]
    ranks = served["ranks"]
    first = [ranks[f"s{i}-t1"] for i in range(3)]
    assert len(set(first)) == 3  # new sessions go to the least-loaded ranks
    assert [ranks[f"s{i}-t2"] for i in range(3)] == first  # sticky: each session's second turn on its rank
    # the second turns hit their rank's prefix cache exactly as the single-device engine's one cache
    assert served["dep_turn2"]["cached"] == served["ref_turn2"]["cached"] and max(served["dep_turn2"]["cached"]) > 0
    per_rank = [ln for ln in served["metrics"] if ln.startswith("dsv41:dp_rank_requests{")]
    assert len(per_rank) == 8 and all(ln.endswith(" 0.0") for ln in per_rank)  # all finished


def test_async_scheduling_on_a_mesh_gives_the_single_device_outputs(served):
    """dp4 x tp2 without EPLB schedules async: requests on three ranks read their pending tokens (by their global
    sampled row) and finish their Engram ids on the device, with the single-device engine's greedy tokens."""
    a = served["dp_async"]
    assert a["scheduling"].startswith("async") and len(a["ranks"]) == 3
    assert a["tokens"] == served["ref"]["tokens"]


def test_rearranges_every_interval_with_greedy_outputs_unchanged(served):
    assert served["eplb"] == served["ref"]
    assert served["eplb_steps"] == served["steps"] >= 2 * INTERVAL
    assert served["rearranged_at"] == list(range(INTERVAL, served["steps"] + 1, INTERVAL))
    p = np.array(served["placements"])  # [rearrangements + 1, L, 16 slots]
    assert p.shape[2] == 16 and all(sorted(set(row)) == list(range(8)) for row in p.reshape(-1, 16))
    assert (p[1] != p[0]).any()  # the first rearrangement moved experts: the outputs above ran migrated weights
    assert served["runner_runs_model_leaves"]
    assert served["compiled_after"] == served["compiled_before"]  # migrations compile no new step


def test_metrics_rendered(served):
    lines = [ln for ln in served["metrics"] if ln.startswith("dsv41:eplb_")]

    def value(pattern):
        hits = [float(ln.rsplit(" ", 1)[1]) for ln in lines if re.match(pattern, ln)]
        assert len(hits) == 1, (pattern, lines)
        return hits[0]

    assert value(r"dsv41:eplb_rebalances_total\{") == len(served["rearranged_at"])
    assert value(r"dsv41:eplb_balancedness\{") == pytest.approx(served["balancedness"])
    layers = [ln for ln in lines if ln.startswith("dsv41:eplb_layer_balancedness{")]
    assert len(layers) == np.array(served["placements"]).shape[1]
    assert all(0 < float(ln.rsplit(" ", 1)[1]) <= 1 for ln in layers)
    before, after = served["before_after"]
    assert after > before  # the rearrangement balanced the window it was computed on


def test_eplb_without_expert_parallel_is_refused():
    with pytest.raises(ValueError, match="enable_eplb needs enable_expert_parallel"):
        EngineArgs.of(enable_eplb=True)
    with pytest.raises(ValueError, match="eplb needs expert parallelism"):  # on, but over one device: nothing to do
        Engine(dsv41.random_model("tiny", seed=1), None, EngineArgs.of(enable_eplb=True, enable_expert_parallel=True),
               progress=False)
    with pytest.raises(ValueError, match="eplb_step_interval must be >= 1"):
        EngineArgs.of(enable_eplb=True, eplb_step_interval=0)


def test_server_flags(capsys):
    from serving.server import main, parse_args

    a = parse_args(["--enable-expert-parallel", "-dp", "8", "--enable-eplb", "--eplb-window-size", "10",
                    "--eplb-step-interval", "20", "--eplb-num-redundant-experts", "8"]).engine.eplb
    assert (a.enable_eplb, a.eplb_window_size, a.eplb_step_interval, a.eplb_num_redundant_experts) == (True, 10, 20, 8)
    for argv, message in ((["--enable-eplb"], "argument --enable-eplb, --enable-expert-parallel: enable_eplb needs "
                                              "enable_expert_parallel"),
                          (["--enable-eplb", "--enable-expert-parallel", "--eplb-step-interval", "0"],
                           "argument --eplb-step-interval: eplb_step_interval must be >= 1")):
        with pytest.raises(SystemExit) as exit_:
            main([*argv, "--compilation-cache-dir", ""])
        assert exit_.value.code == 2 and message in capsys.readouterr().err
