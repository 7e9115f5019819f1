"""threads=auto: the thread count follows the usable cores and how busy they are; it is chosen
beside the device (tinylm/device.py) for every command."""

import collections
import importlib.util
import os
import subprocess
import sys
import time

import psutil
import pytest
import torch
from helpers import save_run

import tinylm.device
from tinylm.cli.generate import GenerateConfig
from tinylm.cli.loading import load_for_command
from tinylm.config import ConfigError
from tinylm.device import (
    CpuSample,
    apply_threads,
    busy_cpus,
    choose_threads,
    sample_cpus,
    usable_cpus,
)
from tinylm.train.run_config import TrainConfig


@pytest.fixture
def machine(monkeypatch):
    """Set the affinity (a set of CPU ids) and the busy cores the next choice sees."""
    def set_machine(cpus, busy):
        monkeypatch.setattr(psutil.Process, "cpu_affinity", lambda self: list(cpus),
                            raising=False)
        monkeypatch.setattr(tinylm.device, "busy_cpus",
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
    monkeypatch.setattr(psutil, "cpu_count", lambda: 64)
    machine({3, 5}, 0.0)
    assert choose_threads("auto").threads == 2


def test_without_an_affinity_call_every_cpu_is_usable(machine, monkeypatch):
    machine(range(2), 0.0)
    monkeypatch.delattr(psutil.Process, "cpu_affinity")  # macOS
    monkeypatch.setattr(psutil, "cpu_count", lambda: 6)
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
    assert choose_threads("auto") == tinylm.device.ThreadChoice(2, "auto: 2 usable cores, "
                                                                 "load unknown")


def test_an_explicit_number_wins_over_the_load(machine):
    machine(range(2), 2.0)
    assert choose_threads(3).threads == 3 and choose_threads(3).reason == "set"


@pytest.mark.parametrize(("busy", "own", "others"), [
    (3.0, 1.0, 1.0),  # 1.5 cores busy over the 2 s, 0.5 of them this process
    (1.0, 1.5, 0.0),  # ticks are coarse: never below 0
    (9.0, 0.0, 2.0),  # never more than the usable cores
])
def test_busy_cpus_counts_the_cores_busy_time_less_this_processs_own(
        monkeypatch, busy, own, others):
    start = CpuSample(time.monotonic() - 2.0, 10.0, 5.0)
    end = CpuSample(start.wall + 2.0, 10.0 + busy, 5.0 + own)
    monkeypatch.setattr(tinylm.device, "sample_cpus", lambda cpus: end)
    assert busy_cpus([0, 1], since=start) == (pytest.approx(others), "over 2.0 s")


def test_a_cpus_busy_time_is_all_but_idle_iowait_and_guest(monkeypatch):
    times = collections.namedtuple("times", "user nice system idle iowait irq softirq steal "
                                            "guest guest_nice")
    per_cpu = [times(1.0, 2.0, 3.0, 100.0, 50.0, 0.5, 0.5, 1.0, 2.0, 1.0)] * 2  # Linux's fields
    monkeypatch.setattr(psutil, "cpu_times", lambda percpu: per_cpu)
    assert sample_cpus([0, 1]).busy == pytest.approx(16.0)


def test_unreadable_cpu_times_leave_the_load_unknown(monkeypatch):
    def no_proc(percpu):
        raise FileNotFoundError("/proc/stat")

    monkeypatch.setattr(psutil, "cpu_times", no_proc)
    assert busy_cpus([0, 1]) is None


def test_importing_samples_nothing_and_start_sample_samples_now(monkeypatch):
    sampled = []
    real_cpu_times = psutil.cpu_times

    def watched_cpu_times(*args, **kwargs):
        sampled.append(kwargs)
        return real_cpu_times(*args, **kwargs)

    monkeypatch.setattr(psutil, "cpu_times", watched_cpu_times)
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    # the module's code run again as a fresh import would run it, under another name
    spec = importlib.util.spec_from_file_location("fresh_threads", tinylm.device.__file__)
    fresh = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "fresh_threads", fresh)  # where dataclasses look it up
    spec.loader.exec_module(fresh)
    assert not sampled and "OMP_WAIT_POLICY" not in os.environ
    sample = fresh.start_sample()
    assert sampled == [{"percpu": True}] and time.monotonic() - sample.wall < 1.0


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
        # let it start, then watch the cores
        subprocess.run([sys.executable, "-c", "import time; time.sleep(0.3)"], check=True)
        busy, how = busy_cpus(cpus)
    finally:
        busy_loop.kill()
        busy_loop.wait()
    assert 0.7 <= busy <= len(cpus) and how.startswith("over 0.")


@pytest.mark.parametrize("value", [0, -2, "many", 1.5, True])
def test_bad_thread_settings_are_refused_naming_the_key(value):
    with pytest.raises(ConfigError, match=r"train\.threads=.* is not allowed: must be auto or "
                                          "an integer >= 1"):
        TrainConfig(threads=value)
    with pytest.raises(ConfigError, match=r"^threads=.* is not allowed"):
        GenerateConfig(threads=value)


def test_every_command_that_loads_a_checkpoint_chooses_its_threads_beside_the_device(
        machine, model, bpe, tmp_path):
    machine(range(2), 1.0)
    run_dir = save_run(tmp_path / "run", model, bpe)
    before = torch.get_num_threads()
    try:
        loaded = load_for_command(str(run_dir))  # tinylm-export's call: no threads= of its own
        assert (loaded.threads.threads, torch.get_num_threads()) == (1, 1)
        assert loaded.line("a model").endswith(
            "(a model) on cpu, 1 thread (auto: 2 usable cores, 1.0 busy with other work (test))")
        loaded = load_for_command(str(run_dir), threads=2)  # generate, probe, explain: threads=
        assert (loaded.threads.threads, torch.get_num_threads()) == (2, 2)
    finally:
        torch.set_num_threads(before)
