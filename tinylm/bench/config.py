"""The options of tinylm-bench: one dataclass per section, the schema of conf/bench.yaml."""

from __future__ import annotations

from dataclasses import dataclass, field, is_dataclass
from pathlib import Path

from tinylm.config import at_least, check, choice, to_dataclass
from tinylm.data import DataConfig
from tinylm.model import ModelConfig
from tinylm.tokenizer import TokenizerConfig
from tinylm.train.optim import OPTIMIZERS, OptimConfig

SECTIONS = ("attention", "train", "generate", "inspect", "data", "load", "endtoend")


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
    settle_s: float = 0.5  # the load runs this long before the measuring process starts
    optim: str = "muon"  # the default run's optimizer (tinylm-train's conf/config.yaml)
    rounds: int = 3  # every condition in turns, each round ceil(repeats / rounds) calls

    def __post_init__(self):
        check(self, "load", optim=choice(*OPTIMIZERS), rounds=at_least(1))


# nanoGPT's README command for shakespeare_char on the CPU, with 20 evaluation batches as ours
NANOGPT_SHAKESPEARE_CHAR = (
    "config/train_shakespeare_char.py", "--dataset=shakespeare_char", "--device=cpu",
    "--compile=False", "--eval_iters=20", "--log_interval=50", "--block_size=64",
    "--batch_size=12", "--n_layer=4", "--n_head=4", "--n_embd=128", "--max_iters=2000",
    "--lr_decay_iters=2000", "--dropout=0.0")


def nanogpt_option(args: list[str], name: str, default: str | None = None) -> str | None:
    """The value of `--name=value` in nanoGPT's arguments, or `default`."""
    return next((arg.split("=", 1)[1] for arg in args if arg.startswith(f"--{name}=")), default)


@dataclass
class EndToEndBenchConfig:
    """`tinylm-train experiment=<experiment>`, with and without the evaluation extras, and
    nanoGPT's command where a checkout is given."""

    experiment: str | None = "shakespeare_char"  # None: the default run
    overrides: list[str] = field(default_factory=list)  # more tinylm-train overrides
    target_val: float = 1.89  # time until the val loss is at most this
    # a nanoGPT checkout with its data prepared (docs/benchmarks.md): its train.py runs with
    # nanogpt_args, with this Python, after ours; the target is against its wall time. None: none
    nanogpt: str | None = None
    nanogpt_args: list[str] = field(default_factory=lambda: list(NANOGPT_SHAKESPEARE_CHAR))

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
    """Options of tinylm-bench: conf/bench.yaml's schema and defaults."""

    section: str = "all"  # all, or one of SECTIONS
    threads: int = 2  # torch threads for every candidate (restored afterwards)
    repeats: int = 5  # timed calls per candidate; the median is reported
    warmup: int = 2  # untimed calls per candidate first
    seed: int = 0  # for the random inputs and weights
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
        check(self, section=choice("all", *SECTIONS), threads=at_least(1), repeats=at_least(1),
              warmup=at_least(0))
        if self.model.vocab_size is None:
            raise ValueError("model.vocab_size=None is not allowed here: the benchmark builds "
                             "no tokenizer to take it from; set a number")
        g = self.generate
        if g.late_position + 1 > g.block_size or g.prompt_len + g.new_tokens > g.block_size:
            raise ValueError(f"generate.block_size={g.block_size} is too small: it must hold "
                             "generate.late_position + 1 and generate.prompt_len + "
                             "generate.new_tokens tokens")


def bench_config(values: dict) -> BenchConfig:
    """BenchConfig from a nested mapping (the composed conf/bench.yaml), every part checked."""
    defaults = BenchConfig()
    parts = {key: to_dataclass(type(getattr(defaults, key)), value, key)
             for key, value in values.items() if is_dataclass(getattr(defaults, key, None))}
    return to_dataclass(BenchConfig, {**values, **parts}, "bench")
