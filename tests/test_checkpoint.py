"""Behaviour of tinylm.checkpoint: round trip, tags, atomic writes, clear errors on bad files."""

import json
import os
import shutil
import subprocess
import sys

import pytest
import safetensors.torch
import torch
from conftest import fill_disk
from safetensors import SafetensorError

import tinylm.checkpoint
from tinylm.checkpoint import (
    WEIGHTS_FILE,
    NonFiniteWeights,
    load_checkpoint,
    resolve_checkpoint_dir,
    run_dir_lock,
    save_checkpoint,
    tagged_checkpoint,
)
from tinylm.config import ConfigError
from tinylm.files import NotWritten
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


def save_three_steps(tiny, run_dir):
    """Steps 1 (best and last), 2 and 3 (last) of one model."""
    model, tokenizer = tiny()
    save_checkpoint(run_dir, model, tokenizer, {}, step=1, tags=("last", "best"))
    save_checkpoint(run_dir, model, tokenizer, {}, step=2, tags=("last",))
    save_checkpoint(run_dir, model, tokenizer, {}, step=3, tags=("last",))
    return model


def test_last_and_best_are_files_naming_their_step_and_old_steps_are_removed(tiny, tmp_path):
    save_three_steps(tiny, tmp_path)
    checkpoints = tmp_path / "checkpoints"
    assert (checkpoints / "last").read_text(encoding="utf-8") == "step-0000003\n"
    assert (checkpoints / "best").read_text(encoding="utf-8") == "step-0000001\n"
    assert sorted(p.name for p in checkpoints.iterdir()) == [
        "best", "last", "step-0000001", "step-0000003"]
    assert resolve_checkpoint_dir(tmp_path).name == "step-0000001"  # generation prefers best
    assert resolve_checkpoint_dir(tmp_path, prefer="last").name == "step-0000003"
    assert resolve_checkpoint_dir(checkpoints / "last").name == "step-0000003"


@pytest.mark.parametrize("no_symlinks", ["windows"], indirect=True)
def test_on_windows_the_same_tag_files_are_written_and_read(tiny, tmp_path, no_symlinks):
    model = save_three_steps(tiny, tmp_path)  # no directory opened, no read-only file flushed
    checkpoints = tmp_path / "checkpoints"
    assert (checkpoints / "last").read_text(encoding="utf-8") == "step-0000003\n"
    assert sorted(p.name for p in checkpoints.iterdir()) == [
        "best", "last", "step-0000001", "step-0000003"]
    assert load_checkpoint(checkpoints / "best").config == model.config


def test_an_older_runs_symlink_tags_still_load_and_the_next_save_writes_tag_files(
        tiny, tmp_path):
    model, tokenizer = tiny()
    first = save_checkpoint(tmp_path, model, tokenizer, {}, step=1, tags=("last", "best"))
    checkpoints = tmp_path / "checkpoints"
    for tag in ("last", "best"):  # as tinylm wrote them before tag files
        (checkpoints / tag).unlink()
        (checkpoints / tag).symlink_to(first.name)
    assert load_checkpoint(tmp_path).directory == first
    assert resolve_checkpoint_dir(checkpoints / "last") == first
    save_checkpoint(tmp_path, model, tokenizer, {}, step=2, tags=("last",))
    assert (checkpoints / "last").read_text(encoding="utf-8") == "step-0000002\n"
    assert os.readlink(checkpoints / "best") == first.name  # kept, and so is its step
    assert sorted(p.name for p in checkpoints.iterdir()) == [
        "best", "last", "step-0000001", "step-0000002"]


def test_an_interrupted_save_leaves_nothing_of_itself(tiny, tmp_path, monkeypatch):
    model, tokenizer = tiny()
    first = save_checkpoint(tmp_path, model, tokenizer, {}, step=1)

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt  # Ctrl-C, or SIGTERM (which the commands raise as it)
    monkeypatch.setattr(tinylm.checkpoint.yaml, "safe_dump", interrupted)
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(tmp_path, model, tokenizer, {}, step=2)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["last", first.name]


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
def test_a_crash_during_save_leaves_the_previous_checkpoint_loadable(tiny, tmp_path, caplog):
    model, tokenizer = tiny(seed=0)
    save_checkpoint(tmp_path, model, tokenizer, {}, step=1)
    expected = {k: v.clone() for k, v in model.state_dict().items()}

    # a child process saves step 2 and is killed (SIGKILL) half way, inside the weights write
    script = f"""
import os, signal, torch, safetensors.torch as st
from tinylm.checkpoint import save_checkpoint
from tinylm.model import ModelConfig, TinyLM
from tinylm.config import ConfigError
from tinylm.files import NotWritten
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
    leftovers = [p.name for p in (tmp_path / "checkpoints").iterdir() if p.name.startswith(".")]
    assert len(leftovers) == 1 and leftovers[0].startswith(".step-0000002.tmp-")
    with caplog.at_level("INFO", logger="tinylm.checkpoint"):
        with run_dir_lock(tmp_path):
            save_checkpoint(tmp_path, model, tokenizer, {}, step=3)
    assert caplog.messages == [f"removed what an interrupted save left in "
                               f"{tmp_path / 'checkpoints'}: {leftovers[0]}"]
    assert not [p for p in (tmp_path / "checkpoints").iterdir() if p.name.startswith(".")]


# saves a checkpoint of the tiny model at every step, as fast as it can, until told to stop
SAVING_EVERY_STEP = f"""
import sys
from pathlib import Path
from tinylm.checkpoint import save_checkpoint
from tinylm.model import ModelConfig, TinyLM
from tinylm.tokenizer import CharTokenizer
run = Path(sys.argv[1])
tok = CharTokenizer.train([{TEXT!r}])
model = TinyLM(ModelConfig(vocab_size=tok.vocab_size, block_size=16, n_layer=1, n_head=2, n_embd=8))
step = 1
while not (run / "stop").exists():
    save_checkpoint(run, model, tok, {{}}, step=step)
    step += 1
print(step - 1)
"""


def test_a_reader_of_a_run_saving_every_step_gets_the_newest_complete_checkpoint(tiny, tmp_path):
    """Another process saves a checkpoint at every step, each superseding and removing the one
    before, while checkpoints are loaded with prefer=last: every load succeeds, none goes back."""
    model, tokenizer = tiny()
    save_checkpoint(tmp_path, model, tokenizer, {}, step=0, tags=("last", "best"))
    writer = subprocess.Popen([sys.executable, "-c", SAVING_EVERY_STEP, str(tmp_path)],
                              stdout=subprocess.PIPE, text=True)
    try:
        while tagged_checkpoint(tmp_path / "checkpoints", "last").name == "step-0000000":
            assert writer.poll() is None
        steps = [int(load_checkpoint(tmp_path, prefer="last").directory.name[5:])
                 for _ in range(30)]
    finally:
        (tmp_path / "stop").touch()
        saved = int(writer.communicate(timeout=60)[0])
    # they raced: the loads met several steps (without the step lock, one in six failed here)
    assert steps == sorted(steps) and steps[0] > 0 and len(set(steps)) > 1
    # a step kept while it was read goes at the next save
    save_checkpoint(tmp_path, model, tokenizer, {}, step=saved + 1)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == [
        "best", "last", "step-0000000", f"step-{saved + 1:07d}"]


@pytest.mark.skipif(tinylm.checkpoint.fcntl is None, reason="no flock (Windows)")
def test_a_superseded_step_being_read_is_removed_by_the_next_save_after_the_read(tiny, tmp_path):
    model, tokenizer = tiny()
    first = save_checkpoint(tmp_path, model, tokenizer, {}, step=1)
    with tinylm.checkpoint._step_lock(first, shared=True) as held:  # as load_checkpoint reads
        assert held
        save_checkpoint(tmp_path, model, tokenizer, {}, step=2)
        assert (first / WEIGHTS_FILE).is_file()
    save_checkpoint(tmp_path, model, tokenizer, {}, step=3)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["last", "step-0000003"]


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


# ------------------------------------------------------------------- a full disk, for real


def pages(directory, *names):
    """What these files of a checkpoint take on a tmpfs: whole pages."""
    page = os.sysconf("SC_PAGESIZE")
    return sum(-(-(directory / name).stat().st_size // page) * page for name in names)


STATE = {"step": torch.tensor(1), "big": torch.zeros(20_000)}  # trainer_state.pt: 80 kB


@pytest.mark.parametrize("fails, room_for, raised", [
    ("tokenizer.json", [], OSError),
    ("model.safetensors", ["tokenizer.json"], SafetensorError),
    ("trainer_state.pt", ["tokenizer.json", "model.safetensors", "model_config.json",
                          "config.yaml"], OSError),  # torch's zip writer: a RuntimeError
])
def test_a_full_disk_is_one_line_whichever_file_meets_it_and_the_last_checkpoint_stays(
        tiny, small_disk, fails, room_for, raised):
    model, tokenizer = tiny()
    disk = small_disk(256)
    first = save_checkpoint(disk, model, tokenizer, {}, step=1, tags=("last", "best"))
    fill_disk(disk, leave=pages(first, *room_for))
    with pytest.raises(NotWritten) as caught:
        save_checkpoint(disk, model, tokenizer, {}, step=2, trainer_state=STATE,
                        tags=("last", "best"))
    checkpoints, said = disk / "checkpoints", str(caught.value)
    assert said.startswith(f"{checkpoints / 'step-0000002' / fails} could not be written: ")
    assert said.endswith(f"(0.0 MiB free on {disk})")
    assert "No space left on device" in said and "\n" not in said
    assert isinstance(caught.value.__cause__, raised)  # what the writer raised
    assert sorted(p.name for p in checkpoints.iterdir()) == ["best", "last", "step-0000001"]
    for tag in ("last", "best"):
        assert (checkpoints / tag).read_text(encoding="utf-8") == f"{first.name}\n"
    assert load_checkpoint(disk, prefer="last").directory == first


def test_a_full_disk_at_the_tag_switch_leaves_the_tags_as_they_were(tiny, small_disk):
    model, tokenizer = tiny()
    disk = small_disk(256)
    first = save_checkpoint(disk, model, tokenizer, {}, step=1)
    checkpoints = disk / "checkpoints"
    fill_disk(disk, leave=pages(first, *(p.name for p in first.iterdir())))  # no room for a tag
    with pytest.raises(NotWritten) as caught:
        save_checkpoint(disk, model, tokenizer, {}, step=2)
    assert str(caught.value).startswith(f"{checkpoints / 'last'} could not be written: No space "
                                        "left on device (")
    assert str(caught.value).endswith(f"(0.0 MiB free on {disk})")
    assert sorted(p.name for p in checkpoints.iterdir()) == ["last", "step-0000001"]
    assert (checkpoints / "last").read_text(encoding="utf-8") == "step-0000001\n"


@pytest.mark.parametrize("existed", [False, True])
def test_a_lock_whose_pid_file_meets_a_full_disk_is_one_line_and_leaves_nothing(
        small_disk, existed):
    disk = small_disk(64)
    run_dir = disk / "run"
    if existed:
        (run_dir / ".hydra").mkdir(parents=True)
    fill_disk(disk)
    with pytest.raises(NotWritten) as caught:
        with run_dir_lock(run_dir):
            pass
    assert str(caught.value).startswith(f"{run_dir / '.lock.pid'} could not be written: No space "
                                        f"left on device (0.0 MiB free on {disk}")
    assert sorted(str(p.relative_to(disk)) for p in disk.rglob("*")) == \
        (["filler", "run", "run/.hydra"] if existed else ["filler"])


# ----------------------------------------------------------------------------- the lock


def test_a_stale_lock_of_a_killed_run_is_said_in_one_line(tmp_path, caplog):
    dead = subprocess.Popen([sys.executable, "-c", ""])
    dead.wait()
    (tmp_path / ".lock").touch()  # what kill -9 leaves
    (tmp_path / ".lock.pid").write_text(f"{dead.pid}\n")
    with caplog.at_level("INFO", logger="tinylm.checkpoint"):
        with run_dir_lock(tmp_path):
            assert (tmp_path / ".lock.pid").read_text() == f"{os.getpid()}\n"
    assert [r.message for r in caplog.records] == [
        f"removed a stale lock of pid {dead.pid} (a killed run)"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [".lock"]


@pytest.mark.parametrize("existed", [False, True])
def test_a_refused_run_leaves_no_lock_file_behind(tmp_path, existed):
    run_dir = tmp_path / "run"
    if existed:
        (run_dir / ".hydra").mkdir(parents=True)
    with pytest.raises(ConfigError):
        with run_dir_lock(run_dir):
            assert sorted(p.name for p in run_dir.iterdir()) == \
                [".hydra", ".lock", ".lock.pid"][0 if existed else 1:]
            raise ConfigError(f"{run_dir} already holds checkpoints")
    assert sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*")) == \
        (["run", "run/.hydra"] if existed else [])


# ------------------------------------------------------- a checkpoint and its tokenizer


def test_a_tokenizer_of_another_corpus_with_as_many_tokens_is_refused_naming_both(
        tiny, tmp_path):
    model, tokenizer = tiny()
    directory = save_checkpoint(tmp_path, model, tokenizer, {}, step=1)
    other = CharTokenizer([chr(ord(c) + 1) for c in tokenizer.chars])  # same size, other ids
    assert other.vocab_size == tokenizer.vocab_size
    other.save(directory / "tokenizer.json")
    with pytest.raises(ValueError) as refused:
        load_checkpoint(directory)
    assert str(refused.value).startswith(
        f"{directory / 'tokenizer.json'} is not the tokenizer {directory / WEIGHTS_FILE} was "
        f"trained with (a char tokenizer of {tokenizer.vocab_size} tokens, sha256 ")
    assert "\n" not in str(refused.value)


@pytest.mark.parametrize("edit, allowed", [({"n_head": 4}, False), ({"n_head": 1}, False),
                                           ({"dropout": 0.3}, True)])
def test_a_model_config_edited_to_fit_the_same_weights_is_refused_naming_both(
        tiny, tmp_path, edit, allowed):
    model, tokenizer = tiny()  # n_embd 8, n_head 2: n_head 4 or 1 keeps every parameter's shape
    directory = save_checkpoint(tmp_path, model, tokenizer, {}, step=1)
    config_file = directory / "model_config.json"
    config_file.write_text(json.dumps(json.loads(config_file.read_text()) | edit))
    if allowed:  # dropout is not the model's shape: a run may continue with another one
        assert load_checkpoint(directory).config.dropout == edit["dropout"]
        return
    with pytest.raises(ValueError) as refused:
        load_checkpoint(directory)
    assert str(refused.value) == (
        f"{config_file} says n_head={edit['n_head']} but {directory / WEIGHTS_FILE} was saved "
        "from a model with n_head=2: they are not one checkpoint; set n_head back")


def test_a_checkpoint_written_before_the_records_still_loads_with_the_old_checks(tiny, tmp_path):
    model, tokenizer = tiny()
    directory = save_checkpoint(tmp_path, model, tokenizer, {}, step=1)
    safetensors.torch.save_model(model, str(directory / WEIGHTS_FILE))  # no tinylm metadata
    other = CharTokenizer([chr(ord(c) + 1) for c in tokenizer.chars])
    other.save(directory / "tokenizer.json")  # nothing recorded to tell it apart
    ckpt = load_checkpoint(directory)
    assert ckpt.tokenizer.chars == other.chars and ckpt.config == model.config
    CharTokenizer.train(["abc"]).save(directory / "tokenizer.json")
    with pytest.raises(ValueError, match="tokenizer.json has 4 tokens but .*vocab_size="):
        load_checkpoint(directory)


def test_a_crafted_record_in_the_weights_is_refused_naming_the_file(tiny, tmp_path):
    model, tokenizer = tiny()
    directory = save_checkpoint(tmp_path, model, tokenizer, {}, step=1)
    safetensors.torch.save_model(model, str(directory / WEIGHTS_FILE),
                                 metadata={"tinylm.model": "[1, 2"})
    with pytest.raises(ValueError, match=f"^{directory / WEIGHTS_FILE} holds an unreadable "
                                         "tinylm.model record in its metadata"):
        load_checkpoint(directory)


def test_a_checkpoints_files_are_readable_as_the_umask_says(tiny, tmp_path):
    model, tokenizer = tiny()
    old = os.umask(0o022)
    try:
        directory = save_checkpoint(tmp_path, model, tokenizer, {}, step=1, trainer_state={})
    finally:
        os.umask(old)
    assert {p.name: oct(p.stat().st_mode & 0o777) for p in directory.iterdir()} == {
        name: "0o644" for name in ("model.safetensors", "model_config.json", "config.yaml",
                                   "tokenizer.json", "trainer_state.pt")}


def test_weights_holding_nan_or_inf_are_refused_in_one_line_naming_the_tensor(tiny, tmp_path):
    from safetensors import safe_open
    model, tokenizer = tiny()
    directory = save_checkpoint(tmp_path, model, tokenizer, {}, step=1)
    weights = directory / WEIGHTS_FILE
    with safe_open(str(weights), "pt") as f:
        tensors, metadata = {k: f.get_tensor(k) for k in f.keys()}, f.metadata()
    tensors["blocks.0.mlp.fc.weight"][3, 1] = float("inf")  # a file edited, or a diverged run's
    safetensors.torch.save_file(tensors, str(weights), metadata=metadata)
    before = {p.name: p.read_bytes() for p in directory.iterdir()}
    with pytest.raises(NonFiniteWeights) as refused:
        load_checkpoint(tmp_path)
    assert str(refused.value) == (
        f"{weights} holds NaN or inf in blocks.0.mlp.fc.weight: the model diverged or the file "
        "was altered; load an earlier checkpoint of the run, or download or export the model "
        "again")
    assert {p.name: p.read_bytes() for p in directory.iterdir()} == before


@pytest.mark.parametrize("name", ["README.md", "checkpoints/step-0000001/model.safetensors"])
def test_a_file_as_checkpoint_is_refused_saying_what_checkpoint_takes(tiny, tmp_path,
                                                                     monkeypatch, name):
    model, tokenizer = tiny()
    save_checkpoint(tmp_path, model, tokenizer, {}, step=1)
    (tmp_path / "README.md").write_text("# my run\n")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(FileNotFoundError) as refused:
        load_checkpoint(name)
    assert str(refused.value) == (
        f"{name} is a file, not a checkpoint: checkpoint= takes a run directory, its "
        "checkpoints/, one checkpoint directory, a Hugging Face folder or hf:<id>")


def listing(directory):
    """Every file under `directory` with its bytes (links as where they point)."""
    return {str(p): os.readlink(p) if p.is_symlink() else p.read_bytes()
            for p in sorted(directory.rglob("*")) if p.is_symlink() or p.is_file()}


def refusal(root, path) -> str:
    """load_checkpoint(path)'s one-line refusal, once it is checked that nothing under `root`
    changed."""
    before = listing(root)
    with pytest.raises(ValueError) as refused:
        load_checkpoint(path)
    assert listing(root) == before
    return str(refused.value)


@pytest.mark.parametrize("n_layer", [2, 10**9])  # 10^9 layers, even on the meta device, never end
@pytest.mark.parametrize("recorded", [True, False])
def test_a_layer_count_the_weights_do_not_hold_is_refused_before_the_model_is_built(
        tiny, tmp_path, n_layer, recorded):
    model, tokenizer = tiny()
    directory = save_checkpoint(tmp_path, model, tokenizer, {}, step=1)
    weights, config_file = directory / WEIGHTS_FILE, directory / "model_config.json"
    if not recorded:  # a checkpoint written before the records: the header's names still tell
        safetensors.torch.save_model(model, str(weights))
    config_file.write_text(json.dumps(json.loads(config_file.read_text()) | {"n_layer": n_layer}))
    assert refusal(tmp_path, directory) == (
        f"{config_file} says n_layer={n_layer} but {weights} holds the weights of n_layer=1: "
        "they are not one checkpoint; set n_layer back")


@pytest.mark.parametrize("edit, why", [
    ({"n_embd": None}, "model.n_embd=None is not allowed: must be an integer >= 1"),
    ({"n_embd": {}}, "model.n_embd={} is not allowed: must be an integer >= 1"),
    ({"vocab_size": None}, "model.vocab_size is null: a saved model has a vocabulary"),
    ("{}", "model.vocab_size is null: a saved model has a vocabulary"),
    ("null", "it does not hold a JSON object"),
    ("[" * 100_000 + "]" * 100_000, "it is nested too deeply"),
    ('{"a":' * 100_000 + "1" + "}" * 100_000, "it is nested too deeply"),
])
def test_a_crafted_model_config_is_one_line_naming_it(tiny, tmp_path, edit, why):
    model, tokenizer = tiny()
    directory = save_checkpoint(tmp_path, model, tokenizer, {}, step=1)
    config_file = directory / "model_config.json"
    if isinstance(edit, dict):
        edit = json.dumps(json.loads(config_file.read_text()) | edit)
    config_file.write_text(edit)
    assert refusal(tmp_path, directory) == f"{config_file} is not a valid model config: {why}"


@pytest.mark.parametrize("looped, given", [("last", "."), ("last", "checkpoints/last"),
                                           ("step-0000001", "."),
                                           ("step-0000001", "checkpoints/step-0000001")])
def test_a_tag_or_step_linked_to_itself_is_one_line_naming_it(tiny, tmp_path, monkeypatch,
                                                              looped, given):
    model, tokenizer = tiny()
    save_checkpoint(tmp_path, model, tokenizer, {}, step=1)  # tagged last only
    link = tmp_path / "checkpoints" / looped
    if link.is_file():
        link.unlink()
    else:
        shutil.rmtree(link)
    link.symlink_to(looped)
    monkeypatch.chdir(tmp_path)
    assert refusal(tmp_path, given) == (
        f"{os.path.join('checkpoints', looped)} is a symbolic link that loops back to itself: "
        "remove it, or point it at a checkpoint directory")


def test_a_save_beside_a_tag_linked_to_itself_still_completes(tiny, tmp_path):
    model, tokenizer = tiny()
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / "best").symlink_to("best")
    directory = save_checkpoint(tmp_path, model, tokenizer, {}, step=1)
    assert (tmp_path / "checkpoints" / "last").read_text() == "step-0000001\n"
    assert load_checkpoint(directory).config == model.config


@pytest.mark.parametrize("content, why", [
    (b"train: [1, 2\n", "expected ',' or ']', but got '<stream end>' at line 2, column 1"),
    (b"- train\n- model\n", "it holds a list, not a mapping"),
    (b"[" * 100_000 + b"]" * 100_000, "it is nested too deeply"),
    (b"train: caf\xe9\n", "'utf-8' codec can't decode byte 0xe9 in position 10: invalid "
                          "continuation byte"),
])
def test_a_malformed_config_yaml_is_one_line_naming_it(tiny, tmp_path, content, why):
    model, tokenizer = tiny()
    directory = save_checkpoint(tmp_path, model, tokenizer, {"train": {"seed": 1}}, step=1)
    (directory / "config.yaml").write_bytes(content)
    assert refusal(tmp_path, directory) == (
        f"{directory / 'config.yaml'} is not the run config tinylm wrote ({why}): put back the "
        "config.yaml of the run that saved this checkpoint")
