"""How many intra-op threads torch should use: `threads=auto` fits them to the machine as it is.

PyTorch starts one intra-op thread per physical core and has them spin against each other's
work: a parallel region waits for its slowest thread, so when another program holds one of the
cores every step waits for the thread that shares it. Beside one busy process a 2-thread run kept
about a third of its speed; with 1 thread it kept almost all. So `auto` counts the cores this
process may run on (its affinity) and how many of them other work keeps busy right now, and
takes the idle ones (at least 1). Under torchrun the processes on one machine split the cores.

When other work keeps every core busy, one thread gets only its slice of a shared core (a third
of the machine beside a 2-thread job on 2 cores). A team of threads would get more, but torch's
OpenMP threads spin while they wait for each other, each burning its slice while a teammate
waits for one, and the team collapses (to 6-30% of its quiet speed). A team whose threads
sleep while they wait (OMP_WAIT_POLICY=passive) kept 52-75% of it there on a Zen 3, one thread
39-46% (docs/benchmarks.md). OpenMP reads that setting once, when torch loads, so the training
command decides it before torch is imported:

    wait_passively_if_cores_full()           # before `import torch`; sets OMP_WAIT_POLICY
    choice = choose_threads("auto")          # ThreadChoice(threads=2, reason="auto: ...")
    apply_threads(cfg.threads)               # sets torch's intra-op threads; returns the choice
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from dataclasses import dataclass

from tinylm.config import ConfigError

# how long `auto` watches the cores when the caller has no earlier sample to compare with
MEASURE_SECONDS = 0.2


@dataclass(frozen=True)
class ThreadChoice:
    """The intra-op thread count, and why, in words for the start-up line."""

    threads: int
    reason: str

    def describe(self) -> str:
        return f"{self.threads} thread{'s' if self.threads != 1 else ''} ({self.reason})"


def check_threads_setting(key: str, value) -> None:
    """ConfigError naming `key` unless value is "auto" or an integer >= 1."""
    if value == "auto" or (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
        return
    raise ConfigError(f"{key}={value!r} is not allowed: must be auto or an integer >= 1")


def usable_cpus() -> list[int]:
    """The logical CPUs this process may run on (its affinity; all of them where the OS has no
    affinity call, as on macOS and Windows)."""
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


@dataclass(frozen=True)
class CpuSample:
    """Busy time of some CPUs and of this process at one moment (Linux: /proc/stat)."""

    wall: float
    busy: float  # seconds the CPUs spent running anything
    own: float  # seconds this process ran (all its threads)


def sample_cpus(cpus: list[int]) -> CpuSample | None:
    """Busy seconds of `cpus` so far, from /proc/stat; None where there is no /proc/stat."""
    try:
        with open("/proc/stat", encoding="ascii") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    wanted = {f"cpu{i}" for i in cpus}
    ticks = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    busy = 0
    for line in lines:
        name, *fields = line.split()
        if name in wanted:
            # user nice system idle iowait irq softirq steal ...: idle and iowait are not busy
            values = [int(v) for v in fields[:8]]
            busy += sum(values) - values[3] - values[4]
    times = os.times()
    return CpuSample(time.monotonic(), busy / ticks, times.user + times.system)


@dataclass(frozen=True)
class CpuUse:
    """How many cores other programs and this process kept busy over some time."""

    others: float
    own: float  # 0 where unknown (the load average counts this process among the others)
    how: str  # how it was found, in words

    def fills(self, cpus: int) -> bool:
        """Whether this process and the others together left none of `cpus` cores free."""
        return free_cores(cpus, self.others + self.own) == 0


def cpu_use(cpus: list[int], since: CpuSample | None = None) -> CpuUse | None:
    """The use of `cpus`; None: unknown.

    Linux: the busy time of those CPUs from /proc/stat, less this process's own, over the time
    since `since` (the caller's start-up) or a short wait. Elsewhere: the 1-minute load average.
    """
    start = since or sample_cpus(cpus)
    if start is not None:
        if time.monotonic() - start.wall < MEASURE_SECONDS:
            time.sleep(MEASURE_SECONDS - (time.monotonic() - start.wall))
        end = sample_cpus(cpus)
        wall = end.wall - start.wall
        own = (end.own - start.own) / wall
        others = (end.busy - start.busy) / wall - own
        return CpuUse(max(0.0, others), own, f"over {wall:.1f} s")
    with contextlib.suppress(OSError, AttributeError):
        return CpuUse(os.getloadavg()[0], 0.0, "1-minute load average")
    return None


def busy_cpus(cpus: list[int], since: CpuSample | None = None) -> tuple[float, str] | None:
    """How many of `cpus` other programs keep busy, and how that was found; None: unknown."""
    use = cpu_use(cpus, since)
    if use is None:
        return None
    busy = use.others
    # Where every core was taken, this process's one thread got a slice of a core, and so did
    # each of the others' threads: without this process they would keep busy what they got
    # divided by that slice. A 2-thread job got 1.3 cores beside our 0.7: it asks for ~2.
    if 0 < use.own < 1 and use.fills(len(cpus)):
        busy = use.others / use.own
    return min(busy, float(len(cpus))), use.how


def local_world_size() -> int:
    """How many processes of this job share the machine (torchrun sets LOCAL_WORLD_SIZE)."""
    return max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))


def free_cores(cpus: int, busy: float) -> int:
    """How many of `cpus` cores are free when other work keeps `busy` of them busy."""
    # half a core of other work or more counts as a core taken: a thread there would wait
    return max(0, int(cpus - busy + 0.5))


def waits_passively() -> bool:
    """Whether torch's OpenMP threads sleep while they wait for each other, by the setting
    OpenMP reads when torch loads (OMP_WAIT_POLICY), instead of spinning."""
    return os.environ.get("OMP_WAIT_POLICY", "").strip().lower() == "passive"


def wait_passively_if_cores_full(since: CpuSample | None = None) -> bool:
    """Before torch is imported: when this process and other work keep every usable core busy,
    set OMP_WAIT_POLICY=passive, so that a team of threads can share those cores without
    collapsing. Left alone: a wait policy (or GOMP_SPINCOUNT) the environment already sets, a
    free core, and a process that has imported torch already (too late). Returns
    waits_passively().

    How busy the others keep the cores is measured better later, over the whole start-up
    (choose_threads); beside one busy process on 2 cores that gives 1 thread, and the setting
    then changes nothing. On a quiet machine threads that sleep would cost a small model a fifth
    to a third of its speed (each operation ends waking them), so quiet runs keep spinning."""
    if "OMP_WAIT_POLICY" in os.environ or "GOMP_SPINCOUNT" in os.environ \
            or "torch" in sys.modules:
        return waits_passively()
    cpus = usable_cpus()
    use = cpu_use(cpus, since or start_sample())
    if use is not None and use.fills(len(cpus)):
        os.environ["OMP_WAIT_POLICY"] = "passive"
    return waits_passively()


# what the start-up line adds when a team of threads sleeps while it waits, and how to undo it
PASSIVE_TEAM = ("threads that sleep while they wait: OMP_WAIT_POLICY=passive, slower with cores "
                "free; OMP_WAIT_POLICY=active makes them spin")


def choose_threads(setting: int | str, since: CpuSample | None = None,
                   team_when_full: bool = False) -> ThreadChoice:
    """The thread count for `setting`: a number is taken as is; `auto` takes this process's
    share of its usable cores, less those that other programs keep busy, and at least 1.

    team_when_full (training, whose operations are large enough to share out): when other work
    keeps every core busy and the threads wait passively, the whole share, since the scheduler
    then gives each thread its slice of the busy cores."""
    if setting != "auto":
        threads = int(setting)
        # the policy may have been chosen at start-up (wait_passively_if_cores_full), unasked
        return ThreadChoice(threads, f"set, {PASSIVE_TEAM}"
                            if threads > 1 and waits_passively() else "set")
    cpus = usable_cpus()
    processes = local_world_size()
    share = max(1, len(cpus) // processes)
    why = [f"{len(cpus)} usable core{'s' if len(cpus) != 1 else ''}"]
    if processes > 1:
        why.append(f"{share} each for {processes} processes")
    load = busy_cpus(cpus, since)
    if load is None:
        why.append("load unknown")
        return ThreadChoice(share, "auto: " + ", ".join(why))
    busy, how = load
    free = free_cores(len(cpus), busy)
    threads = max(1, min(share, free))
    why.append(f"{busy:.1f} busy with other work ({how})" if busy >= 0.05 else "idle")
    if team_when_full and share > 1 and free == 0 and waits_passively():
        threads = share
        why.append("every core busy: a share of them, with threads that sleep while they wait")
    elif threads > 1 and waits_passively():
        # OpenMP took the policy when torch loaded, from the environment or from a shorter look
        # at the cores (wait_passively_if_cores_full); with cores free it only slows the team
        why.append(PASSIVE_TEAM)
    return ThreadChoice(threads, "auto: " + ", ".join(why))


def apply_threads(setting: int | str, since: CpuSample | None = None,
                  team_when_full: bool = False) -> ThreadChoice:
    """Choose the intra-op thread count for `setting` (choose_threads) and give it to torch."""
    # the commands import this module before torch, to watch the cores while torch loads
    import torch

    choice = choose_threads(setting, since, team_when_full)
    torch.set_num_threads(choice.threads)
    return choice


def start_sample() -> CpuSample | None:
    """A sample to hand to choose_threads later, so that start-up work doubles as the wait:
    the one taken when this module was first imported (a command's start, before torch is
    imported) if that was recent, else a new one."""
    if _IMPORTED is not None and time.monotonic() - _IMPORTED.wall < RECENT_SECONDS:
        return _IMPORTED
    return sample_cpus(usable_cpus())


# the commands import this module before torch: from here to choose_threads is >1 s to watch
RECENT_SECONDS = 30.0
_IMPORTED = sample_cpus(usable_cpus())
