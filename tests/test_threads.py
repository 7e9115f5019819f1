"""threads=auto: the thread count follows the usable cores and how busy they are."""

import os
import subprocess
import sys

import pytest
import torch

import tinylm.train.threads
from tinylm.cli.generate import GenerateConfig
from tinylm.config import ConfigError
from tinylm.train.threads import (
    CpuUse,
    apply_threads,
    busy_cpus,
    choose_threads,
    usable_cpus,
    wait_passively_if_cores_full,
)
from tinylm.train.run_config import TrainConfig


@pytest.fixture
def machine(monkeypatch):
    """Set the affinity (a set of CPU ids) and the busy cores the next choice sees."""
    def set_machine(cpus, busy):
        monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(cpus), raising=False)
        monkeypatch.setattr(tinylm.train.threads, "busy_cpus",
                            lambda cpus, since=None: None if busy is None else (busy, "test"))
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    return set_machine


def test_auto_takes_every_usable_core_of_an_idle_machine(machine):
    machine(range(4), 0.0)
    choice = choose_threads("auto")
    assert choice.threads == 4
    assert choice.reason == "auto: 4 usable cores, idle"


@pytest.mark.parametrize(("busy", "threads"), [(0.3, 2), (0.6, 1), (1.0, 1), (2.0, 1)])
def test_auto_leaves_the_cores_other_work_keeps_busy_and_keeps_at_least_one(
        machine, busy, threads):
    machine({0, 1}, busy)
    choice = choose_threads("auto")
    assert choice.threads == threads
    assert f"{busy:.1f} busy with other work" in choice.reason


def test_auto_counts_only_the_cores_of_the_affinity_mask(machine, monkeypatch):
    monkeypatch.setattr(os, "cpu_count", lambda: 64)
    machine({3, 5}, 0.0)
    assert choose_threads("auto").threads == 2


def test_without_an_affinity_call_every_cpu_is_usable(machine, monkeypatch):
    machine(range(2), 0.0)
    monkeypatch.delattr(os, "sched_getaffinity")  # macOS, Windows
    monkeypatch.setattr(os, "cpu_count", lambda: 6)
    assert usable_cpus() == list(range(6))
    assert choose_threads("auto").threads == 6


def test_under_torchrun_each_process_takes_its_share(machine, monkeypatch):
    machine(range(8), 0.5)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    choice = choose_threads("auto")
    assert choice.threads == 4
    assert "4 each for 2 processes" in choice.reason


def test_unknown_load_takes_the_share(machine):
    machine(range(2), None)
    assert choose_threads("auto") == tinylm.train.threads.ThreadChoice(2, "auto: 2 usable cores, "
                                                                 "load unknown")


def test_an_explicit_number_wins_over_the_load(machine):
    machine(range(2), 2.0)
    assert choose_threads(3).threads == 3 and choose_threads(3).reason == "set"


@pytest.mark.parametrize("policy", ["passive", "PASSIVE"])
def test_training_beside_work_that_fills_every_core_takes_a_team_that_sleeps_while_waiting(
        machine, monkeypatch, policy):
    machine(range(2), 1.8)
    monkeypatch.setenv("OMP_WAIT_POLICY", policy)
    choice = choose_threads("auto", team_when_full=True)
    assert choice.threads == 2
    assert choice.reason.endswith("every core busy: a share of them, with threads that sleep "
                                  "while they wait")


def set_wait_policy(monkeypatch, policy):
    """OMP_WAIT_POLICY as the environment would give it; None: not set."""
    if policy is None:
        monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    else:
        monkeypatch.setenv("OMP_WAIT_POLICY", policy)


@pytest.mark.parametrize(("busy", "policy", "team_when_full", "threads"), [
    (1.8, "active", True, 1),  # spinning threads would collapse
    (1.8, None, True, 1),  # OpenMP's default spins
    (1.8, "passive", False, 1),  # decoding: one token's operations are too small to share
    (1.0, "passive", True, 1),  # a free core: one thread there runs alone
])
def test_otherwise_auto_keeps_one_thread_beside_work_that_fills_the_cores(
        machine, monkeypatch, busy, policy, team_when_full, threads):
    machine(range(2), busy)
    set_wait_policy(monkeypatch, policy)
    choice = choose_threads("auto", team_when_full=team_when_full)
    assert choice.threads == threads and "every core busy" not in choice.reason


@pytest.mark.parametrize(("busy", "policy", "said"), [
    (0.0, "passive", True),  # the cores looked full as torch loaded, and are free now
    (0.0, "active", False),
    (0.0, None, False),
    (1.0, "passive", False),  # one thread: no team to wait for
])
def test_a_team_with_cores_free_says_when_its_threads_sleep_while_they_wait(
        machine, monkeypatch, busy, policy, said):
    machine(range(2), busy)
    set_wait_policy(monkeypatch, policy)
    choice = choose_threads("auto", team_when_full=True)
    assert choice.threads == (2 if busy == 0 else 1)
    assert ("sleep while they wait: OMP_WAIT_POLICY=passive, slower with cores free; "
            "OMP_WAIT_POLICY=active makes them spin" in choice.reason) is said


@pytest.mark.parametrize(("threads", "policy", "reason"), [
    (2, "passive", "set, " + tinylm.train.threads.PASSIVE_TEAM),  # chosen at start-up, unasked
    (2, None, "set"),
    (1, "passive", "set"),  # one thread: no team to wait for
])
def test_an_explicit_count_says_when_its_threads_sleep_while_they_wait(
        machine, monkeypatch, threads, policy, reason):
    machine(range(2), 0.0)
    set_wait_policy(monkeypatch, policy)
    assert choose_threads(threads) == tinylm.train.threads.ThreadChoice(threads, reason)


def use_of_cores(monkeypatch, cpus, use):
    """The affinity and the CpuUse that busy_cpus and wait_passively_if_cores_full see."""
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(cpus), raising=False)
    monkeypatch.setattr(tinylm.train.threads, "cpu_use", lambda cpus, since=None: use)


@pytest.mark.parametrize(("others", "own", "busy"), [
    (1.3, 0.7, 1.3 / 0.7),  # our one thread got a slice: the 2-thread job asks for ~2 cores
    (1.0, 1.0, 1.0),  # a busy loop on the other core: no one waited
    (0.2, 0.9, 0.2),  # a free core: the others got what they asked for
    (1.2, 1.6, 1.2),  # our start-up ran on more than one thread: no slice to divide by
    (1.7, 0.0, 1.7),  # the load average (own unknown)
])
def test_busy_cpus_counts_what_the_others_would_use_without_this_process(
        monkeypatch, others, own, busy):
    use_of_cores(monkeypatch, range(2), CpuUse(others, own, "test"))
    assert busy_cpus(usable_cpus()) == (pytest.approx(busy), "test")


@pytest.fixture
def before_torch(monkeypatch):
    """As in a command before it imports torch: no wait setting, torch not in sys.modules."""
    for key in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT"):
        # set first, so that monkeypatch also takes away what the test's code sets there
        monkeypatch.setenv(key, "")
        monkeypatch.delenv(key)
    monkeypatch.delitem(sys.modules, "torch")


@pytest.mark.parametrize(("others", "own", "passive"), [
    (1.3, 0.7, True), (1.0, 1.0, True), (1.0, 0.7, True), (0.2, 1.0, False), (0.0, 0.9, False)])
def test_the_threads_wait_passively_when_every_core_is_busy_before_torch_loads(
        monkeypatch, before_torch, others, own, passive):
    use_of_cores(monkeypatch, range(2), CpuUse(others, own, "test"))
    assert wait_passively_if_cores_full() is passive
    assert os.environ.get("OMP_WAIT_POLICY") == ("passive" if passive else None)


@pytest.mark.parametrize("setting", [("OMP_WAIT_POLICY", "active"), ("GOMP_SPINCOUNT", "1000")])
def test_a_wait_setting_of_the_environment_is_left_as_it_is(monkeypatch, before_torch, setting):
    use_of_cores(monkeypatch, range(2), CpuUse(2.0, 1.0, "test"))
    monkeypatch.setenv(*setting)
    assert wait_passively_if_cores_full() is False
    assert os.environ.get("OMP_WAIT_POLICY") == ("active" if setting[1] == "active" else None)


def test_once_torch_has_loaded_the_wait_policy_is_not_changed(monkeypatch):
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    use_of_cores(monkeypatch, range(2), CpuUse(2.0, 1.0, "test"))
    assert "torch" in sys.modules and wait_passively_if_cores_full() is False
    assert "OMP_WAIT_POLICY" not in os.environ


def test_tinylm_train_decides_the_wait_policy_before_it_imports_torch():
    script = (
        "import sys\nimport tinylm.train.threads\ncalls = []\n"
        "tinylm.train.threads.wait_passively_if_cores_full = "
        "lambda since=None: calls.append('torch' in sys.modules)\n"
        "from tinylm.cli.train import main\nsys.argv = ['tinylm-train', '--cfg', 'job']\n"
        "main()\nprint('calls', calls, 'torch' in sys.modules)\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          check=True)
    # called once, before torch was imported, and torch was imported after it
    assert done.stdout.splitlines()[-1] == "calls [False] True"


def test_apply_threads_sets_torchs_intra_op_threads(machine):
    machine(range(2), 1.0)
    before = torch.get_num_threads()
    try:
        assert apply_threads("auto").threads == 1 and torch.get_num_threads() == 1
        assert apply_threads(2).threads == 2 and torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_a_busy_process_is_measured_as_one_busy_core():
    cpus = usable_cpus()
    busy_loop = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        # let it start, then watch the cores (Linux: /proc/stat, elsewhere the load average)
        subprocess.run([sys.executable, "-c", "import time; time.sleep(0.3)"], check=True)
        busy, how = busy_cpus(cpus)
    finally:
        busy_loop.kill()
        busy_loop.wait()
    if sys.platform.startswith("linux"):
        assert 0.7 <= busy <= len(cpus) and how.startswith("over 0.")
    else:
        assert how == "1-minute load average" and busy >= 0


@pytest.mark.parametrize("value", [0, -2, "many", 1.5, True])
def test_bad_thread_settings_are_refused_naming_the_key(value):
    with pytest.raises(ConfigError, match=r"train\.threads=.* is not allowed: must be auto or "
                                          "an integer >= 1"):
        TrainConfig(threads=value)
    with pytest.raises(ConfigError, match=r"^threads=.* is not allowed"):
        GenerateConfig(threads=value)
