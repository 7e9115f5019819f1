"""The benchmark sections that run whole programs: training beside other load, and the
shakespeare_char run end to end as a user starts it.

    tinylm-bench section=load        # a busy process beside training: threads=auto vs 2 threads,
                                     # each way of starting in a process of its own
    tinylm-bench section=endtoend    # tinylm-train experiment=shakespeare_char, with and without
                                     # the evaluation extras, in a subprocess
    tinylm-bench section=endtoend endtoend.nanogpt=../nanoGPT   # and nanoGPT's command after it

Both return a `Section` like the others in tinylm/bench/sections.py.
"""

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
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from tinylm.bench.sections import Ratio, Row, Section, Timing
from tinylm.bench.train import training_step
from tinylm.generate import generate
from tinylm.model import ModelConfig, TinyLM
from tinylm.train.optim import OptimConfig
from tinylm.train.runtime import resolve_precision

if TYPE_CHECKING:  # the command's configs; importing them at run time would be circular
    from tinylm.cli.bench import EndToEndBenchConfig, LoadBenchConfig

# What the other load is: a plain busy loop, and a PyTorch job with 2 intra-op threads.
COMPETITORS = {
    "one busy process": "while True: pass",
    "a 2-thread PyTorch job": (
        "import torch\ntorch.set_num_threads(2)\na = torch.randn(256, 256)\n"
        "print('ready', flush=True)\nwhile True:\n    a @ a\n"),
}


# ---------------------------------------------------------------------------------- load

# How OpenMP's threads wait is read once, when torch loads, so each way of starting is a process
# of its own: "plain" as PyTorch starts by itself (and as tinylm-generate does), "tinylm-train"
# as the training command does, which may have the threads wait passively (tinylm/train/threads.py).
# Importing tinylm.train.threads first takes the sample of the cores that the commands take.
LOAD_WORKER = (
    "import json, sys\nimport tinylm.train.threads\n"
    "if sys.argv[1] == 'tinylm-train':\n    tinylm.train.threads.wait_passively_if_cores_full()\n"
    "from tinylm.bench.runs import load_worker\n"
    "print(json.dumps(load_worker(sys.argv[1], json.loads(sys.argv[2]))))\n")

# set by the commands or a user's shell (how OpenMP's threads wait, how many there are);
# each process here starts from torch's own defaults
WAIT_SETTINGS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "OMP_NUM_THREADS")


def default_environment(**extra: str) -> dict[str, str]:
    """This process's environment without the OpenMP settings of WAIT_SETTINGS, plus `extra`."""
    return {**{k: v for k, v in os.environ.items() if k not in WAIT_SETTINGS}, **extra}


@contextlib.contextmanager
def competitor(code: str) -> Iterator[subprocess.Popen]:
    """Run `code` in another Python process until the block ends (waits for a 'ready' line
    if the code prints one)."""
    env = default_environment(OMP_NUM_THREADS="2")  # the other job's own choice, not auto's
    process = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE,
                               stderr=subprocess.DEVNULL, text=True, env=env)
    try:
        if "ready" in code:
            process.stdout.readline()
        yield process
    finally:
        process.kill()
        process.wait()


def load_worker(start: str, spec: dict) -> dict:
    """In a process started by LOAD_WORKER: time the candidates of one way of starting.

    plain: training and decoding with spec["fixed_threads"], decoding with generate's `auto`;
    tinylm-train: training with the training command's `auto`. Returns the seconds of every
    timed call by candidate, and what auto chose and why."""
    from tinylm.train.threads import apply_threads, start_sample

    since = start_sample()
    model_cfg, B = ModelConfig(**spec["model"]), spec["batch_size"]
    x = torch.randint(0, model_cfg.vocab_size, (B, model_cfg.block_size))
    step = training_step(TinyLM(model_cfg), OptimConfig(**spec["optim"]), x, x.roll(-1, 1),
                         spec["precision"])
    prompt = torch.randint(0, model_cfg.vocab_size, (1, 8))
    decoder = TinyLM(replace(model_cfg, dropout=0.0)).eval()
    fixed = spec["fixed_threads"]

    def with_threads(n: int, fn: Callable[[], object]) -> Callable[[], None]:
        def call():
            torch.set_num_threads(n)
            fn()
        return call

    def train_calls():
        for _ in range(spec["steps_per_call"]):
            step()

    def decode_call():
        generate(decoder, prompt, spec["decode_tokens"], temperature=0.0)

    if start == "tinylm-train":
        auto = apply_threads("auto", since, team_when_full=True)
        candidates = {"train, auto": with_threads(auto.threads, train_calls)}
    else:
        auto = apply_threads("auto", since)
        candidates = {f"train, {fixed} threads": with_threads(fixed, train_calls)}
        if spec["decode_tokens"]:
            candidates[f"decode, {fixed} threads"] = with_threads(fixed, decode_call)
            candidates["decode, auto"] = with_threads(auto.threads, decode_call)
    measured = Timing(spec["repeats"], spec["warmup"]).run(candidates)
    return {"times_s": {name: row.times_s for name, row in measured.items()},
            "auto": auto.describe(), "auto_threads": auto.threads}


def run_load_worker(start: str, spec: dict) -> dict:
    """load_worker(start, spec) in a new Python process with torch's default environment."""
    done = subprocess.run([sys.executable, "-c", LOAD_WORKER, start, json.dumps(spec)],
                          capture_output=True, text=True, env=default_environment())
    if done.returncode != 0:
        raise RuntimeError(f"the {start} worker of the load section failed: "
                           f"{(done.stderr.strip().splitlines() or ['?'])[-1]}")
    return json.loads(done.stdout.splitlines()[-1])


def bench_load(model_cfg: ModelConfig, optim: OptimConfig, cfg: LoadBenchConfig,
               timing: Timing) -> Section:
    """Default training steps and batch-1 decoding, quiet and beside each competitor, with
    threads=auto against a fixed count; tokens/s under load as a share of quiet tokens/s.

    The conditions run in turns, `cfg.rounds` times, and each share is taken against the quiet
    run of its own round, so that a minute in which the machine was slower falls on both sides
    of a share; the ratios are the medians of the rounds' shares."""
    B, T = cfg.batch_size, model_cfg.block_size
    optim = replace(optim, name=cfg.optim)
    precision = "bf16" if resolve_precision("auto", torch.device("cpu")) == torch.bfloat16 \
        else "fp32"
    spec = {"model": asdict(model_cfg), "optim": asdict(optim), "precision": precision,
            "batch_size": B, "steps_per_call": cfg.steps_per_call,
            "decode_tokens": cfg.decode_tokens, "fixed_threads": cfg.fixed_threads,
            "repeats": math.ceil(timing.repeats / cfg.rounds), "warmup": timing.warmup}
    conditions = ("quiet", *COMPETITORS)
    calls: dict[str, list[float]] = {}  # row name -> seconds of every timed call, all rounds
    shares: dict[tuple[str, str], list[float]] = {}  # (candidate, condition) -> one per round
    # what auto chose in each round: (training's, decoding's)
    choices: dict[str, list[tuple[dict, dict]]] = {condition: [] for condition in conditions}

    def tokens_per_call(candidate: str) -> int:
        return B * T * cfg.steps_per_call if candidate.startswith("train") else cfg.decode_tokens

    for _ in range(cfg.rounds):
        quiet: dict[str, float] = {}
        for condition in conditions:
            with contextlib.ExitStack() as stack:
                if condition != "quiet":
                    stack.enter_context(competitor(COMPETITORS[condition]))
                time.sleep(cfg.settle_s)
                plain = run_load_worker("plain", spec)
                trainer = run_load_worker("tinylm-train", spec)
            choices[condition].append((trainer, plain))
            for candidate, times in {**plain["times_s"], **trainer["times_s"]}.items():
                calls.setdefault(f"{candidate} ({condition})", []).extend(times)
                speed = tokens_per_call(candidate) / statistics.median(times)
                if condition == "quiet":
                    quiet[candidate] = speed
                else:  # the share of this round's quiet default (auto)
                    kind = candidate.split(", ")[0]
                    shares.setdefault((candidate, condition), []).append(
                        speed / quiet[f"{kind}, auto"])

    rows = []
    for name, times in calls.items():
        row = Row(name, statistics.median(times), times)
        row.figures["tokens_per_s"] = tokens_per_call(name) / row.median_s
        rows.append(row)
    ratios, per_round = [], []
    for (candidate, condition), kept in shares.items():
        target = None
        if candidate == "train, auto":
            target = 0.70 if condition == "one busy process" else 0.50
            per_round.append(f"{condition}: " + ", ".join(f"{share:.2f}" for share in kept))
        ratios.append(Ratio(f"{candidate} beside {condition} / quiet auto, tokens/s",
                            statistics.median(kept), target))
    notes = []
    for condition, by_round in choices.items():
        trainer, plain = by_round[0]
        notes.append(f"{condition}: auto chose {trainer['auto']} for training, {plain['auto']} "
                     "for decoding" + ("" if cfg.rounds == 1 else
                                       f"; by round: {_counts(t for t, _ in by_round)} threads "
                                       f"for training, {_counts(p for _, p in by_round)} for "
                                       "decoding"))
    notes += [f"{cfg.rounds} round{'s' if cfg.rounds != 1 else ''} of every condition in turns, "
              f"{spec['repeats']} timed call{'s' if spec['repeats'] != 1 else ''} per candidate "
              f"in each, after {timing.warmup} untimed; a ratio is the median of its rounds' "
              "shares, each against its own round's quiet auto; train, auto, by round: "
              + "; ".join(per_round),
              f"train: the default run's step (B={B}, T={T}, n_layer={model_cfg.n_layer}, "
              f"n_embd={model_cfg.n_embd}, dropout={model_cfg.dropout}, {precision}, "
              f"optim={optim.name}), {cfg.steps_per_call} steps per call; decode: greedy "
              f"batch 1, {cfg.decode_tokens} tokens with the KV cache",
              "each condition: one process started as PyTorch starts by itself (the "
              f"{cfg.fixed_threads}-thread rows, and decoding's auto, as tinylm-generate), one "
              "started as tinylm-train (training's auto, which decides how OpenMP's threads "
              "wait before torch loads); both without OMP_WAIT_POLICY, GOMP_SPINCOUNT and "
              "OMP_NUM_THREADS from the environment",
              "competitors: " + "; ".join(f"{name}: python -c {code!r}"
                                          for name, code in COMPETITORS.items())]
    return Section("load", rows, ratios, notes)


def _counts(chosen: Iterator[dict]) -> str:
    """The thread counts load workers chose, e.g. '2, 2, 1'."""
    return ", ".join(str(worker["auto_threads"]) for worker in chosen)


# ------------------------------------------------------------------------------ end to end


@dataclass
class TrainRun:
    """What one tinylm-train subprocess took and reached."""

    wall_s: float
    startup_s: float  # command -> the start-up line, logged just before step 1
    step_s: float  # median seconds per training step (from the tokens/s it logged)
    steps: int
    val_loss: float
    to_target_s: float | None  # command -> the first evaluation at or below the target
    device: str  # cpu, cuda, ...: where it trained


def _log_time(line: str) -> float:
    """The epoch seconds of a Hydra log line `[2025-01-01 12:00:00,123][...`."""
    stamp = re.match(r"\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3})\]", line).group(1)
    return datetime.strptime(stamp, "%Y-%m-%d %H:%M:%S,%f").timestamp()


def run_training(args: list[str], run_dir: Path, target_val: float) -> TrainRun:
    """`tinylm-train args hydra.run.dir=run_dir` as a subprocess, timed from the command."""
    # imported here, not on top: every tinylm command imports this module while it registers
    # BenchConfig's schema, and TensorBoard's reader would slow each one's start-up
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    start = time.time()
    done = subprocess.run([sys.executable, "-m", "tinylm.cli.train", *args,
                           f"hydra.run.dir={run_dir}"], capture_output=True, text=True)
    wall = time.time() - start
    if done.returncode != 0:
        raise RuntimeError(f"tinylm-train {' '.join(args)} failed: "
                           f"{(done.stderr.strip().splitlines() or ['?'])[-1]}")
    log_lines = (run_dir / "train.log").read_text(encoding="utf-8").splitlines()
    model_line = next(line for line in log_lines if "] - Model: " in line)
    ready, device = _log_time(model_line), re.search(r" on ([a-z]+)", model_line)[1]
    tokens_per_step = int(re.search(r"([\d,]+) tokens per step", "\n".join(log_lines))
                          .group(1).replace(",", ""))
    events = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0})
    events.Reload()
    speeds = sorted(e.value for e in events.Scalars("train/tokens_per_sec"))
    val = events.Scalars("val/loss")
    reached = next((e.wall_time for e in val if e.value <= target_val), None)
    return TrainRun(wall, ready - start, tokens_per_step / speeds[len(speeds) // 2],
                    val[-1].step, val[-1].value, reached - start if reached else None, device)


# nanoGPT's train.py prints `step 250: train loss 2.4293, val loss 2.4447` at each evaluation
# and `iter 50: loss 2.9336, time 50.20ms, mfu 0.03%` every --log_interval steps
NANOGPT_EVALUATION = re.compile(r"step (\d+): train loss [\d.]+, val loss ([\d.]+)")
NANOGPT_STEP = re.compile(r"iter (\d+): loss [\d.]+, time ([\d.]+)ms")


def nanogpt_option(args: list[str], name: str, default: str | None = None) -> str | None:
    """The value of `--name=value` in nanoGPT's arguments, or `default`."""
    return next((arg.split("=", 1)[1] for arg in args if arg.startswith(f"--{name}=")), default)


def run_nanogpt(checkout: Path, args: list[str], out_dir: Path, target_val: float) -> TrainRun:
    """nanoGPT's `python train.py args` in its checkout, with this Python, as a subprocess
    timed from the command by the lines it prints; its checkpoint goes to out_dir, not over
    the checkout's own."""
    start = time.time()
    process = subprocess.Popen(
        [sys.executable, "train.py", *args, f"--out_dir={out_dir}"], cwd=checkout,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env=default_environment(PYTHONUNBUFFERED="1"))  # each line as it is printed
    evaluations, step_times, last_line = [], [], ""
    for line in process.stdout:
        seconds = time.time() - start
        if evaluation := NANOGPT_EVALUATION.match(line):
            evaluations.append((int(evaluation[1]), float(evaluation[2]), seconds))
        elif (step := NANOGPT_STEP.match(line)) and step[1] != "0":  # iter 0 includes warm-up
            step_times.append(float(step[2]) / 1e3)
        last_line = line.strip() or last_line
    wall = time.time() - start
    command = f"nanoGPT's python train.py {' '.join(args)} in {checkout}"
    if process.wait() != 0:
        raise RuntimeError(f"{command} failed (exit {process.returncode}): {last_line}")
    if not evaluations or not step_times:
        raise RuntimeError(f"{command} printed no evaluation or no step time after iter 0 "
                           "(its --eval_interval and --log_interval must be below --max_iters)")
    steps, val_loss, _ = evaluations[-1]
    reached = next((seconds for _, val, seconds in evaluations if val <= target_val), None)
    device = nanogpt_option(args, "device", "cuda").split(":")[0]  # cuda: nanoGPT's default
    # start-up: to its first evaluation, which it prints just before its first step
    return TrainRun(wall, evaluations[0][2], statistics.median(step_times), steps, val_loss,
                    reached, device)


def _run_row(name: str, run: TrainRun) -> Row:
    return Row(name, run.wall_s, [run.wall_s], {
        "wall_s": run.wall_s, "startup_s": run.startup_s, "step_ms": run.step_s * 1e3,
        "val_loss": run.val_loss,
        **({"to_target_s": run.to_target_s} if run.to_target_s is not None else {})},
        f"{run.steps} steps")


def endtoend_ratios(extras: TrainRun, plain: TrainRun, nanogpt: TrainRun | None,
                    cfg: EndToEndBenchConfig) -> list[Ratio]:
    """Wall time with the extras against without; time to the target val against nanoGPT's
    wall time measured here (the target), or else against cfg.reference_s."""
    ratios = [Ratio("wall time with the extras / without", extras.wall_s / plain.wall_s)]
    if extras.to_target_s is None:
        return ratios
    to_val = f"time to val <= {cfg.target_val:g} with the extras"
    if nanogpt is not None:
        ratios.append(Ratio(f"{to_val} / nanoGPT's wall time", extras.to_target_s / nanogpt.wall_s,
                            0.6, at_most=True))
        if nanogpt.to_target_s is not None:
            ratios.append(Ratio(f"{to_val} / nanoGPT's time to val <= {cfg.target_val:g}",
                                extras.to_target_s / nanogpt.to_target_s))
    elif cfg.reference_s:
        ratios.append(Ratio(f"{to_val} / the reference {cfg.reference_s:g} s",
                            extras.to_target_s / cfg.reference_s, 0.6, at_most=True))
    return ratios


def bench_endtoend(cfg: EndToEndBenchConfig) -> Section:
    """The experiment as a user runs it, with the evaluation extras (sample, figures) and
    without, then nanoGPT's command if cfg.nanogpt names a checkout; wall time, start-up, time
    per step, final val loss, time to the target val."""
    base = [*([f"experiment={cfg.experiment}"] if cfg.experiment else []), *cfg.overrides]
    variants = {"with the evaluation extras": base,
                "without the sample and the heads' maps": [*base, "train.probe_prompt=''",
                                                            "train.sample_tokens=0"]}
    rows, runs, nanogpt = [], {}, None
    with tempfile.TemporaryDirectory() as work:
        # untimed, one step: the data prepared and the files read once, as after a first run
        run_training([*variants["without the sample and the heads' maps"], "train.max_steps=1",
                      "train.eval_batches=1"], Path(work) / "warm-up", cfg.target_val)
        for name, args in variants.items():
            runs[name] = run_training(args, Path(work) / str(len(runs)), cfg.target_val)
            rows.append(_run_row(name, runs[name]))
        if cfg.nanogpt is not None:
            nanogpt = run_nanogpt(Path(cfg.nanogpt).expanduser(), cfg.nanogpt_args,
                                  Path(work) / "nanogpt", cfg.target_val)
            rows.append(_run_row("nanoGPT's command", nanogpt))
    extras, plain = (runs[name] for name in variants)
    notes = [f"each: python -m tinylm.cli.train {' '.join(base)} [...] in a subprocess, timed "
             "from the command to its exit; start-up: to the start-up line, logged just before "
             "step 1; per step: the median of the logged tokens/s; to val: the first evaluation "
             f"at or below {cfg.target_val} (evaluations every train.eval_interval steps)"]
    if nanogpt is not None:
        notes.append(f"nanoGPT: python train.py {' '.join(cfg.nanogpt_args)} --out_dir=<a "
                     f"temporary dir> in {cfg.nanogpt}, with this Python (torch "
                     f"{torch.__version__}), timed by the lines it prints; start-up: to its "
                     "first evaluation, printed just before its first step; per step: the "
                     "median of its logged step times after iter 0")
        if nanogpt.device != extras.device:
            notes.append(f"tinylm trained on {extras.device} and nanoGPT on {nanogpt.device}: "
                         "the ratio compares devices as much as programs; give both one device "
                         f"(endtoend.overrides=[train.device={nanogpt.device}], or --device= "
                         "in endtoend.nanogpt_args)")
    elif cfg.reference_s:
        notes.append(f"reference: {cfg.reference_s:g} s, {cfg.reference} (not rerun here; "
                     "endtoend.nanogpt=<a nanoGPT checkout> runs it here)")
    if extras.to_target_s is None:
        notes.append(f"with the extras, no evaluation reached val <= {cfg.target_val:g}")
    return Section("endtoend", rows, endtoend_ratios(extras, plain, nanogpt, cfg), notes)
