"""Behaviour of tinylm.train and tinylm-train: configs, the loop, checkpoints, resume, bad input.

Every run uses the real conf/ tree made tiny (a 2-layer model on a corpus the tests write).
"""

import os
import random
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import TINY, TRAINED_RUN, compose, run_cli, run_config, torch_save_failing_at
from omegaconf import OmegaConf
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

import tinylm.checkpoint
import tinylm.device
import tinylm.model
import tinylm.train.trainer
from tinylm.checkpoint import load_checkpoint, resolve_checkpoint_dir
from tinylm.cli import config_dir
from tinylm.config import ConfigError
from tinylm.data import BatchSampler, prepare_data
from tinylm.files import project_root
from tinylm.inspection.tensorboard_plugin import PLUGIN_NAME
from tinylm.train.optim import OptimConfig, configure_optimizer, lr_at
from tinylm.train.run_config import RunConfig
from tinylm.train.runtime import TrainingInterrupted
from tinylm.train.trainer import TrainingDiverged, train, validation_loss


def scalars(run_dir, tag):
    events = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0})
    events.Reload()
    return [(e.step, e.value) for e in events.Scalars(tag)]


def weights(run_dir, tag="last"):
    return load_checkpoint(run_dir, prefer=tag).model.state_dict()


# ------------------------------------------------------------------------------- configs


def run_from(composed, run_dir):
    """RunConfig.from_config of a composed config, turned into plain data as the command does."""
    return RunConfig.from_config(OmegaConf.to_container(composed, resolve=True), run_dir)


def group_options(group):
    return sorted(p.stem for p in (config_dir() / group).glob("*.yaml"))


@pytest.mark.parametrize("override", [
    f"{group}={option}" for group in ("model", "data", "tokenizer", "optim", "train")
    for option in group_options(group)] + [
    f"experiment={name}" for name in group_options("experiment")])
def test_every_config_option_and_experiment_builds_its_dataclasses(override):
    extra = ["data.files=[a.txt]"] if override == "data=text" else []
    run = run_from(compose("config", [override, *extra]), "runs/x")
    assert run.train.max_steps >= 1 and run.optim.lr > 0


def test_shakespeare_char_experiment_has_nanogpts_cpu_settings():
    run = run_from(compose("config", ["experiment=shakespeare_char"]), "x")
    m, o, t = run.model, run.optim, run.train
    assert (run.data.name, run.tokenizer.name) == ("tinyshakespeare", "char")
    assert (m.n_layer, m.n_head, m.n_embd, m.block_size, m.dropout, m.bias) == (
        4, 4, 128, 64, 0.0, False)
    assert (t.batch_size, t.max_steps, t.eval_interval, t.eval_batches) == (12, 500, 250, 20)
    assert (o.lr, o.min_lr, o.lr_decay_steps, o.warmup_steps, o.beta2, o.weight_decay,
            o.grad_clip) == (2e-3, 1e-4, 500, 100, 0.99, 0.1, 1.0)
    # the differences on purpose: Muon needs fewer steps, and 500 of them do at this lr
    assert (o.name, o.muon_lr) == ("muon", 0.03)
    nanogpt = ["experiment=shakespeare_char", "optim=adamw", "optim.lr=1e-3",
               "train.max_steps=2000", "optim.lr_decay_steps=2000"]  # as the preset says
    adamw = run_from(compose("config", nanogpt), "x")
    assert (adamw.optim.name, adamw.optim.lr, adamw.optim.beta1, adamw.optim.lr_decay_steps,
            adamw.train.max_steps) == ("adamw", 1e-3, 0.8, 2000, 2000)


def test_lr_warms_up_linearly_then_follows_a_cosine_to_min_lr():
    o = OptimConfig(lr=1e-3, min_lr=1e-4, warmup_steps=10, lr_decay_steps=110)
    lrs = [lr_at(s, o, max_steps=200) for s in range(200)]
    assert lrs[0] == pytest.approx(1e-3 / 11) and lrs[9] == pytest.approx(1e-3 * 10 / 11)
    assert lrs[10] == pytest.approx(1e-3)
    assert lrs[60] == pytest.approx(1e-4 + 0.5 * 9e-4)  # halfway down the cosine
    assert all(a >= b for a, b in zip(lrs[10:], lrs[11:], strict=False))
    assert lrs[110:] == [1e-4] * 90


def test_weight_decay_skips_norms_biases_and_the_tied_embedding(tiny_model):
    model = tiny_model(50, block_size=8, n_layer=1, n_embd=8, bias=True)
    decay, no_decay = configure_optimizer(model, OptimConfig()).param_groups
    names = {id(p): n for n, p in model.named_parameters()}
    decayed = sorted(names[id(p)] for p in decay["params"])
    assert decayed == ["blocks.0.attn.out_proj.weight", "blocks.0.attn.qkv_proj.weight",
                       "blocks.0.mlp.fc.weight", "blocks.0.mlp.proj.weight"]
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert len(decay["params"]) + len(no_decay["params"]) == len(names)
    assert "wte.weight" in {names[id(p)] for p in no_decay["params"]}


# ------------------------------------------------------------------------------ the loop


@pytest.mark.slow
def test_short_run_lowers_the_loss_and_writes_a_loadable_checkpoint(trained_run):
    run_dir, metrics = trained_run
    val = scalars(run_dir, "val/loss")
    assert [s for s, _ in val] == [10, 20, 30]
    assert val[-1][1] < val[0][1] < 5.0  # ln(300) = 5.7 at the start
    train_losses = [v for _, v in scalars(run_dir, "train/loss")]
    assert len(train_losses) == 30 and sum(train_losses[-5:]) < sum(train_losses[:5])
    assert metrics["val_loss"] == pytest.approx(val[-1][1])

    ckpt = load_checkpoint(run_dir, prefer="last")
    assert ckpt.directory.name == "step-0000030"
    assert ckpt.run_config["model"]["vocab_size"] == ckpt.tokenizer.vocab_size == 300
    assert ckpt.run_config["train"]["max_steps"] == 30
    state = torch.load(ckpt.trainer_state_path, weights_only=True)
    assert state["step"] == 30 and state["best_val_loss"] == pytest.approx(min(v for _, v in val))
    assert torch.equal(weights(run_dir, "best")["wte.weight"], ckpt.model.wte.weight)  # 30 best
    # the reloaded model computes the validation loss the run reported (the same windows)
    run = RunConfig.from_config(ckpt.run_config, run_dir)
    prepared = prepare_data(run.data, run.tokenizer, log=lambda _: None)
    val_ids = np.memmap(prepared.val_path, dtype=prepared.meta["dtype"], mode="r")
    val_loss = validation_loss(ckpt.model, val_ids, run.train, 32, torch.device("cpu"))
    assert val_loss == pytest.approx(metrics["val_loss"], abs=1e-6)


@pytest.mark.slow
def test_tensorboard_holds_the_promised_scalars_text_attention_and_hparams(trained_run):
    run_dir, _ = trained_run
    events = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={
        "scalars": 0, "images": 0, "tensors": 0})
    events.Reload()
    tags = events.Tags()
    assert {"train/loss", "train/lr", "train/grad_norm", "train/tokens_per_sec", "train/mfu",
            "val/loss", "val/perplexity"} <= set(tags["scalars"])
    # at each evaluation, the last one too: every head on the probe prompt, for the attention tab
    # (which shows each head, so no image restates it)
    assert sorted(events.PluginTagToContent(PLUGIN_NAME)) == [
        f"probe_prompt/step_{step:08d}" for step in (10, 20, 30)]
    assert tags["images"] == []
    assert "samples/text/text_summary" in tags["tensors"]
    sample = events.Tensors("samples/text/text_summary")[-1].tensor_proto.string_val[0].decode()
    assert sample.startswith("```\nOnce upon a time")
    assert "_hparams_/experiment" in events.PluginTagToContent("hparams")
    mfu = [v for _, v in scalars(run_dir, "train/mfu")]
    assert all(0 < v < 1 for v in mfu)


def ctrl_c_during_step(monkeypatch, step):
    """Send this process SIGINT while the next run draws its batch for `step`; returns a
    function that takes the interruption away again."""
    draw, calls = BatchSampler.next_batch, []

    def next_batch_then_ctrl_c(self, device="cpu"):
        if self.path.name == "train.bin":
            calls.append(1)
            if len(calls) == step:
                os.kill(os.getpid(), signal.SIGINT)
        return draw(self, device)

    def uninterrupt():
        monkeypatch.setattr(BatchSampler, "next_batch", draw)
        # A resume in this process, in the same second: TensorBoard reads a run's event files in
        # the order of their names, events.out.tfevents.<second>.<host>.<pid>.<n>, where the
        # process's 10th file sorts before its 9th. A resume in a new process never meets this.
        time.sleep(1 - time.time() % 1)

    monkeypatch.setattr(BatchSampler, "next_batch", next_batch_then_ctrl_c)
    return uninterrupt


def assert_same_run(run_dir, full_dir, metrics, full_metrics):
    """The losses, final metrics and both checkpoints' weights are bit for bit the same."""
    assert metrics["val_loss"] == full_metrics["val_loss"]
    assert scalars(run_dir, "train/loss") == scalars(full_dir, "train/loss")
    assert scalars(run_dir, "val/loss") == scalars(full_dir, "val/loss")
    for tag in ("last", "best"):
        resumed, uninterrupted = weights(run_dir, tag), weights(full_dir, tag)
        assert resumed.keys() == uninterrupted.keys()
        assert all(torch.equal(resumed[k], uninterrupted[k]) for k in resumed)


@pytest.mark.slow
def test_resume_after_sigint_matches_the_uninterrupted_run_bit_for_bit(
        corpus, trained_run, tmp_path, monkeypatch):
    run_dir = tmp_path / "run"
    cfg = run_config(corpus, run_dir, *TRAINED_RUN)
    uninterrupt = ctrl_c_during_step(monkeypatch, 13)
    with pytest.raises(TrainingInterrupted) as stopped:
        train(cfg)
    assert stopped.value.signum == signal.SIGINT and stopped.value.step == 13
    assert stopped.value.checkpoint.name == "step-0000013"
    uninterrupt()

    cfg.train.resume = True
    metrics = train(cfg)
    full_dir, full_metrics = trained_run
    assert_same_run(run_dir, full_dir, metrics, full_metrics)


@pytest.mark.slow
@pytest.mark.parametrize("no_symlinks", ["windows"], indirect=True)  # vfat: test_checkpoint
def test_where_no_symlink_can_be_made_a_run_stops_and_resumes_through_its_tag_files(
        corpus, trained_run, tmp_path, monkeypatch, no_symlinks):
    run_dir = tmp_path / "run"
    cfg = run_config(corpus, run_dir, *TRAINED_RUN)
    uninterrupt = ctrl_c_during_step(monkeypatch, 13)
    with pytest.raises(TrainingInterrupted) as stopped:
        train(cfg)
    assert stopped.value.checkpoint.name == "step-0000013"  # read through the `last` tag file
    uninterrupt()

    cfg.train.resume = True
    metrics = train(cfg)
    checkpoints = run_dir / "checkpoints"
    assert not any(p.is_symlink() for p in checkpoints.iterdir())
    assert (checkpoints / "last").read_text(encoding="utf-8") == "step-0000030\n"
    assert Path(metrics["checkpoint"]).name == "step-0000030"
    full_dir, full_metrics = trained_run
    assert_same_run(run_dir, full_dir, metrics, full_metrics)


@pytest.mark.slow
def test_threads_auto_resumes_with_the_count_the_run_started_with(
        corpus, tmp_path, monkeypatch, caplog):
    """auto would choose 1 thread as the resume starts (a program was briefly busy): the resume
    starts with the count its checkpoint was trained with, 2, not a start-up guess, and, as the
    machine is quiet again at its evaluations, ends with exactly the weights and losses of the
    uninterrupted run."""
    guesses = []  # what auto chooses next, once each; then 2

    def auto(setting, since=None):
        return tinylm.device.ThreadChoice(guesses.pop(0) if guesses else 2, "auto: test")

    monkeypatch.setattr(tinylm.device, "choose_threads", auto)
    # wide enough that 1 and 2 threads give other losses in the last digits (at n_embd 32 not)
    overrides = ["train.threads=auto", "model.dropout=0.1", "train.max_steps=12",
                 "train.eval_interval=6", "train.checkpoint_interval=6", "model.n_embd=128",
                 "model.block_size=64", "train.batch_size=16"]
    full_metrics = train(run_config(corpus, tmp_path / "full", *overrides))
    run_dir = tmp_path / "run"
    cfg = run_config(corpus, run_dir, *overrides)
    uninterrupt = ctrl_c_during_step(monkeypatch, 8)
    with pytest.raises(TrainingInterrupted):
        train(cfg)
    uninterrupt()

    guesses.append(1)
    cfg.train.resume = True
    caplog.clear()  # the start-up lines of the runs above
    with caplog.at_level("INFO", logger="tinylm.train"):
        metrics = train(cfg)
    assert_same_run(run_dir, tmp_path / "full", metrics, full_metrics)
    start_up = next(r.message for r in caplog.records if r.message.startswith("Model:"))
    assert "float32 on cpu, 2 threads (resumed run's count)" in start_up
    assert guesses == []  # asked, and not followed


@pytest.mark.slow
def test_threads_auto_takes_its_share_again_at_each_evaluation(corpus, tmp_path, monkeypatch,
                                                               caplog):
    """A run that started while another program was busy does not keep 1 thread for good: at
    each evaluation auto looks at the cores again (since the last look) and follows them; the
    count in effect is the one a checkpoint saves."""
    guesses, looked = [2, 1, 2], []  # at the start, at step 10, at step 20; then as it is

    def auto(setting, since=None):
        looked.append(since)
        count = guesses.pop(0) if guesses else 2
        return tinylm.device.ThreadChoice(count, "auto: test")

    monkeypatch.setattr(tinylm.device, "choose_threads", auto)
    saved, rank_state = [], tinylm.train.trainer.rank_state
    monkeypatch.setattr(tinylm.train.trainer, "rank_state",
                        lambda *args: saved.append(args[-1]) or rank_state(*args))
    before = torch.get_num_threads()
    with caplog.at_level("INFO", logger="tinylm.train"):
        train(run_config(corpus, tmp_path / "run", "train.threads=auto"))
    assert torch.get_num_threads() == before  # set back afterwards
    said = [r.message for r in caplog.records if "threads" in r.message and "->" in r.message]
    assert said == ["step 10: threads 2 -> 1 thread (auto: test)",
                    "step 20: threads 1 -> 2 threads (auto: test)"]
    assert len(looked) == 4 and all(since is not None for since in looked[1:])  # since a look
    assert saved == [1, 2, 2]  # at the checkpoints of steps 10, 20 and 30


@pytest.mark.slow
def test_a_resume_with_another_explicit_thread_count_uses_it_and_says_so(
        corpus, trained_run, tmp_path, caplog):
    source = resolve_checkpoint_dir(trained_run[0], "last")  # trained with train.threads=1
    with caplog.at_level("INFO", logger="tinylm.train"):
        train(run_config(corpus, tmp_path / "more", "model.dropout=0.1", "train.max_steps=31",
                         "train.threads=2", f"train.resume={source}"))
    start_up = next(r.message for r in caplog.records if r.message.startswith("Model:"))
    assert "2 threads (set)" in start_up
    assert any("train.threads=2, the checkpoint was trained with 1: the losses and weights "
               "may then differ in the last digits" in r.message for r in caplog.records)


@pytest.mark.slow
def test_threads_auto_is_chosen_at_start_and_said_in_the_start_up_line(
        corpus, tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(tinylm.device, "usable_cpus", lambda: [0, 1, 2])
    monkeypatch.setattr(tinylm.device, "busy_cpus", lambda cpus, since=None: (1.0, "test"))
    before = torch.get_num_threads()
    with caplog.at_level("INFO", logger="tinylm.train"):
        train(run_config(corpus, tmp_path / "run", "train.threads=auto", "train.max_steps=2"))
    assert torch.get_num_threads() == before  # set back afterwards
    start_up = next(r.message for r in caplog.records if r.message.startswith("Model:"))
    assert "float32 on cpu, 2 threads (auto: 3 usable cores, 1.0 busy with other work (test))" \
        in start_up


@pytest.mark.slow
def test_resume_from_a_checkpoint_path_continues_into_a_new_run_dir(corpus, trained_run, tmp_path):
    full_dir, _ = trained_run
    source = resolve_checkpoint_dir(full_dir, "best")
    cfg = run_config(corpus, tmp_path / "more", "model.dropout=0.1", "train.max_steps=35",
                     f"train.resume={source}")
    metrics = train(cfg)
    assert metrics["step"] == 35
    assert [s for s, _ in scalars(tmp_path / "more", "train/loss")] == list(range(31, 36))


@pytest.mark.slow
def test_a_crash_while_saving_leaves_the_previous_checkpoint_loadable(
        corpus, tmp_path, monkeypatch):
    save = torch.save
    monkeypatch.setattr(tinylm.checkpoint.torch, "save",
                        torch_save_failing_at(3, OSError("disk full")))
    with pytest.raises(OSError, match="disk full"):
        train(run_config(corpus, tmp_path / "run"))
    monkeypatch.setattr(tinylm.checkpoint.torch, "save", save)
    ckpt = load_checkpoint(tmp_path / "run", prefer="last")
    assert ckpt.directory.name == "step-0000020"
    assert torch.load(ckpt.trainer_state_path, weights_only=True)["step"] == 20


@pytest.mark.slow
def test_nan_loss_stops_the_run_and_keeps_the_last_good_checkpoint(
        corpus, tmp_path, monkeypatch):
    cross_entropy, calls = tinylm.model.lm_head_cross_entropy, []

    def nan_from_step_15(*args, **kwargs):
        calls.append(1)
        loss = cross_entropy(*args, **kwargs)
        return loss * float("nan") if torch.is_grad_enabled() and len(calls) > 16 else loss

    monkeypatch.setattr(tinylm.model, "lm_head_cross_entropy", nan_from_step_15)
    with pytest.raises(TrainingDiverged, match=r"at step 15: loss nan; the last good "
                                               r"checkpoint is .*step-0000010"):
        train(run_config(corpus, tmp_path / "run"))
    ckpt = load_checkpoint(tmp_path / "run", prefer="last")
    assert ckpt.directory.name == "step-0000010"
    assert all(torch.isfinite(p).all() for p in ckpt.model.parameters())


# ----------------------------------------------------------------------------- bad input


def test_block_size_longer_than_the_corpus_is_refused_by_name(corpus, tmp_path):
    with pytest.raises(ConfigError, match=r"model.block_size \+ 1 = 100001"):
        train(run_config(corpus, tmp_path / "run", "model.block_size=100000"))
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_fresh_run_into_a_run_dir_with_checkpoints_is_refused(corpus, trained_run):
    full_dir, _ = trained_run
    with pytest.raises(ConfigError, match="already holds checkpoints.*train.resume=true"):
        train(run_config(corpus, full_dir))


def test_resume_without_a_checkpoint_is_refused(corpus, tmp_path):
    with pytest.raises(ConfigError, match="train.resume=true but .* holds no checkpoint"):
        train(run_config(corpus, tmp_path / "run", "train.resume=true"))


@pytest.mark.parametrize("override, difference", [
    ("model.n_layer=3", "model.n_layer: checkpoint 2, this run 3"),
    ("tokenizer.vocab_size=280", "tokenizer.vocab_size: checkpoint 300, this run 280"),
    ("optim=adamw", r"optim.name: checkpoint 'muon', this run 'adamw' \(add optim=muon\)"),
])
def test_resume_from_a_checkpoint_of_another_shape_or_tokenizer_says_what_differs(
        corpus, trained_run, tmp_path, override, difference):
    full_dir, _ = trained_run
    with pytest.raises(ConfigError, match=f"cannot resume from .*{difference}"):
        train(run_config(corpus, tmp_path / "run", override, f"train.resume={full_dir}"))


@pytest.mark.slow
@pytest.mark.parametrize("max_steps", [30, 20])
def test_resume_from_a_checkpoint_at_or_past_max_steps_is_refused_before_any_work(
        corpus, trained_run, tmp_path, max_steps):
    full_dir, metrics = trained_run
    assert metrics["step"] == 30
    with pytest.raises(ConfigError, match=f"it is at step 30, and train.max_steps={max_steps} "
                                          "leaves nothing to train; raise train.max_steps"):
        train(run_config(corpus, tmp_path / "run", f"train.max_steps={max_steps}",
                         f"train.resume={full_dir}"))
    assert not (tmp_path / "run" / "checkpoints").exists()


# ------------------------------------------------------------------ the command line


def tinylm_train(*args, cwd, timeout=240):
    return subprocess.run([sys.executable, str(project_root() / "scripts" / "train.py"), *args],
                          cwd=cwd, capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow
def test_command_line_trains_prints_next_steps_and_refuses_bad_input_in_one_line(
        corpus, tmp_path):
    args = [*TINY, f"data.files=[{corpus / 'stories.txt'}]", f"data.cache_dir={corpus / 'cache'}"]
    done = tinylm_train(*args, "train.max_steps=10", "hydra.run.dir=runs/one", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    run_dir = tmp_path / "runs" / "one"
    assert (run_dir / "train.log").is_file()
    assert resolve_checkpoint_dir(run_dir / "checkpoints" / "best").is_dir()
    assert "checkpoints: runs/one/checkpoints/best -> step-0000010" in done.stdout
    assert "tensorboard --logdir runs/one" in done.stdout
    # the printed generate command works as printed
    (generate,) = [line for line in done.stdout.splitlines() if "tinylm-generate" in line]
    # a data=text run: the prompt is its corpus's first words
    assert shlex.split(generate)[1:] == ["checkpoint=runs/one", 'prompt="Once upon a time,"']
    sample = run_cli("tinylm.cli.generate", *shlex.split(generate)[1:], "max_new_tokens=5",
                     cwd=tmp_path)
    assert sample.returncode == 0 and sample.stdout.startswith("Once upon a time"), sample.stderr

    bad = tinylm_train("model.n_embd=33", cwd=tmp_path)
    assert bad.returncode == 1 and bad.stderr.strip().splitlines() == [
        "tinylm-train: error: model.n_embd=33 is not allowed: must be divisible by "
        "model.n_head=4"]


@pytest.mark.slow
def test_compile_without_a_cpp_compiler_stops_in_one_line_that_says_what_to_do(corpus, tmp_path):
    # Windows without Visual Studio's build tools, a Mac without Xcode's: inductor finds no
    # compiler for its CPU kernels at the first step
    args = [*TINY, f"data.files=[{corpus / 'stories.txt'}]", f"data.cache_dir={corpus / 'cache'}"]
    done = subprocess.run([sys.executable, "-m", "tinylm.cli.train", *args, "train.compile=true",
                           "train.max_steps=2", "hydra.run.dir=run"], cwd=tmp_path,
                          env={**os.environ, "CXX": str(tmp_path / "no-such-g++")},
                          capture_output=True, text=True, timeout=240)
    assert done.returncode == 1
    assert done.stderr.strip().splitlines()[-1] == (
        "tinylm-train: error: train.compile=true: torch.compile builds CPU kernels with a C++ "
        "compiler and found none (No working C++ compiler found in "
        f"torch._inductor.config.cpp.cxx: (None, '{tmp_path / 'no-such-g++'}')); install one "
        "(g++ or clang++; on Windows, Visual Studio's Build Tools) or name it in the CXX "
        "environment variable, or train with train.compile=false")
    assert not (tmp_path / "run" / "checkpoints").exists()


@pytest.mark.slow
def test_sweep_writes_one_run_dir_per_job(corpus, tmp_path):
    args = [*TINY, f"data.files=[{corpus / 'stories.txt'}]", f"data.cache_dir={corpus / 'cache'}"]
    done = tinylm_train("-m", *args, "train.max_steps=5", "train.seed=1,2",
                        "hydra.sweep.dir=sweep", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    for job in ("0", "1"):
        assert resolve_checkpoint_dir(tmp_path / "sweep" / job / "checkpoints" / "last").is_dir()


def start_training(args, cwd, until_step):
    """Start scripts/train.py and return once its `last` checkpoint has reached `until_step`."""
    # stderr to a file: an unread pipe could fill up with the progress bar and block training
    with open(cwd / "stderr.txt", "w") as stderr:
        proc = subprocess.Popen([sys.executable, str(project_root() / "scripts" / "train.py"),
                                 *args], cwd=cwd, stdout=subprocess.DEVNULL, stderr=stderr)
    last, deadline = cwd / "run" / "checkpoints" / "last", time.monotonic() + 180
    while not (last.is_file() and last.read_text() >= f"step-{until_step:07d}"):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"no step {until_step}: {(cwd / 'stderr.txt').read_text()[-3000:]}")
        time.sleep(0.05)
    return proc


@pytest.mark.slow
def test_sigterm_saves_and_kill_9_at_any_moment_leaves_the_last_checkpoint_loadable(
        corpus, tmp_path):
    args = [*TINY, f"data.files=[{corpus / 'stories.txt'}]", f"data.cache_dir={corpus / 'cache'}",
            "train.max_steps=100000", "train.checkpoint_interval=1", "hydra.run.dir=run"]
    proc = start_training(args, tmp_path, until_step=3)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 128 + signal.SIGTERM
    stderr = (tmp_path / "stderr.txt").read_text()
    saved = load_checkpoint(tmp_path / "run", prefer="last").directory.name
    assert f"stopped by SIGTERM at step {int(saved[5:])}; saved " in stderr
    assert "tinylm-train train.resume=true hydra.run.dir=" in stderr

    # a checkpoint every step: kill -9 at a random moment, most likely in the middle of one
    proc = start_training([*args, "train.resume=true"], tmp_path, until_step=int(saved[5:]) + 3)
    time.sleep(random.uniform(0.0, 0.5))
    proc.kill()
    proc.wait()
    ckpt = load_checkpoint(tmp_path / "run", prefer="last")
    step = torch.load(ckpt.trainer_state_path, weights_only=True)["step"]
    assert step >= int(saved[5:]) + 3 and ckpt.directory.name == f"step-{step:07d}"
    resumed = tinylm_train(*args[:-3], f"train.max_steps={step + 2}", "train.resume=true",
                           "hydra.run.dir=run", cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr
    assert (tmp_path / "run" / "checkpoints" / "last").read_text() == f"step-{step + 2:07d}\n"
