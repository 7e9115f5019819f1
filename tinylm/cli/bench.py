"""tinylm-bench: time tinylm beside torch's nn.MultiheadAttention and a Hugging Face GPT-2.

    tinylm-bench                    # every section: tables on stdout, JSON in runs/bench/
    tinylm-bench section=generate repeats=9 out=generate.json
    (options: conf/bench.yaml; docs/benchmarks.md; the peers: pip install -e ".[bench]")

The sections measure (tinylm.bench.sections, tinylm.bench.train, tinylm.bench.runs); here they are
chosen, their tables printed as each finishes, and the report written.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf

from tinylm.bench.sections import (
    Ratio,
    Section,
    Timing,
    bench_attention,
    bench_data,
    bench_generate,
    bench_inspect,
    machine,
)
from tinylm.bench.runs import bench_endtoend, bench_load, nanogpt_option
from tinylm.bench.train import bench_train
from tinylm.cli.command_line import console_entry, without_hydra
from tinylm.config import integer, one_of, to_dataclass
from tinylm.data import DataConfig
from tinylm.files import write_json_atomic
from tinylm.model import ModelConfig
from tinylm.train.optim import OPTIMIZERS, OptimConfig
from tinylm.tables import columns
from tinylm.tokenizer import TokenizerConfig

SECTIONS = ("attention", "train", "generate", "inspect", "data", "load", "endtoend")


# --------------------------------------------------------------------------------------------
# Configuration: one dataclass per section, the schema of conf/bench.yaml


@dataclass
class AttentionBenchConfig:
    """One attention layer, forward + backward on a (batch_size, seq_len, n_embd) input."""

    batch_size: int = 8
    seq_len: int = 256
    n_head: int = 8
    n_embd: int = 256


@dataclass
class TrainBenchConfig:
    """Training steps on random tokens of length model.block_size."""

    batch_size: int = 16  # as conf/train/default.yaml
    peak_size: int = 2048  # square matmul that measures the machine's FLOP/s
    compile: bool = True  # also each model under torch.compile, bf16 if fast here (~25 s each)


@dataclass
class GenerateBenchConfig:
    """Greedy decoding of batch 1 with the model's shape, its context raised to block_size."""

    block_size: int = 512  # must hold late_position + 1 and prompt_len + new_tokens
    prompt_len: int = 32
    new_tokens: int = 256
    early_position: int = 32  # per-token latency: one cached step after this many tokens
    late_position: int = 480
    latency_steps: int = 20  # decoding steps per timed call of the latency rows


@dataclass
class InspectBenchConfig:
    """Eval forward with every layer's attention weights returned, against without."""

    batch_size: int = 4
    seq_len: int | None = None  # None: model.block_size


@dataclass
class LoadBenchConfig:
    """Training steps of the default run (and batch-1 decoding) quiet and beside other load."""

    batch_size: int = 16  # as conf/train/default.yaml
    steps_per_call: int = 3  # training steps per timed call
    decode_tokens: int = 16  # greedy batch-1 tokens per timed call; 0: no decoding rows
    fixed_threads: int = 2  # what torch takes by itself on 2 cores: the collapse to compare
    settle_s: float = 0.5  # the load runs this long before the measuring processes start
    optim: str = "muon"  # the default run's optimizer (tinylm-train's conf/config.yaml)
    # every condition this many times in turns; each round times ceil(repeats / rounds) calls
    rounds: int = 3

    def __post_init__(self):
        one_of("load.optim", self.optim, OPTIMIZERS)
        integer("load.rounds", self.rounds, least=1)


# nanoGPT's CPU command for shakespeare_char in the shape of conf/experiment/shakespeare_char.yaml
# (its README's, with 20 evaluation batches as ours; train.py runs it in a nanoGPT checkout)
NANOGPT_SHAKESPEARE_CHAR = (
    "config/train_shakespeare_char.py", "--dataset=shakespeare_char", "--device=cpu",
    "--compile=False", "--eval_iters=20", "--log_interval=50", "--block_size=64",
    "--batch_size=12", "--n_layer=4", "--n_head=4", "--n_embd=128", "--max_iters=2000",
    "--lr_decay_iters=2000", "--dropout=0.0")


@dataclass
class EndToEndBenchConfig:
    """`tinylm-train experiment=<experiment>` in a subprocess, with and without the extras,
    and nanoGPT's command beside it where a checkout is given."""

    experiment: str | None = "shakespeare_char"  # None: the default run
    overrides: list[str] = field(default_factory=list)  # more tinylm-train overrides
    target_val: float = 1.89  # time until the val loss is at most this
    # a nanoGPT checkout with its data prepared (git clone https://github.com/karpathy/nanoGPT;
    # python data/shakespeare_char/prepare.py): its train.py runs with nanogpt_args, with this
    # Python, after ours, and the target ratio is against its wall time. None: against reference_s
    nanogpt: str | None = None
    nanogpt_args: list[str] = field(default_factory=lambda: list(NANOGPT_SHAKESPEARE_CHAR))
    reference_s: float | None = 50.3  # without nanogpt: a wall time measured elsewhere
    reference: str = ("nanoGPT's CPU command, same settings, measured on a 2-core Intel Xeon with "
                      "AMX; it holds only against a machine as fast")

    def __post_init__(self):
        if self.nanogpt is None:
            return
        checkout = Path(self.nanogpt).expanduser()
        if not (checkout / "train.py").is_file():
            raise ValueError(f"endtoend.nanogpt={self.nanogpt}: no nanoGPT checkout there (no "
                             "train.py); clone one with git clone "
                             "https://github.com/karpathy/nanoGPT")
        dataset = nanogpt_option(self.nanogpt_args, "dataset")
        if dataset and not (checkout / "data" / dataset / "train.bin").is_file():
            raise ValueError(f"endtoend.nanogpt={self.nanogpt}: nanoGPT's {dataset} data is not "
                             f"prepared there (no data/{dataset}/train.bin); run python "
                             f"data/{dataset}/prepare.py in {checkout}")


@dataclass
class BenchConfig:
    """Options of tinylm-bench; the schema of conf/bench.yaml (defaults: here only)."""

    section: str = "all"  # all, or one of SECTIONS
    threads: int = 2  # torch threads for every candidate (restored afterwards)
    repeats: int = 5  # timed calls per candidate; the median is reported
    warmup: int = 2  # untimed calls per candidate first
    seed: int = 0
    out: str | None = None  # where the JSON report goes; None: nowhere
    model: ModelConfig = field(default_factory=lambda: ModelConfig(vocab_size=4096))
    optim: OptimConfig = field(default_factory=OptimConfig)
    data: DataConfig = field(default_factory=DataConfig)
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    attention: AttentionBenchConfig = field(default_factory=AttentionBenchConfig)
    train: TrainBenchConfig = field(default_factory=TrainBenchConfig)
    generate: GenerateBenchConfig = field(default_factory=GenerateBenchConfig)
    inspect: InspectBenchConfig = field(default_factory=InspectBenchConfig)
    load: LoadBenchConfig = field(default_factory=LoadBenchConfig)
    endtoend: EndToEndBenchConfig = field(default_factory=EndToEndBenchConfig)

    def __post_init__(self):
        one_of("section", self.section, ("all", *SECTIONS))
        for key in ("threads", "repeats"):
            integer(key, getattr(self, key), least=1)
        integer("warmup", self.warmup, least=0)
        if self.model.vocab_size is None:
            raise ValueError("model.vocab_size=None is not allowed here: the benchmark builds "
                             "no tokenizer to take it from; set a number")
        g = self.generate
        if g.late_position + 1 > g.block_size or g.prompt_len + g.new_tokens > g.block_size:
            raise ValueError(f"generate.block_size={g.block_size} is too small: it must hold "
                             "generate.late_position + 1 and generate.prompt_len + "
                             "generate.new_tokens tokens")


PART_CONFIGS = {"model": ModelConfig, "optim": OptimConfig, "data": DataConfig,
                "tokenizer": TokenizerConfig, "attention": AttentionBenchConfig,
                "train": TrainBenchConfig, "generate": GenerateBenchConfig,
                "inspect": InspectBenchConfig, "load": LoadBenchConfig,
                "endtoend": EndToEndBenchConfig}


def bench_config(values: dict) -> BenchConfig:
    """BenchConfig from a nested mapping (the composed conf/bench.yaml), every part checked."""
    values = dict(values)
    for key, cls in PART_CONFIGS.items():
        if key in values:
            values[key] = to_dataclass(cls, values[key], key)
    return to_dataclass(BenchConfig, values, "bench")


# --------------------------------------------------------------------------------------------
# Running and reporting


def run_bench(cfg: BenchConfig, print_fn: Callable[[str], None] | None = print) -> dict:
    """Run the chosen sections, printing each table as it finishes; return the report."""
    timing = Timing(cfg.repeats, cfg.warmup)
    runners = {
        "attention": lambda: bench_attention(cfg.attention, timing),
        "train": lambda: bench_train(cfg.model, cfg.optim, cfg.train, timing),
        "generate": lambda: bench_generate(cfg.model, cfg.generate, timing),
        "inspect": lambda: bench_inspect(cfg.model, cfg.inspect, timing),
        "data": lambda: bench_data(cfg.data, cfg.tokenizer, timing),
        "load": lambda: bench_load(cfg.model, cfg.optim, cfg.load, timing),
        "endtoend": lambda: bench_endtoend(cfg.endtoend),
    }
    report = {"machine": {**machine(), "threads": cfg.threads}, "config": asdict(cfg),
              "sections": {}}
    load, cpus = report["machine"].get("load_average_1m"), report["machine"]["logical_cpus"]
    if print_fn is not None and load is not None and cpus and load > 0.25 * cpus:
        print_fn(f"note: load average {load} on {cpus} CPUs before the run: other work is "
                 "running, so timings will be noisy; trust the ratios more than absolute times\n")
    threads = torch.get_num_threads()
    torch.set_num_threads(cfg.threads)
    try:
        for name in SECTIONS if cfg.section == "all" else (cfg.section,):
            torch.manual_seed(cfg.seed)
            start = time.perf_counter()
            section = runners[name]()
            report["sections"][name] = {**section.to_dict(),
                                        "seconds": round(time.perf_counter() - start, 1)}
            if print_fn is not None:
                print_fn(format_section(section))
    finally:
        torch.set_num_threads(threads)
    report["machine"]["load_average_1m_after"] = machine().get("load_average_1m")
    if cfg.out:
        out = Path(cfg.out)
        write_json_atomic(out, report)
        if print_fn is not None:
            print_fn(f"report: {out} ({report['machine']['cpu']}, {cfg.threads} threads)")
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
    """A plain-text table of one section, then its ratios.

    Figures derive from the median; the min beside it shows how much the load moved the timings.
    """
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


def bench_config_of(cfg: DictConfig) -> BenchConfig:
    """BenchConfig from the composed config: every value checked."""
    return bench_config(OmegaConf.to_container(without_hydra(cfg), resolve=True))


main = console_entry("tinylm-bench", "bench", bench_config_of, run_bench,
                     errors=(ValueError, FileNotFoundError, ModuleNotFoundError))


if __name__ == "__main__":
    main()
