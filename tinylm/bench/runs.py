"""The sections that run whole programs: training beside other load (load), and a training run
end to end as a user starts it, beside nanoGPT's command where a checkout is given (endtoend).
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

import torch

from tinylm.bench.config import EndToEndBenchConfig, LoadBenchConfig, nanogpt_option
from tinylm.bench.sections import Ratio, Row, Section, Timing
from tinylm.bench.train import training_step
from tinylm.device import has_fast_bf16
from tinylm.generate import generate
from tinylm.model import ModelConfig, TinyLM
from tinylm.train.optim import OptimConfig
from tinylm.train.threads import apply_threads

# ---------------------------------------------------------------------------------- load

# What the other load is: a plain busy loop, and a PyTorch job with 2 intra-op threads.
COMPETITORS = {
    "one busy process": "while True: pass",
    "a 2-thread PyTorch job": (
        "import torch\ntorch.set_num_threads(2)\na = torch.randn(256, 256)\n"
        "print('ready', flush=True)\nwhile True:\n    a @ a\n"),
}

# Each condition is timed in a new process, as a command starts: `auto` watches the cores over
# the process's start-up.
LOAD_WORKER = (
    "import json, sys\nfrom tinylm.train.threads import start_sample\nsince = start_sample()\n"
    "from tinylm.bench.runs import load_worker\n"
    "print(json.dumps(load_worker(json.loads(sys.argv[1]), since)))\n")


def default_environment(**extra: str) -> dict[str, str]:
    """This process's environment without its OpenMP settings (torch's own defaults), plus
    `extra`."""
    return {**{k: v for k, v in os.environ.items() if not k.startswith(("OMP_", "GOMP_"))},
            **extra}


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


def load_worker(spec: dict, since=None) -> dict:
    """In the process LOAD_WORKER starts: time training steps (and decoding) with the threads
    `auto` chooses, with spec["fixed_threads"], and (spec["quiet"]) with 1 thread. Returns the
    seconds of every timed call by candidate, and what auto chose and why (`since`: the cores'
    sample at the process's start)."""
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
    measured = Timing(spec["repeats"], spec["warmup"]).run({
        f"{kind}, {label}": on_threads(n, work)
        for kind, work in works.items() for label, n in threads.items()})
    return {"times_s": {name: row.times_s for name, row in measured.items()},
            "auto": auto.describe(), "auto_threads": auto.threads}


def run_load_worker(spec: dict) -> dict:
    """load_worker(spec) in a new Python process with torch's default environment."""
    done = subprocess.run([sys.executable, "-c", LOAD_WORKER, json.dumps(spec)],
                          capture_output=True, text=True, env=default_environment())
    if done.returncode != 0:
        raise RuntimeError("the worker of the load section failed: "
                           f"{(done.stderr.strip().splitlines() or ['?'])[-1]}")
    return json.loads(done.stdout.splitlines()[-1])


def bench_load(model_cfg: ModelConfig, optim: OptimConfig, cfg: LoadBenchConfig,
               timing: Timing) -> Section:
    """Default training steps and batch-1 decoding, quiet and beside each competitor, with
    threads=auto and a fixed count; tokens/s under load as a share of the fair share: one
    thread's quiet tokens/s, timed in the same round.

    The conditions run in turns, `cfg.rounds` times, so that a minute in which the machine was
    slower falls on both sides of a share; the ratios are the medians of the rounds' shares."""
    B, T = cfg.batch_size, model_cfg.block_size
    optim = replace(optim, name=cfg.optim)
    precision = "bf16" if has_fast_bf16(torch.device("cpu")) else "fp32"  # as precision=auto
    spec = {"model": asdict(model_cfg), "optim": asdict(optim), "precision": precision,
            "batch_size": B, "steps_per_call": cfg.steps_per_call,
            "decode_tokens": cfg.decode_tokens, "fixed_threads": cfg.fixed_threads,
            "repeats": math.ceil(timing.repeats / cfg.rounds), "warmup": timing.warmup}
    calls: dict[str, list[float]] = {}  # row name -> seconds of every timed call, all rounds
    shares: dict[tuple[str, str], list[float]] = {}  # (candidate, condition) -> one per round
    workers: dict[str, list[dict]] = {"quiet": [], **{name: [] for name in COMPETITORS}}

    def tokens_per_call(candidate: str) -> int:
        return B * T * cfg.steps_per_call if candidate.startswith("train") else cfg.decode_tokens

    for _ in range(cfg.rounds):
        fair: dict[str, float] = {}  # kind of work -> this round's quiet 1-thread tokens/s
        for condition, by_round in workers.items():
            with contextlib.ExitStack() as stack:
                if condition != "quiet":
                    stack.enter_context(competitor(COMPETITORS[condition]))
                time.sleep(cfg.settle_s)
                worker = run_load_worker({**spec, "quiet": condition == "quiet"})
            by_round.append(worker)
            for candidate, times in worker["times_s"].items():
                calls.setdefault(f"{candidate} ({condition})", []).extend(times)
                speed = tokens_per_call(candidate) / statistics.median(times)
                kind, label = candidate.split(", ")
                if condition == "quiet" and label == "1 thread":
                    fair[kind] = speed
                elif condition != "quiet":
                    shares.setdefault((candidate, condition), []).append(speed / fair[kind])

    rows = []
    for name, times in calls.items():
        row = Row(name, statistics.median(times), times)
        row.figures["tokens_per_s"] = tokens_per_call(name) / row.median_s
        rows.append(row)
    ratios, per_round = [], []
    for (candidate, condition), kept in shares.items():
        target = 0.9 if candidate == "train, auto" else None  # tinylm-train as users start it
        if target is not None:
            per_round.append(f"{condition}: " + ", ".join(f"{share:.2f}" for share in kept))
        ratios.append(Ratio(f"{candidate} beside {condition} / quiet 1 thread, tokens/s",
                            statistics.median(kept), target))
    notes = []
    for condition, by_round in workers.items():
        note = f"{condition}: auto chose {by_round[0]['auto']}"
        if cfg.rounds > 1:
            chosen = ", ".join(str(worker["auto_threads"]) for worker in by_round)
            note += f"; by round: {chosen} threads"
        notes.append(note)
    notes += [f"{cfg.rounds} round{'s' if cfg.rounds != 1 else ''} of every condition in turns, "
              f"{spec['repeats']} timed call{'s' if spec['repeats'] != 1 else ''} per candidate "
              f"in each, after {timing.warmup} untimed; a ratio is the median of its rounds' "
              "shares, each against one thread's quiet speed at the same work in its own round "
              "(the fair share beside one other busy process on 2 cores is one core); "
              "train, auto, by round: " + "; ".join(per_round),
              f"train: the default run's step (B={B}, T={T}, n_layer={model_cfg.n_layer}, "
              f"n_embd={model_cfg.n_embd}, dropout={model_cfg.dropout}, {precision}, "
              f"optim={optim.name}), {cfg.steps_per_call} steps per call; decode: greedy "
              f"batch 1, {cfg.decode_tokens} tokens with the KV cache",
              "each condition: one new process, without this environment's OpenMP settings "
              "(OMP_*, GOMP_*), whose auto watches the cores over its start-up as the commands' "
              "does",
              "competitors: " + "; ".join(f"{name}: python -c {code!r}"
                                          for name, code in COMPETITORS.items())]
    return Section("load", rows, ratios, notes)


# ------------------------------------------------------------------------------ end to end


@dataclass
class TrainRun:
    """What one training subprocess took and reached."""

    wall_s: float
    startup_s: float  # command -> the start-up line, logged just before step 1
    step_s: float  # median seconds per training step
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
    # TensorBoard's reader is slow to import: only the endtoend section needs it
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
                    target_val: float) -> list[Ratio]:
    """Wall time with the extras against without; where nanoGPT ran here, time to the target
    val against its wall time (the target) and its time to the same val."""
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


def bench_endtoend(cfg: EndToEndBenchConfig) -> Section:
    """The experiment as a user runs it, with the evaluation extras (sample, figures) and
    without, then nanoGPT's command if cfg.nanogpt names a checkout; wall time, start-up, time
    per step, final val loss, time to the target val."""
    base = [*([f"experiment={cfg.experiment}"] if cfg.experiment else []), *cfg.overrides]
    plain_args = [*base, "train.probe_prompt=''", "train.sample_tokens=0"]
    variants = {"with the evaluation extras": base,
                "without the sample and the heads' maps": plain_args}
    rows, runs, nanogpt = [], [], None
    with tempfile.TemporaryDirectory() as work:
        # untimed, one step: the data prepared and the files read once, as after a first run
        run_training([*plain_args, "train.max_steps=1", "train.eval_batches=1"],
                     Path(work) / "warm-up", cfg.target_val)
        for name, args in variants.items():
            runs.append(run_training(args, Path(work) / str(len(runs)), cfg.target_val))
            rows.append(_run_row(name, runs[-1]))
        if cfg.nanogpt is not None:
            nanogpt = run_nanogpt(Path(cfg.nanogpt).expanduser(), cfg.nanogpt_args,
                                  Path(work) / "nanogpt", cfg.target_val)
            rows.append(_run_row("nanoGPT's command", nanogpt))
    extras, plain = runs
    notes = [f"each: python -m tinylm.cli.train {' '.join(base)} [...] in a subprocess, timed "
             "from the command to its exit; start-up: to the start-up line, logged just before "
             "step 1; per step: the median of the logged tokens/s; to val: the first evaluation "
             f"at or below {cfg.target_val} (evaluations every train.eval_interval steps)"]
    if nanogpt is None:
        notes.append("no target without nanoGPT's command run here beside it: "
                     "endtoend.nanogpt=<a nanoGPT checkout>")
    else:
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
    if extras.to_target_s is None:
        notes.append(f"with the extras, no evaluation reached val <= {cfg.target_val:g}")
    return Section("endtoend", rows, endtoend_ratios(extras, plain, nanogpt, cfg.target_val),
                   notes)
