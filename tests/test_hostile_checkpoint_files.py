"""Files of a tinylm checkpoint that are not files: a FIFO, a link to a FIFO elsewhere or to
/dev/zero, in the place of each file the loader reads. tinylm-generate refuses each in one line
naming it, never opening it (a FIFO waits for a writer forever, /dev/zero never ends), and
changes nothing."""

import os
import resource
import signal
import subprocess
import sys

import pytest
from helpers import refusal, save_run

from tinylm.cli.generate import main
from tinylm.tokenizer import CharTokenizer

pytestmark = pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="named pipes are POSIX")

# every file load_checkpoint reads from a checkpoint directory
FILES = ["model_config.json", "model.safetensors", "tokenizer.json", "config.yaml",
         "trainer_state.pt"]


@pytest.fixture
def checkpoint(tmp_path, tiny_model):
    """A tinylm checkpoint directory with a trainer_state.pt, in a run under tmp_path."""
    tokenizer = CharTokenizer.train(["Lily saw a cat. She was happy."])
    run = save_run(tmp_path / "run", tiny_model(tokenizer.vocab_size), tokenizer)
    directory = run / "checkpoints" / "step-0000001"
    (directory / "trainer_state.pt").write_bytes(b"")  # a placeholder: it must not be read
    return directory


def snapshot(root):
    """Each path under `root` with its kind, size and modification time, read without opening
    any of them."""
    return {str(p): (p.lstat().st_mode, p.lstat().st_size, p.lstat().st_mtime_ns)
            for p in sorted(root.rglob("*"))}


def not_a_file(path) -> str:
    read_whole = {"model_config.json": "model config", "config.yaml": "run config"}
    if path.name in read_whole:  # read by tinylm: files.read_regular_file
        return (f"tinylm-generate: error: the checkpoint's {read_whole[path.name]} {path} is a "
                "pipe or device, not a regular file; give a file")
    return (f"tinylm-generate: error: {path} is not a regular file (a FIFO, device or folder): "
            f"put the model's {path.name} there as a file")


@pytest.mark.parametrize("kind", ["fifo", "link to a fifo elsewhere"])
@pytest.mark.parametrize("name", FILES)
def test_a_fifo_in_place_of_a_checkpoint_file_is_named_and_never_opened(
        checkpoint, tmp_path, monkeypatch, name, kind):
    path = checkpoint / name
    path.unlink()
    if kind == "fifo":
        os.mkfifo(path)
    else:
        os.mkfifo(tmp_path / "elsewhere")
        path.symlink_to(tmp_path / "elsewhere")
    before = snapshot(tmp_path)

    def hung(*_):
        raise AssertionError(f"tinylm-generate opened the FIFO at {name}")
    previous = signal.signal(signal.SIGALRM, hung)
    signal.alarm(20)
    try:
        said = refusal(main, f"checkpoint={checkpoint.parent.parent}", monkeypatch=monkeypatch)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    assert said == not_a_file(path)
    assert snapshot(tmp_path) == before


# Run apart, with its memory bounded: read, /dev/zero would fill this process's memory.
GENERATE_EACH = """
import sys
from tinylm.cli.generate import main
for folder in sys.argv[1:]:
    sys.argv = ["tinylm-generate", f"checkpoint={folder}"]
    try:
        main()
    except SystemExit as stop:
        print(stop.code)
"""


def bounded_memory():
    resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))


@pytest.mark.slow
def test_a_link_to_dev_zero_in_place_of_a_checkpoint_file_is_named_and_never_read(
        tmp_path, tiny_model):
    tokenizer = CharTokenizer.train(["Lily saw a cat. She was happy."])
    model = tiny_model(tokenizer.vocab_size)
    directories = []
    for name in FILES:
        directory = save_run(tmp_path / name, model, tokenizer) / "checkpoints" / "step-0000001"
        (directory / name).unlink(missing_ok=True)
        (directory / name).symlink_to("/dev/zero")
        directories.append(directory)
    before = snapshot(tmp_path)
    done = subprocess.run([sys.executable, "-c", GENERATE_EACH, *map(str, directories)],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120,
                          preexec_fn=bounded_memory)
    assert done.stdout.splitlines() == [not_a_file(d / name)
                                        for d, name in zip(directories, FILES, strict=True)]
    assert "Traceback" not in done.stderr
    assert snapshot(tmp_path) == before
