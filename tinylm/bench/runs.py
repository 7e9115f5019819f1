"""The sections that run whole programs: training beside other load (load), and a training run
end to end as a user starts it, beside nanoGPT's command where a checkout is given (endtoend)."""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from tinylm.bench.config import BenchConfig, nanogpt_option
from tinylm.bench.sections import Ratio, Row, Section, time_turns
from tinylm.bench.train import training_step
from tinylm.device import apply_threads, has_fast_bf16
from tinylm.generate import generate
from tinylm.model import ModelConfig, TinyLM
from tinylm.train.optim import OptimConfig


def default_environment() -> dict[str, str]:
    """This process's environment without its OpenMP settings: torch's own defaults."""
    return {k: v for k, v in os.environ.items() if not k.startswith(("OMP_", "GOMP_"))}


def run_python(args: list[str], command: str, env: dict[str, str] | None = None,
               cwd: Path | None = None) -> tuple[list[tuple[float, str]], float]:
    """`python args`, unbuffered: each line it prints with the seconds from the command to its
    arrival, and its wall time. Raises naming `command` and its last line if it fails."""
    env = {**(os.environ if env is None else env), "PYTHONUNBUFFERED": "1"}
    with tempfile.TemporaryFile("w+") as errors:
        start = time.time()
        process = subprocess.Popen([sys.executable, *args], cwd=cwd, env=env, text=True,
                                   stdout=subprocess.PIPE, stderr=errors)
        lines = [(time.time() - start, line.rstrip("\n")) for line in process.stdout]
        wall = time.time() - start
        if process.wait() != 0:
            errors.seek(0)
            said = [line for _, line in lines] + errors.read().splitlines()
            last = next((line.strip() for line in reversed(said) if line.strip()), "?")
            raise RuntimeError(f"{command} failed (exit {process.returncode}): {last}")
    return lines, wall


# ---------------------------------------------------------------------------------- load

# the other load: a plain busy loop, and a PyTorch job with 2 intra-op threads
COMPETITORS = {
    "one busy process": "while True: pass",
    "a 2-thread PyTorch job": (
        "import torch\ntorch.set_num_threads(2)\na = torch.randn(256, 256)\n"
        "print('ready', flush=True)\nwhile True:\n    a @ a\n"),
}

# each condition is timed in a new process, whose `auto` watches the cores over its start-up
LOAD_WORKER = (
    "import json, sys\nfrom tinylm.device import start_sample\nsince = start_sample()\n"
    "from tinylm.bench.runs import load_worker\n"
    "print(json.dumps(load_worker(json.loads(sys.argv[1]), since)))\n")


@contextlib.contextmanager
def competitor(code: str) -> Iterator[subprocess.Popen]:
    """`code` running in another Python process for the block (after its 'ready' line, if any)."""
    env = {**default_environment(), "OMP_NUM_THREADS": "2"}  # the job's own choice, not auto's
    process = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE,
                               stderr=subprocess.DEVNULL, text=True, env=env)
    try:
        if "ready" in code:
            process.stdout.readline()
        yield process
    finally:
        process.kill()
        process.wait()


def load_worker(spec: dict, since=None) -> dict:
    """In LOAD_WORKER's process: the seconds of every timed call of training steps (and
    decoding) with the threads `auto` chooses (watching the cores since `since`), with
    spec["fixed_threads"] and (spec["quiet"]) with 1; and what auto chose and why."""
    model_cfg, B = ModelConfig(**spec["model"]), spec["batch_size"]
    x = torch.randint(0, model_cfg.vocab_size, (B, model_cfg.block_size))
    step = training_step(TinyLM(model_cfg), OptimConfig(**spec["optim"]), x, x.roll(-1, 1),
                         spec["precision"])
    decoder = TinyLM(replace(model_cfg, dropout=0.0)).eval()
    prompt = torch.randint(0, model_cfg.vocab_size, (1, 8))
    auto = apply_threads("auto", since)
    threads = {"auto": auto.threads, f"{spec['fixed_threads']} threads": spec["fixed_threads"]}
    if spec["quiet"]:
        threads["1 thread"] = 1

    def train():
        for _ in range(spec["steps_per_call"]):
            step()

    def decode():
        generate(decoder, prompt, spec["decode_tokens"], temperature=0.0)

    def on_threads(n: int, work: Callable[[], None]) -> Callable[[], None]:
        def call():
            torch.set_num_threads(n)
            work()
        return call

    works = {"train": train, **({"decode": decode} if spec["decode_tokens"] else {})}
    measured = time_turns({f"{kind}, {label}": on_threads(n, work)
                           for kind, work in works.items() for label, n in threads.items()},
                          spec["repeats"], spec["warmup"])
    return {"times_s": {name: row.times_s for name, row in measured.items()},
            "auto": auto.describe(), "auto_threads": auto.threads}


def run_load_worker(spec: dict) -> dict:
    """load_worker(spec) in a new Python process with torch's default environment."""
    lines, _ = run_python(["-c", LOAD_WORKER, json.dumps(spec)], "the worker of the load section",
                          env=default_environment())
    return json.loads(lines[-1][1])


def bench_load(cfg: BenchConfig) -> Section:
    """Default training steps and batch-1 decoding, quiet and beside each competitor, with
    threads=auto and a fixed count: tokens/s under load as a share of one thread's quiet speed
    in the same round (the fair share). The conditions run in turns, `load.rounds` times, so a
    slower minute falls on both sides of a share; a ratio is the median of its rounds' shares."""
    load, model_cfg = cfg.load, cfg.model
    B, T = load.batch_size, model_cfg.block_size
    optim = replace(cfg.optim, name=load.optim)
    precision = "bf16" if has_fast_bf16(torch.device("cpu")) else "fp32"  # as precision=auto
    repeats = math.ceil(cfg.repeats / load.rounds)
    spec = {"model": asdict(model_cfg), "optim": asdict(optim), "precision": precision,
            "batch_size": B, "steps_per_call": load.steps_per_call,
            "decode_tokens": load.decode_tokens, "fixed_threads": load.fixed_threads,
            "repeats": repeats, "warmup": cfg.warmup}
    conditions = {"quiet": None, **COMPETITORS}
    calls: dict[str, list[float]] = {}  # row name -> seconds of every timed call, all rounds
    shares: dict[tuple[str, str], list[float]] = {}  # (candidate, condition) -> one per round
    workers: dict[str, list[dict]] = {condition: [] for condition in conditions}

    def tokens_per_call(candidate: str) -> int:
        return B * T * load.steps_per_call if candidate.startswith("train") else load.decode_tokens

    for _ in range(load.rounds):
        fair: dict[str, float] = {}  # kind of work -> this round's quiet 1-thread tokens/s
        for condition, code in conditions.items():
            with competitor(code) if code else contextlib.nullcontext():
                time.sleep(load.settle_s)
                worker = run_load_worker({**spec, "quiet": code is None})
            workers[condition].append(worker)
            for candidate, times in worker["times_s"].items():
                calls.setdefault(f"{candidate} ({condition})", []).extend(times)
                speed = tokens_per_call(candidate) / statistics.median(times)
                kind, label = candidate.split(", ")
                if code is None and label == "1 thread":
                    fair[kind] = speed
                elif code is not None:
                    shares.setdefault((candidate, condition), []).append(speed / fair[kind])

    rows = [Row(name, statistics.median(times), times) for name, times in calls.items()]
    for row in rows:
        row.figures["tokens_per_s"] = tokens_per_call(row.name) / row.median_s
    # the one target: tinylm-train as users start it, against the fair share
    ratios = [Ratio(f"{candidate} beside {condition} / quiet 1 thread, tokens/s",
                    statistics.median(kept), 0.9 if candidate == "train, auto" else None)
              for (candidate, condition), kept in shares.items()]
    per_round = [f"{condition}: " + ", ".join(f"{share:.2f}" for share in kept)
                 for (candidate, condition), kept in shares.items() if candidate == "train, auto"]
    notes = [f"{condition}: auto chose {by_round[0]['auto']}" + (
        "; by round: " + ", ".join(str(w["auto_threads"]) for w in by_round) + " threads"
        if load.rounds > 1 else "") for condition, by_round in workers.items()]
    notes += [f"{load.rounds} round{'s' if load.rounds != 1 else ''} of every condition in "
              f"turns, {repeats} timed call{'s' if repeats != 1 else ''} per candidate in each, "
              f"after {cfg.warmup} untimed; a ratio: the median of its "
              "rounds' shares of one thread's quiet speed in the same round; train, auto, by "
              "round: " + "; ".join(per_round),
              f"train: the default run's step (B={B}, T={T}, n_layer={model_cfg.n_layer}, "
              f"n_embd={model_cfg.n_embd}, dropout={model_cfg.dropout}, {precision}, "
              f"optim={optim.name}), {load.steps_per_call} steps per call; decode: greedy "
              f"batch 1, {load.decode_tokens} tokens with the KV cache",
              "each condition: a new process without OMP_*/GOMP_* settings, whose auto watches "
              "the cores over its start-up; competitors: " + "; ".join(
                  f"{name}: python -c {code!r}" for name, code in COMPETITORS.items())]
    return Section("load", rows, ratios, notes)


# ------------------------------------------------------------------------------ end to end


@dataclass
class TrainRun:
    """What one training subprocess took and reached."""

    wall_s: float
    startup_s: float  # command -> the start-up line, printed just before step 1
    step_s: float  # median seconds per training step
    steps: int
    val_loss: float
    to_target_s: float | None  # command -> the first evaluation at or below the target
    device: str  # cpu, cuda, ...: where it trained

    def row(self, name: str) -> Row:
        figures = {"wall_s": self.wall_s, "startup_s": self.startup_s,
                   "step_ms": self.step_s * 1e3, "val_loss": self.val_loss}
        if self.to_target_s is not None:
            figures["to_target_s"] = self.to_target_s
        return Row(name, self.wall_s, [self.wall_s], figures, f"{self.steps} steps")


def run_training(args: list[str], run_dir: Path, target_val: float) -> TrainRun:
    """`tinylm-train args hydra.run.dir=run_dir` as a subprocess, timed from the command."""
    # TensorBoard's reader is slow to import: only the endtoend section needs it
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    start = time.time()  # TensorBoard stamps its events in epoch seconds
    lines, wall = run_python(["-m", "tinylm.cli.train", *args, f"hydra.run.dir={run_dir}"],
                             f"tinylm-train {' '.join(args)}")
    ready, model_line = next((seconds, line) for seconds, line in lines if "] - Model: " in line)
    device = re.search(r" on ([a-z]+)", model_line)[1]
    tokens_per_step = int(re.search(r"([\d,]+) tokens per step", model_line)[1].replace(",", ""))
    events = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0})
    events.Reload()
    speeds = sorted(e.value for e in events.Scalars("train/tokens_per_sec"))
    val = events.Scalars("val/loss")
    reached = next((e.wall_time - start for e in val if e.value <= target_val), None)
    return TrainRun(wall, ready, tokens_per_step / speeds[len(speeds) // 2], val[-1].step,
                    val[-1].value, reached, device)


# nanoGPT's train.py prints `step 250: train loss 2.4293, val loss 2.4447` at each evaluation
# and `iter 50: loss 2.9336, time 50.20ms, mfu 0.03%` every --log_interval steps
NANOGPT_EVALUATION = re.compile(r"step (\d+): train loss [\d.]+, val loss ([\d.]+)")
NANOGPT_STEP = re.compile(r"iter (\d+): loss [\d.]+, time ([\d.]+)ms")


def run_nanogpt(checkout: Path, args: list[str], out_dir: Path, target_val: float) -> TrainRun:
    """nanoGPT's `python train.py args` in its checkout, with this Python, timed by the lines it
    prints; its checkpoint goes to out_dir, not over the checkout's own."""
    command = f"nanoGPT's python train.py {' '.join(args)} in {checkout}"
    lines, wall = run_python(["train.py", *args, f"--out_dir={out_dir}"], command,
                             env=default_environment(), cwd=checkout)
    evaluations, step_times = [], []
    for seconds, line in lines:
        if evaluation := NANOGPT_EVALUATION.match(line):
            evaluations.append((int(evaluation[1]), float(evaluation[2]), seconds))
        elif (step := NANOGPT_STEP.match(line)) and step[1] != "0":  # iter 0 includes warm-up
            step_times.append(float(step[2]) / 1e3)
    if not evaluations or not step_times:
        raise RuntimeError(f"{command} printed no evaluation or no step time after iter 0 "
                           "(its --eval_interval and --log_interval must be below --max_iters)")
    steps, val_loss, _ = evaluations[-1]
    reached = next((seconds for _, val, seconds in evaluations if val <= target_val), None)
    device = nanogpt_option(args, "device", "cuda").split(":")[0]  # cuda: nanoGPT's default
    # start-up: to its first evaluation, which it prints just before its first step
    return TrainRun(wall, evaluations[0][2], statistics.median(step_times), steps, val_loss,
                    reached, device)


def endtoend_ratios(extras: TrainRun, plain: TrainRun, nanogpt: TrainRun | None,
                    target_val: float) -> list[Ratio]:
    """Wall time with the extras against without; where nanoGPT ran here, time to the target
    val against its wall time (the target) and against its time to the same val."""
    ratios = [Ratio("wall time with the extras / without", extras.wall_s / plain.wall_s)]
    if nanogpt is None or extras.to_target_s is None:
        return ratios
    to_val = f"time to val <= {target_val:g} with the extras"
    ratios.append(Ratio(f"{to_val} / nanoGPT's wall time", extras.to_target_s / nanogpt.wall_s,
                        0.6, at_most=True))
    if nanogpt.to_target_s is not None:
        ratios.append(Ratio(f"{to_val} / nanoGPT's time to val <= {target_val:g}",
                            extras.to_target_s / nanogpt.to_target_s))
    return ratios


def bench_endtoend(cfg: BenchConfig) -> Section:
    """The experiment as a user runs it, with the evaluation extras (sample, attention maps) and
    without, then nanoGPT's command if endtoend.nanogpt names a checkout."""
    e = cfg.endtoend
    base = [*([f"experiment={e.experiment}"] if e.experiment else []), *e.overrides]
    plain_args = [*base, "train.probe_prompt=''", "train.sample_tokens=0"]
    nanogpt = None
    with tempfile.TemporaryDirectory() as work:
        # untimed, one step: the data prepared and the files read once, as after a first run
        run_training([*plain_args, "train.max_steps=1", "train.eval_batches=1"],
                     Path(work) / "warm-up", e.target_val)
        extras = run_training(base, Path(work) / "0", e.target_val)
        plain = run_training(plain_args, Path(work) / "1", e.target_val)
        rows = [extras.row("with the evaluation extras"),
                plain.row("without the sample and the heads' maps")]
        if e.nanogpt is not None:
            nanogpt = run_nanogpt(Path(e.nanogpt).expanduser(), e.nanogpt_args,
                                  Path(work) / "nanogpt", e.target_val)
            rows.append(nanogpt.row("nanoGPT's command"))
    notes = [f"each: python -m tinylm.cli.train {' '.join(base)} [...], timed from the command to "
             "its exit; start-up: to the start-up line, just before step 1; per step: from the "
             f"median logged tokens/s; to val: the first evaluation at or below {e.target_val}"]
    if nanogpt is None:
        notes.append("no target without nanoGPT's command run here beside it: "
                     "endtoend.nanogpt=<a nanoGPT checkout>")
    else:
        notes.append(f"nanoGPT: python train.py {' '.join(e.nanogpt_args)} --out_dir=<a "
                     f"temporary dir> in {e.nanogpt}, with this Python (torch "
                     f"{torch.__version__}); start-up: to its first evaluation, just before its "
                     "first step; per step: the median of its logged step times after iter 0")
        if nanogpt.device != extras.device:
            notes.append(f"tinylm trained on {extras.device} and nanoGPT on {nanogpt.device}: "
                         "the ratio compares devices as much as programs; give both one device "
                         f"(endtoend.overrides=[train.device={nanogpt.device}], or --device= "
                         "in endtoend.nanogpt_args)")
    if extras.to_target_s is None:
        notes.append(f"with the extras, no evaluation reached val <= {e.target_val:g}")
    return Section("endtoend", rows, endtoend_ratios(extras, plain, nanogpt, e.target_val),
                   notes)
