"""Behaviour of tinylm.checkpoint: round trip, tags, atomic writes, clear errors on bad files."""

import errno
import json
import os
import subprocess
import sys

import pytest
import torch

import tinylm.checkpoint
from tinylm.checkpoint import (
    WEIGHTS_FILE,
    load_checkpoint,
    resolve_checkpoint_dir,
    run_dir_lock,
    save_checkpoint,
)
from tinylm.tokenizer import CharTokenizer

TEXT = "Lily saw a cat. She said hello to it.\n"


@pytest.fixture
def tiny(tiny_model):
    """tiny(seed=0): a 1-layer model in training mode and the char tokenizer of TEXT."""
    def build(seed=0):
        tokenizer = CharTokenizer.train([TEXT])
        return tiny_model(tokenizer.vocab_size, seed, block_size=16, n_layer=1,
                          n_embd=8).train(), tokenizer
    return build


def test_round_trip_rebuilds_the_same_model_and_tokenizer(tiny, tmp_path):
    model, tokenizer = tiny()
    state = {"step": torch.tensor(7), "rng": torch.get_rng_state()}
    save_checkpoint(tmp_path, model, tokenizer, {"train": {"seed": 1}}, step=7, trainer_state=state)

    ckpt = load_checkpoint(tmp_path)
    assert ckpt.config == model.config
    for (name, p), q in zip(model.state_dict().items(), ckpt.model.state_dict().values(),
                            strict=True):
        assert torch.equal(p, q), name
    assert ckpt.model.lm_head.weight is ckpt.model.wte.weight  # tying survives the round trip
    assert ckpt.tokenizer.encode(TEXT) == tokenizer.encode(TEXT)
    assert ckpt.run_config == {"train": {"seed": 1}}
    loaded_state = torch.load(ckpt.trainer_state_path, weights_only=True)
    assert loaded_state["step"].item() == 7 and torch.equal(loaded_state["rng"], state["rng"])
    assert not ckpt.model.training


def test_last_and_best_point_at_step_directories_and_old_ones_are_removed(tiny, tmp_path):
    model, tokenizer = tiny()
    save_checkpoint(tmp_path, model, tokenizer, {}, step=1, tags=("last", "best"))
    save_checkpoint(tmp_path, model, tokenizer, {}, step=2, tags=("last",))
    save_checkpoint(tmp_path, model, tokenizer, {}, step=3, tags=("last",))
    checkpoints = tmp_path / "checkpoints"
    assert os.readlink(checkpoints / "last") == "step-0000003"
    assert os.readlink(checkpoints / "best") == "step-0000001"
    assert sorted(p.name for p in checkpoints.iterdir()) == [
        "best", "last", "step-0000001", "step-0000003"]
    assert resolve_checkpoint_dir(tmp_path).name == "step-0000001"  # generation prefers best
    assert resolve_checkpoint_dir(tmp_path, prefer="last").name == "step-0000003"
    assert resolve_checkpoint_dir(checkpoints / "last").name == "step-0000003"


def test_where_no_symlink_can_be_made_tags_are_files_naming_their_step(
        tiny, tmp_path, no_symlinks):
    model, tokenizer = tiny()
    save_checkpoint(tmp_path, model, tokenizer, {}, step=1, tags=("last", "best"))
    save_checkpoint(tmp_path, model, tokenizer, {}, step=2, tags=("last",))
    save_checkpoint(tmp_path, model, tokenizer, {}, step=3, tags=("last",))
    checkpoints = tmp_path / "checkpoints"
    assert not any(p.is_symlink() for p in checkpoints.iterdir())
    assert (checkpoints / "last").read_text(encoding="utf-8") == "step-0000003\n"
    assert (checkpoints / "best").read_text(encoding="utf-8") == "step-0000001\n"
    assert sorted(p.name for p in checkpoints.iterdir()) == [
        "best", "last", "step-0000001", "step-0000003"]
    assert resolve_checkpoint_dir(tmp_path).name == "step-0000001"
    assert resolve_checkpoint_dir(tmp_path, prefer="last").name == "step-0000003"
    assert resolve_checkpoint_dir(checkpoints / "last").name == "step-0000003"
    assert load_checkpoint(checkpoints / "best").config == model.config


def test_a_failure_other_than_a_disk_without_symlinks_is_not_hidden(tiny, tmp_path,
                                                                      monkeypatch):
    model, tokenizer = tiny()

    def disk_full(target, link):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(tinylm.checkpoint.os, "symlink", disk_full)
    with pytest.raises(OSError, match="No space left on device"):
        save_checkpoint(tmp_path, model, tokenizer, {}, step=1)
    assert not (tmp_path / "checkpoints" / "last").exists()


@pytest.mark.parametrize("content", ["../../elsewhere\n", "step-0000001/../../elsewhere\n",
                                     "/etc\n", ""])
def test_a_tag_file_naming_anything_but_a_step_beside_it_names_nothing(tiny, tmp_path, content):
    model, tokenizer = tiny()
    save_checkpoint(tmp_path, model, tokenizer, {}, step=1, tags=("best",))
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "checkpoints" / "last").write_text(content, encoding="utf-8")
    assert resolve_checkpoint_dir(tmp_path, prefer="last").name == "step-0000001"  # best's
    with pytest.raises(FileNotFoundError, match="names no checkpoint directory beside it"):
        resolve_checkpoint_dir(tmp_path / "checkpoints" / "last")


def test_saving_the_same_step_twice_keeps_both_complete(tiny, tmp_path):
    model, tokenizer = tiny()
    first = save_checkpoint(tmp_path, model, tokenizer, {}, step=5, tags=("best",))
    second = save_checkpoint(tmp_path, model, tokenizer, {}, step=5, tags=("last",))
    assert first != second
    assert (first / WEIGHTS_FILE).is_file() and (second / WEIGHTS_FILE).is_file()


@pytest.mark.slow
def test_a_crash_during_save_leaves_the_previous_checkpoint_loadable(tiny, tmp_path):
    model, tokenizer = tiny(seed=0)
    save_checkpoint(tmp_path, model, tokenizer, {}, step=1)
    expected = {k: v.clone() for k, v in model.state_dict().items()}

    # a child process saves step 2 and is killed (SIGKILL) half way, inside the weights write
    script = f"""
import os, signal, torch, safetensors.torch as st
from tinylm.checkpoint import save_checkpoint
from tinylm.model import ModelConfig, TinyLM
from tinylm.tokenizer import CharTokenizer
tok = CharTokenizer.train([{TEXT!r}])
torch.manual_seed(99)
model = TinyLM(ModelConfig(vocab_size=tok.vocab_size, block_size=16, n_layer=1, n_head=2, n_embd=8))
real = st.save_model
def dying_save(m, path, *a, **k):
    real(m, path, *a, **k)
    with open(path, "r+b") as f:
        f.truncate(100)  # a half-written file on disk
    os.kill(os.getpid(), signal.SIGKILL)
st.save_model = dying_save
save_checkpoint({str(tmp_path)!r}, model, tok, {{}}, step=2)
"""
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert proc.returncode == -9, proc.stderr

    ckpt = load_checkpoint(tmp_path, prefer="last")
    assert ckpt.directory.name == "step-0000001"
    for name, value in ckpt.model.state_dict().items():
        assert torch.equal(value, expected[name]), name
    # the next writer of the run directory, holding its lock, clears the leftover
    with run_dir_lock(tmp_path):
        save_checkpoint(tmp_path, model, tokenizer, {}, step=3)
    assert not [p for p in (tmp_path / "checkpoints").iterdir() if p.name.startswith(".tmp-")]


def test_missing_path_names_it(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_checkpoint(tmp_path / "nope")
    with pytest.raises(FileNotFoundError, match="no checkpoint found in"):
        load_checkpoint(tmp_path)


def test_truncated_weights_name_the_file(tiny, tmp_path):
    model, tokenizer = tiny()
    directory = save_checkpoint(tmp_path, model, tokenizer, {}, step=1)
    weights = directory / WEIGHTS_FILE
    weights.write_bytes(weights.read_bytes()[:200])
    with pytest.raises(ValueError, match=str(weights)):
        load_checkpoint(directory)


def test_weights_that_do_not_fit_the_config_name_both_files(tiny, tmp_path):
    model, tokenizer = tiny()
    directory = save_checkpoint(tmp_path, model, tokenizer, {}, step=1)
    config_file = directory / "model_config.json"
    values = json.loads(config_file.read_text())
    values["n_embd"], values["n_head"] = 16, 4
    config_file.write_text(json.dumps(values))
    with pytest.raises(ValueError, match="model_config.json describes"):
        load_checkpoint(directory)


def test_missing_tokenizer_and_vocab_mismatch_are_named(tiny, tmp_path):
    model, tokenizer = tiny()
    directory = save_checkpoint(tmp_path, model, tokenizer, {}, step=1)
    other = CharTokenizer.train(["abc"])
    other.save(str(directory / "tokenizer.json"))
    with pytest.raises(ValueError, match="tokenizer.json has .* tokens but .*vocab_size="):
        load_checkpoint(directory)
    (directory / "tokenizer.json").unlink()
    with pytest.raises(FileNotFoundError, match="missing its tokenizer"):
        load_checkpoint(directory)


def test_weights_are_never_unpickled(tiny, tmp_path):
    model, tokenizer = tiny()
    directory = save_checkpoint(tmp_path, model, tokenizer, {}, step=1)
    assert (directory / WEIGHTS_FILE).read_bytes()[8:9] == b"{"  # safetensors' JSON header


def test_unknown_tag_is_refused(tiny, tmp_path):
    model, tokenizer = tiny()
    with pytest.raises(ValueError, match="tag 'latest' is not allowed; allowed: last, best"):
        save_checkpoint(tmp_path, model, tokenizer, {}, step=2, tags=("latest",))
