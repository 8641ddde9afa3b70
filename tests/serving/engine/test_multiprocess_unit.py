"""The server-over-processes mechanism without processes: the step channel over a stand-in for the coordination
service's key-value store (what rank 0 publishes, every other rank reads in order, a bounded window of keys), and
the dead-process watch's decisions (a stale heartbeat, a reported failure, a heartbeat that keeps moving)."""

import pickle
import subprocess
import sys
import threading

import numpy as np
import pytest

from serving.engine import multiprocess
from serving.engine.multiprocess import Execute, ProcessFailed, ProcessWatch, StepChannel, Stop


class FakeStore:
    """The methods of JAX's DistributedRuntimeClient the module uses, over a dict."""

    def __init__(self):
        self.kv, self.cond = {}, threading.Condition()

    def key_value_set_bytes(self, key, value, allow_overwrite=False):
        with self.cond:
            assert allow_overwrite or key not in self.kv, key
            self.kv[key] = value
            self.cond.notify_all()

    def blocking_key_value_get_bytes(self, key, timeout_ms):
        with self.cond:
            if not self.cond.wait_for(lambda: key in self.kv, timeout_ms / 1000):
                raise RuntimeError(f"DEADLINE_EXCEEDED: {key}")
            return self.kv[key]

    def key_value_delete(self, key):
        with self.cond:
            self.kv.pop(key, None)

    def key_value_dir_get_bytes(self, prefix):
        with self.cond:
            return [(k, v) for k, v in self.kv.items() if k.startswith(prefix)]


@pytest.fixture
def store(monkeypatch):
    s = FakeStore()
    monkeypatch.setattr(multiprocess, "_client", lambda: s)
    return s


def test_steps_arrive_in_order_and_old_keys_go(store):
    leader, follower = StepChannel(), StepChannel()
    n = multiprocess.WINDOW + 5
    got, read = [], threading.Semaphore(0)

    def run():
        for _ in range(n + 1):
            got.append(follower.receive())
            read.release()

    reader = threading.Thread(target=run)
    reader.start()
    sizes = []
    for i in range(n):  # the follower keeps up, as the step's collectives make it
        sizes.append(leader.publish(Execute(np.arange(i + 1), reads_prev=i % 2 == 1))[0])
        assert read.acquire(timeout=10)
    leader.publish(Stop("done"))
    reader.join(10)
    assert [int(m.host[-1]) for m in got[:n]] == list(range(n))
    assert [m.reads_prev for m in got[:n]] == [i % 2 == 1 for i in range(n)]
    assert got[-1] == Stop("done")
    assert all(s > 0 for s in sizes)
    steps = [k for k in store.kv if k.startswith(f"{multiprocess.PREFIX}/step/")]
    assert len(steps) == multiprocess.WINDOW  # older steps deleted


def test_a_waiting_follower_keeps_waiting_past_the_poll_timeout(store):
    follower, leader = StepChannel(), StepChannel()
    timer = threading.Timer(1.5, lambda: leader.publish(Stop("late")))  # past one 1 s poll
    timer.start()
    assert follower.receive() == Stop("late")


def _watch(timeout_s=1.0):
    failures = []
    return ProcessWatch(3, timeout_s, failures.append), failures


def test_a_stale_heartbeat_is_a_dead_process(store):
    watch, _ = _watch()
    seen = {1: (b"", 0.0), 2: (b"", 0.0)}
    store.key_value_set_bytes("dsv41/alive/1", b"1", True)
    store.key_value_set_bytes("dsv41/alive/2", b"1", True)
    assert watch._check(store, seen, 0.5) is None  # both beat
    store.key_value_set_bytes("dsv41/alive/1", b"2", True)
    assert watch._check(store, seen, 1.2) is None  # process 2's beat is 0.7 s old
    failure = watch._check(store, seen, 1.6)
    assert isinstance(failure, ProcessFailed) and "process 2 stopped answering" in str(failure)


def test_a_reported_failure_is_named_at_once(store):
    watch, _ = _watch()
    store.key_value_set_bytes("dsv41/failed/1", b"ValueError('bad step')")
    failure = watch._check(store, {1: (b"", 0.0), 2: (b"", 0.0)}, 0.1)
    assert "process 1 failed: ValueError('bad step')" in str(failure)


def test_the_watch_thread_calls_back_once(store, monkeypatch):
    monkeypatch.setattr(multiprocess, "HEARTBEAT_S", 0.02)
    watch, failures = _watch(timeout_s=0.1)
    watch.start()
    for _ in range(200):
        if failures:
            break
        threading.Event().wait(0.02)
    watch.stop()
    assert len(failures) == 1 and "stopped answering" in str(failures[0])


def test_the_launcher_sets_the_process_flags_itself():
    for flag in ("--nnodes", "--node-rank=1", "--dist-init-addr", "--num-cpu-devices"):
        proc = subprocess.run([sys.executable, "-m", "serving.launch", "--", "--model", "tiny", flag, "2"],
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == 2 and f"{flag.split('=')[0]} is the launcher's to set" in proc.stderr


def test_the_launcher_gives_each_process_its_rank_and_one_coordinator():
    from serving.launch import commands

    cmds = commands(3, 2, ["--model", "tiny"])
    ranks = [c[c.index("--node-rank") + 1] for c in cmds]
    addrs = {c[c.index("--dist-init-addr") + 1] for c in cmds}
    assert ranks == ["0", "1", "2"] and len(addrs) == 1
    assert all(c[c.index("--nnodes") + 1] == "3" and c[c.index("--num-cpu-devices") + 1] == "2" for c in cmds)
    assert all(c[-2:] == ["--model", "tiny"] for c in cmds)


def test_processes_with_different_settings_are_refused_naming_the_flag(store):
    ours = {"max_num_seqs": 16, "model": "tiny", "seed": 0}
    store.key_value_set_bytes("dsv41/settings/0", pickle.dumps({**ours, "max_num_seqs": 8}))
    with pytest.raises(ValueError, match=r"--max-num-seqs 16 here, 8 on process 0") as err:
        multiprocess.check_same_settings(ours, rank=1, nnodes=2, timeout_s=1)
    assert "--model" not in str(err.value)
    multiprocess.check_same_settings({**ours, "max_num_seqs": 8}, rank=2, nnodes=3, timeout_s=1)  # same: fine


def test_process_0_compares_every_other_process(store):
    ours = {"max_num_seqs": 16, "model": "tiny"}
    store.key_value_set_bytes("dsv41/settings/1", pickle.dumps(ours))
    store.key_value_set_bytes("dsv41/settings/2", pickle.dumps({**ours, "model": "small"}))
    with pytest.raises(ValueError, match=r"--model 'tiny' here, 'small' on process 2"):
        multiprocess.check_same_settings(ours, rank=0, nnodes=3, timeout_s=1)
