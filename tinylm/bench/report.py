"""Running tinylm-bench: the chosen sections in turn, each table printed as it finishes, and the
JSON report."""

from __future__ import annotations

import contextlib
import os
import platform
import time
from collections.abc import Callable
from dataclasses import asdict, replace
from pathlib import Path

import torch

from tinylm.bench.config import SECTIONS, BenchConfig
from tinylm.bench.runs import bench_endtoend, bench_load
from tinylm.bench.sections import (
    Ratio,
    Section,
    bench_attention,
    bench_data,
    bench_generate,
    bench_inspect,
)
from tinylm.bench.train import bench_train
from tinylm.files import write_json_atomic
from tinylm.tables import columns


def machine() -> dict:
    """What the figures were measured on."""
    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    info = {"cpu": cpu, "logical_cpus": os.cpu_count(), "python": platform.python_version(),
            "torch": torch.__version__}
    with contextlib.suppress(ImportError):  # optional: the bench extra
        import transformers

        info["transformers"] = transformers.__version__
    with contextlib.suppress(OSError, AttributeError):
        info["load_average_1m"] = round(os.getloadavg()[0], 2)
    return info


RUNNERS: dict[str, Callable[[BenchConfig], Section]] = {
    "attention": bench_attention, "train": bench_train, "generate": bench_generate,
    "inspect": bench_inspect, "data": bench_data, "load": bench_load, "endtoend": bench_endtoend}


def run_bench(cfg: BenchConfig, print_fn: Callable[[str], None] | None = print) -> dict:
    """Run the chosen sections, printing each table as it finishes; return the report (also
    written to cfg.out, whole or not at all, if set)."""
    show = print_fn or (lambda text: None)
    if cfg.out and Path(cfg.out).is_dir():  # refused before the work, not when writing it
        raise ValueError(f"out={cfg.out} is a directory; name the report file, e.g. "
                         f"out={Path(cfg.out) / 'bench.json'}")
    report = {"machine": {**machine(), "threads": cfg.threads}, "config": asdict(cfg),
              "sections": {}}
    load, cpus = report["machine"].get("load_average_1m"), report["machine"]["logical_cpus"]
    if load is not None and cpus and load > 0.25 * cpus:
        show(f"note: load average {load} on {cpus} CPUs before the run: other work is "
             "running, so timings will be noisy; trust the ratios more than absolute times\n")
    threads = torch.get_num_threads()
    torch.set_num_threads(cfg.threads)
    try:
        for name in SECTIONS if cfg.section == "all" else (cfg.section,):
            torch.manual_seed(cfg.seed)
            start = time.perf_counter()
            section = RUNNERS[name](cfg)
            report["sections"][name] = {**asdict(section),
                                        "seconds": round(time.perf_counter() - start, 1)}
            show(format_section(section))
    finally:
        torch.set_num_threads(threads)
    report["machine"]["load_average_1m_after"] = machine().get("load_average_1m")
    if cfg.out:
        out = Path(cfg.out)
        write_json_atomic(out, report)
        show(f"report: {out} ({report['machine']['cpu']}, {cfg.threads} threads)")
    return report


# figure key -> (column title, format)
FIGURES = {"tokens_per_s": ("tokens/s", "{:,.0f}"), "mfu": ("MFU", "{:.1%}"),
           "gflops": ("GFLOP/s", "{:,.1f}"), "mb_per_s": ("MB/s", "{:.2f}"),
           "wall_s": ("wall s", "{:.1f}"), "startup_s": ("start-up s", "{:.2f}"),
           "step_ms": ("ms/step", "{:.1f}"), "val_loss": ("val loss", "{:.4f}"),
           "to_target_s": ("to val s", "{:.1f}")}


def shown_value(ratio: Ratio) -> str:
    """The ratio to 2 decimals, or to as many more as it takes for the printed number to fall on
    the same side of its target as the value: 1.2486 against 1.25 reads 1.249, not 1.25."""
    for digits in range(2, 7):
        text = f"{ratio.value:.{digits}f}"
        if replace(ratio, value=float(text)).met == ratio.met:
            return text
    return repr(ratio.value)


def format_section(section: Section) -> str:
    """A plain-text table of one section (the min beside the median shows how much load moved
    the timings), then its ratios and notes."""
    keys = [k for k in FIGURES if any(k in r.figures for r in section.rows)]
    header = ["candidate", "median ms", "min ms", *(FIGURES[k][0] for k in keys), "note"]
    rows = [[r.name, f"{r.median_s * 1e3:,.2f}", f"{min(r.times_s) * 1e3:,.2f}",
             *(FIGURES[k][1].format(r.figures[k]) if k in r.figures else "" for k in keys),
             r.note] for r in section.rows]
    lines = [f"== {section.name} ==", *columns(header, rows, "<" + ">" * (len(header) - 2) + "<")]
    for ratio in section.ratios:
        target = "" if ratio.target is None else (
            f"   target {'<=' if ratio.at_most else '>='} {ratio.target:g}: "
            f"{'met' if ratio.met else 'MISSED'}")
        lines.append(f"  {ratio.name}: {shown_value(ratio)}{target}")
    lines += [f"  note: {note}" for note in section.notes]
    return "\n".join(lines) + "\n"
