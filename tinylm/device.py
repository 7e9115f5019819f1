"""Where a command computes: the device (CUDA when present, else the CPU) and, on the CPU, how
many intra-op threads torch uses: a number, or `auto`, the usable cores (this process's affinity)
that other work leaves idle, at least 1, since a parallel region waits for its slowest thread.
torchrun's processes on one machine split the cores."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

import psutil
import torch

from tinylm.config import bad

MEASURE_SECONDS = 0.2  # how long `auto` watches the cores at least


def resolve_device(name: str = "auto") -> torch.device:
    """'auto' -> cuda if available else cpu; otherwise the named device, checked to exist."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError as err:
        raise ValueError(f"device={name!r} is not a device; allowed: auto, cpu, cuda, "
                         "cuda:N, mps") from err
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device={name!r} was asked for but CUDA is not available here; "
                         "use device=auto or device=cpu")
    return device


def has_fast_bf16(device: torch.device) -> bool:
    """Whether `device` multiplies bf16 in hardware (CUDA with bf16, CPUs with AVX512-BF16 or
    AMX); elsewhere PyTorch emulates bf16, many times slower than fp32."""
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    if device.type == "cpu":
        cpu = torch.cpu
        return getattr(cpu, "_is_avx512_bf16_supported", lambda: False)() or \
            getattr(cpu, "_is_amx_tile_supported", lambda: False)()
    return False


# ------------------------------------------------------------------------------- threads


@dataclass(frozen=True)
class ThreadChoice:
    """The intra-op thread count, and why, in words for the start-up line."""

    threads: int
    reason: str

    def describe(self) -> str:
        return f"{self.threads} thread{'s' if self.threads != 1 else ''} ({self.reason})"

    def suffix_on(self, device) -> str:
        """", 2 threads (why)" after the device in a start-up line; nothing off the CPU."""
        return f", {self.describe()}" if device.type == "cpu" else ""


def check_threads_setting(key: str, value) -> None:
    """ConfigError naming `key` unless value is "auto" or an integer >= 1."""
    if value != "auto" and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
        raise bad(key, value, "must be auto or an integer >= 1")


def usable_cpus() -> list[int]:
    """The logical CPUs this process may run on (all where psutil has no affinity call: macOS)."""
    process = psutil.Process()
    if hasattr(process, "cpu_affinity"):
        return sorted(process.cpu_affinity())
    return list(range(psutil.cpu_count() or 1))


@dataclass(frozen=True)
class CpuSample:
    """Busy time of some CPUs and of this process at one moment."""

    wall: float
    busy: float  # seconds the CPUs spent running anything
    own: float  # seconds this process ran (all its threads)


# Not busy: idle and waiting for I/O; Linux's guest times are already counted in user and nice.
NOT_BUSY = ("idle", "iowait", "guest", "guest_nice")


def sample_cpus(cpus: list[int]) -> CpuSample | None:
    """Busy seconds of `cpus` so far; None where the per-CPU times cannot be read."""
    try:
        per_cpu = psutil.cpu_times(percpu=True)  # its fields differ by OS
        busy = sum(seconds for i in cpus for name, seconds in per_cpu[i]._asdict().items()
                   if name not in NOT_BUSY)
    except (OSError, IndexError):  # no /proc/stat in a sandbox; an offline CPU shifts the list
        return None
    times = os.times()
    return CpuSample(time.monotonic(), busy, times.user + times.system)


def start_sample() -> CpuSample | None:
    """The usable cores now, for choose_threads to compare with later: the caller's own work
    meanwhile (a start-up, a stretch of training) doubles as the time they are watched."""
    return sample_cpus(usable_cpus())


def busy_cpus(cpus: list[int], since: CpuSample | None = None) -> tuple[float, str] | None:
    """How many of `cpus` other programs kept busy since `since` (or over a short wait), and
    how that was found; None: unknown."""
    start = since or sample_cpus(cpus)
    if start is None:
        return None
    time.sleep(max(0.0, MEASURE_SECONDS - (time.monotonic() - start.wall)))
    end = sample_cpus(cpus)
    wall = end.wall - start.wall
    others = (end.busy - start.busy - (end.own - start.own)) / wall
    return min(max(0.0, others), float(len(cpus))), f"over {wall:.1f} s"


def choose_threads(setting: int | str, since: CpuSample | None = None) -> ThreadChoice:
    """A number as it is; `auto` this process's share of its usable cores, less those other
    programs keep busy, at least 1."""
    if setting != "auto":
        return ThreadChoice(int(setting), "set")
    cpus = usable_cpus()
    processes = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))  # torchrun's, on this machine
    share = max(1, len(cpus) // processes)
    why = [f"{len(cpus)} usable core{'s' if len(cpus) != 1 else ''}"]
    if processes > 1:
        why.append(f"{share} each for {processes} processes")
    load = busy_cpus(cpus, since)
    if load is None:
        return ThreadChoice(share, "auto: " + ", ".join([*why, "load unknown"]))
    busy, how = load
    why.append(f"{busy:.1f} busy with other work ({how})" if busy >= 0.05 else "idle")
    # half a core of other work or more counts as a core taken: a thread there would wait
    threads = max(1, min(share, int(len(cpus) - busy + 0.5)))
    return ThreadChoice(threads, "auto: " + ", ".join(why))


def apply_threads(setting: int | str, since: CpuSample | None = None) -> ThreadChoice:
    """choose_threads, given to torch."""
    choice = choose_threads(setting, since)
    torch.set_num_threads(choice.threads)
    return choice
