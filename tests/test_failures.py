"""The failures an adversarial run found (issue 14), each now one line naming what is wrong, with
nothing lost and nothing left behind: divergence, two writers, a full disk, broken or hostile
files, and the smaller edges of the commands. (Wrong config values: tests/test_cli.py.)"""

import errno
import logging
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest
import torch
from helpers import run_config, save_run, torch_save_failing_at

import tinylm.checkpoint
import tinylm.inspection.probe_items
from tinylm.checkpoint import RunDirInUse, load_checkpoint, resolve_checkpoint_dir, save_checkpoint
from tinylm.cli import run_or_exit
from tinylm.cli.generate import GenerateConfig, run_generate
from tinylm.cli.probe import ProbeConfig, run_probe
from tinylm.corpus import resolve_files
from tinylm.data import check_enough_tokens
from tinylm.generate import generate
from tinylm.inspection.probe_items import ProbeFileError
from tinylm.inspection.probe_types import load_probe_file
from tinylm.tokenizer import CharTokenizer, load_tokenizer
from tinylm.train.resume import TRAINER_STATE_KEYS, load_trainer_state
from tinylm.train.runtime import StoppedAgain
from tinylm.train.trainer import Trainer, TrainingDiverged, train

TEXT = "Lily saw a cat. She was happy. Tom saw a dog. He was sad."


@pytest.fixture
def saved_run(tmp_path, tiny_model):
    tokenizer = CharTokenizer.train([TEXT])
    return save_run(tmp_path / "run", tiny_model(tokenizer.vocab_size), tokenizer)


def listing(directory):
    return sorted(str(p.relative_to(directory)) for p in directory.rglob("*"))


def one_line(err) -> str:
    text = str(err.value)
    assert "\n" not in text
    return text


# ------------------------------------------------------------------------ divergence


@pytest.mark.slow
def test_weights_that_are_not_finite_are_never_saved_as_a_good_checkpoint(
        corpus, tmp_path, monkeypatch):
    step = Trainer.train_step

    def inf_weights_at_step_12(self, stop):
        out = step(self, stop)
        if self.step == 12:  # what optim.lr=1e39 does: the loss is still finite, the weights not
            with torch.no_grad():
                next(self.model.parameters()).fill_(math.inf)
        return out

    monkeypatch.setattr(Trainer, "train_step", inf_weights_at_step_12)
    run_dir = tmp_path / "run"
    with pytest.raises(TrainingDiverged) as stopped:
        train(run_config(corpus, run_dir, "train.checkpoint_interval=1"))
    kept = run_dir / "checkpoints" / "step-0000011"
    assert one_line(stopped).startswith("training diverged by step 12: the weights are not "
                                        "finite (wte.weight holds NaN or inf); the last good "
                                        f"checkpoint is {kept}")
    # the checkpoint it names loads and generates
    ckpt = load_checkpoint(run_dir, prefer="last")
    assert ckpt.directory == kept
    out = generate(ckpt.model, torch.tensor([[0]]), 5, temperature=1.0,
                   generator=torch.Generator().manual_seed(0))
    assert out.shape == (1, 6)
    assert not [p for p in listing(run_dir) if ".tmp" in p]


@pytest.mark.slow
def test_a_learning_rate_that_blows_the_weights_up_saves_nothing(corpus, tmp_path):
    run_dir = tmp_path / "run"
    with pytest.raises(TrainingDiverged) as stopped:
        train(run_config(corpus, run_dir, "optim.lr=1e39", "optim.warmup_steps=0",
                         "train.checkpoint_interval=1"))
    assert "no checkpoint was saved yet" in one_line(stopped)
    assert not (run_dir / "checkpoints" / "last").exists()


# ----------------------------------------------------------------- one writer per run dir

HOLD_LOCK = """
import sys, time
from tinylm.checkpoint import run_dir_lock
with run_dir_lock(sys.argv[1]):
    print("held", flush=True)
    time.sleep(120)
"""


@pytest.mark.slow
def test_a_second_writer_is_refused_naming_the_holder_and_a_killed_one_blocks_nothing(
        corpus, tmp_path):
    run_dir = tmp_path / "run"
    holder = subprocess.Popen([sys.executable, "-c", HOLD_LOCK, str(run_dir)],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(RunDirInUse) as refused:
            train(run_config(corpus, run_dir))
        assert one_line(refused) == (f"{run_dir} is in use by another process (pid "
                                     f"{holder.pid}); wait for it to end or choose another "
                                     "hydra.run.dir")
        assert not (run_dir / "checkpoints").exists()  # the refused run wrote nothing
    finally:
        holder.kill()  # kill -9: the lock file stays, but the OS dropped the lock
        holder.wait()
    metrics = train(run_config(corpus, run_dir, "train.max_steps=10"))
    assert metrics["step"] == 10
    assert not (run_dir / ".lock.pid").exists()


# ------------------------------------------------------------------------------ full disk


@pytest.mark.slow
def test_a_full_disk_stops_in_one_line_leaves_nothing_behind_and_the_resume_works(
        corpus, tmp_path, monkeypatch):
    save = torch.save
    monkeypatch.setattr(tinylm.checkpoint.torch, "save", torch_save_failing_at(
        2, OSError(errno.ENOSPC, "No space left on device")))
    run_dir = tmp_path / "run"
    with pytest.raises(OSError) as stopped:
        train(run_config(corpus, run_dir))
    checkpoints = run_dir / "checkpoints"
    message = one_line(stopped)  # what tinylm-train adds to it: tests/test_train_faults.py
    assert message.startswith(f"{checkpoints / 'step-0000020' / 'trainer_state.pt'} could not be "
                              "written: No space left on device (")
    assert sorted(p.name for p in checkpoints.iterdir()) == ["best", "last", "step-0000010"]

    monkeypatch.setattr(tinylm.checkpoint.torch, "save", save)  # space freed
    metrics = train(run_config(corpus, run_dir, "train.resume=true"))
    assert metrics["step"] == 30


# ------------------------------------------------------------- broken or hostile files


class Payload:
    def __reduce__(self):
        return (print, ("this ran",))


@pytest.mark.parametrize("write, message", [
    (lambda f: f.write_bytes(f.read_bytes()[:200]), "it cannot be read (truncated or corrupt"),
    (lambda f: torch.save({k: v for k, v in torch.load(f, weights_only=True).items()
                           if k != "optimizer"}, f), "it lacks optimizer"),
    (lambda f: torch.save({"step": Payload()}, f),
     "it holds objects that only an unsafe load could build; it was not loaded"),
])
def test_a_broken_or_hostile_trainer_state_is_refused_naming_the_file(
        saved_run, write, message, capfd):
    ckpt = load_checkpoint(saved_run)
    save_checkpoint(saved_run, ckpt.model, ckpt.tokenizer, {}, step=2,
                    trainer_state={k: 0 for k in TRAINER_STATE_KEYS})
    state = resolve_checkpoint_dir(saved_run, "last") / "trainer_state.pt"
    write(state)
    with pytest.raises(ValueError) as refused:
        load_trainer_state(state)
    text = one_line(refused)
    assert text == f"{state} is not a tinylm trainer state: {message}" or \
        text.startswith(f"{state} is not a tinylm trainer state: {message}")
    assert "weights_only" not in text
    assert "this ran" not in capfd.readouterr().out


@pytest.mark.parametrize("content, message", [
    (b'{"model": {"type": "BPE"}}', "is not a usable BPE tokenizer"),
    (os.urandom(64) + b"\xff", "is not a tokenizer"),
])
def test_a_broken_tokenizer_file_is_refused_naming_it(tmp_path, content, message):
    path = tmp_path / "tokenizer.json"
    path.write_bytes(content)
    with pytest.raises(ValueError) as refused:
        load_tokenizer(path)
    assert one_line(refused).startswith(f"{path} {message}")


def test_an_absurd_model_config_is_refused_before_allocating(saved_run):
    directory = resolve_checkpoint_dir(saved_run)
    config = directory / "model_config.json"
    config.write_text(config.read_text().replace('"n_embd": 16', '"n_embd": 400000000'))
    start = time.perf_counter()
    with pytest.raises(ValueError) as refused:
        load_checkpoint(saved_run)
    assert time.perf_counter() - start < 5
    assert one_line(refused).startswith(f"{config} describes a model of ")
    assert f"parameters but {directory / 'model.safetensors'} holds " in str(refused.value)


# ------------------------------------------------------------------------- smaller edges


def test_probe_out_as_a_directory_is_refused_before_writing(saved_run, tmp_path):
    before = listing(tmp_path)
    with pytest.raises(ValueError) as refused:
        run_probe(ProbeConfig(checkpoint=str(saved_run), out=str(tmp_path)))
    assert one_line(refused) == (f"out={tmp_path} is a directory; name the report file, e.g. "
                                 f"out={tmp_path / 'probe.json'}")
    assert listing(tmp_path) == before


@pytest.mark.parametrize("line, message", [
    (b'{"text": "caf\xe9"}\n', "line 2: not valid UTF-8 (byte 14 of the line: invalid "
                               "continuation byte)"),
    (b"[" * 100_000 + b"]" * 100_000 + b"\n", "line 2: JSON nested too deeply to be a probe item"),
])
def test_a_bad_probe_line_is_named_by_file_and_line(tmp_path, line, message):
    path = tmp_path / "probes.jsonl"
    path.write_bytes(b"\n" + line)
    with pytest.raises(ProbeFileError) as refused:
        load_probe_file(path)
    assert one_line(refused) == f"{path}, {message}"


def test_a_directory_in_data_files_is_named_as_one(tmp_path):
    (tmp_path / "notes").mkdir()
    with pytest.raises(ValueError) as refused:
        resolve_files(tmp_path, ["notes"], "text", "data.data_root")
    assert one_line(refused) == (f"data.files: notes is a directory ({tmp_path / 'notes'}); "
                                 "name the files in it, e.g. 'data.files=[notes/*.txt]'")


def test_too_short_a_split_gets_advice_that_helps_it(tmp_path):
    prepared = SimpleNamespace(directory=tmp_path, meta={"train_tokens": 90, "val_tokens": 10})
    with pytest.raises(ValueError) as refused:
        check_enough_tokens(prepared, block_size=32)
    assert one_line(refused) == (
        f"{tmp_path / 'val.bin'} holds 10 tokens, fewer than one training window of "
        "model.block_size + 1 = 33; use model.block_size=9, a longer corpus, or a larger "
        "data.val_fraction (now the training split holds 90 tokens)")
    prepared.meta = {"train_tokens": 20, "val_tokens": 40}
    with pytest.raises(ValueError) as refused:
        check_enough_tokens(prepared, block_size=32)
    assert one_line(refused).endswith("use a longer corpus or model.block_size=19")


@pytest.mark.parametrize("interrupt, status", [
    (KeyboardInterrupt(), 130),  # Ctrl-C while starting
    (StoppedAgain(signal.SIGINT), 130),  # a second Ctrl-C
    (StoppedAgain(signal.SIGTERM), 143),  # a second SIGTERM
])
def test_interrupts_exit_as_the_shell_expects(interrupt, status, capsys):
    def action():
        raise interrupt

    with pytest.raises(SystemExit) as exited:
        run_or_exit("tinylm-train", action)
    assert exited.value.code == status
    assert capsys.readouterr().err.strip() == "tinylm-train: interrupted"


def test_a_dangling_last_link_is_reported_naming_both_steps(saved_run, caplog):
    ckpt = load_checkpoint(saved_run)
    save_checkpoint(saved_run, ckpt.model, ckpt.tokenizer, {}, step=2)  # last -> step 2
    shutil.rmtree(saved_run / "checkpoints" / "step-0000002")
    with caplog.at_level(logging.WARNING, logger="tinylm.checkpoint"):
        chosen = resolve_checkpoint_dir(saved_run, prefer="last")
    assert chosen.name == "step-0000001"
    assert caplog.messages == [f"{saved_run / 'checkpoints' / 'last'} points at step-0000002, "
                               "which is missing; using best (step-0000001) instead"]


def test_a_prompt_file_that_is_a_directory_is_named_as_one(saved_run, tmp_path):
    with pytest.raises(ValueError) as refused:
        run_generate(GenerateConfig(checkpoint=str(saved_run), prompt_file=str(tmp_path)))
    assert one_line(refused) == (f"prompt_file {tmp_path} is a folder, not a regular file; "
                                 "give a file")


@pytest.mark.parametrize("special", ["fifo", "/dev/zero", "folder"])
def test_a_probe_file_that_is_no_regular_file_is_refused_without_opening_it(special, tmp_path):
    path = {"fifo": tmp_path / "items.jsonl", "/dev/zero": "/dev/zero",
            "folder": tmp_path}[special]
    if special == "fifo":
        os.mkfifo(path)  # opened, it would wait for a writer forever
    kind = "a folder" if special == "folder" else "a pipe or device"
    with pytest.raises(ValueError, match=f"^probe file {path} is {kind}, not a regular file"):
        load_probe_file(path)


def test_a_probe_file_too_large_to_be_a_probe_set_is_refused(tmp_path, monkeypatch):
    path = tmp_path / "items.jsonl"
    path.write_text('{"text": "x"}\n' * 10)
    monkeypatch.setattr(tinylm.inspection.probe_items, "MAX_PROBE_FILE_BYTES", 100)
    with pytest.raises(ValueError, match="holds 140 bytes, more than the 100"):
        load_probe_file(path)
