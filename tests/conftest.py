"""Fixtures shared by the test files, most built once per session: a BPE tokenizer, tiny models,
a story corpus and a tiny trained run. Session fixtures are read-only: a test that changes a model
gets its own copy, and a test that writes into a run directory copies it first
(`trained_run_copy`). Per test, `no_symlinks` has checkpoints written as on Windows or a FAT
disk. Also the `cuda` marker: such tests run only where CUDA is present."""

import copy
import errno
import json
import logging
import os
import random
import shutil
import types

import pytest
import torch
from helpers import TRAINED_RUN, run_config

import tinylm.checkpoint
import tinylm.files
from tinylm.files import project_root
from tinylm.model import ModelConfig, TinyLM
from tinylm.tokenizer import TokenizerConfig, train_tokenizer
from tinylm.train.trainer import train

# The shared BPE learns from the shipped probe texts and a few stories, weighted so that the words
# the tests pick out ("She", "laughed", "Tom") are whole tokens at this vocabulary size.
BPE_VOCAB_SIZE = 400
BPE_STORIES = [
    "Once upon a time, there was a little cat named Tom. He liked to play in the sun.",
    "One day, Lily found a red ball. She gave it to her mom, and they played together.",
    "The dog barked at the bird. It flew away, and the dog was sad.",
    "Lily and Tom went to the park. She saw a big dog. It was happy. Tom said, \"Look at the "
    "dog!\" He laughed. They played all day. Café au lait. ",
    "Lily saw a cat. She smiled at the cat. The cat ran to Lily. She laughed.",
] * 20

PEOPLE = [("Lily", "she"), ("Tom", "he"), ("Mia", "she"), ("Ben", "he"), ("Sue", "she")]
THINGS = ["ball", "cat", "kite", "cake", "red box", "little dog"]


def pytest_collection_modifyitems(config, items):
    """Tests marked `cuda` are skipped, with the reason, where torch sees no CUDA device."""
    if torch.cuda.is_available():
        return
    no_cuda = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(no_cuda)


@pytest.fixture(autouse=True)
def logging_as_it_was():
    """A command run in this process lets Hydra configure logging (the print-only commands
    disable every logger that exists): the next test finds the loggers as they were."""
    loggers = [logger for logger in logging.Logger.manager.loggerDict.values()
               if isinstance(logger, logging.Logger)]
    disabled, root_level = {logger: logger.disabled for logger in loggers}, logging.root.level
    yield
    for logger, was in disabled.items():
        logger.disabled = was
    logging.root.setLevel(root_level)


@pytest.fixture(scope="session")
def bpe():
    """The byte-level BPE tokenizer (vocab_size BPE_VOCAB_SIZE) that most tests read text with."""
    texts = [json.loads(line)["text"] for name in ("pronouns", "agreement")
             for line in (project_root() / "data" / "probes" / f"{name}.jsonl").read_text()
             .splitlines()]
    return train_tokenizer(TokenizerConfig(name="bpe", vocab_size=BPE_VOCAB_SIZE),
                           texts + BPE_STORIES)


class OsWithoutSymlinks(types.ModuleType):
    """`os` as tinylm.checkpoint meets it where no symlink can be made. On Windows (os.name "nt")
    os.symlink needs a privilege, a directory cannot be opened, and os.fsync fails on a file
    opened only for reading; on a vfat disk under Linux os.symlink fails with EPERM."""

    def __init__(self, windows: bool):
        super().__init__("os")
        self.name = "nt" if windows else os.name
        self.windows = windows
        self.read_only: set[int] = set()  # descriptors opened without write access

    def __getattr__(self, attr):
        return getattr(os, attr)

    def symlink(self, target, link, *args, **kwargs):
        if self.windows:
            raise OSError(errno.EINVAL, "A required privilege is not held by the client")
        raise OSError(errno.EPERM, "Operation not permitted", str(link))

    def open(self, path, flags, *args, **kwargs):
        if self.windows and os.path.isdir(path):
            raise PermissionError(errno.EACCES, "Permission denied", str(path))
        fd = os.open(path, flags, *args, **kwargs)
        if flags & (os.O_WRONLY | os.O_RDWR):
            self.read_only.discard(fd)
        else:
            self.read_only.add(fd)
        return fd

    def fsync(self, fd):
        if self.windows and fd in self.read_only:
            raise OSError(errno.EBADF, "Bad file descriptor")
        os.fsync(fd)


@pytest.fixture(params=["windows", "vfat"])
def no_symlinks(request, monkeypatch):
    """Checkpoints are written where symlinks cannot be made: on Windows, or on a Linux disk
    that holds none. Returns the case's name."""
    system = OsWithoutSymlinks(request.param == "windows")
    monkeypatch.setattr(tinylm.checkpoint, "os", system)
    monkeypatch.setattr(tinylm.files, "os", system)  # where files are flushed
    return request.param


class TinyModels:
    """Untrained TinyLMs in eval mode, each shape and seed built once; every call hands out a copy
    so that a test may change its model's weights without touching another test's."""

    def __init__(self):
        self.built = {}  # (vocab_size, seed, overrides) -> (model, RNG state just after building)

    def __call__(self, vocab_size, seed=0, **overrides):
        """2 layers, 2 heads, n_embd 16, block_size 64 by default; `overrides` change any field."""
        key = (vocab_size, seed, tuple(sorted(overrides.items())))
        if key not in self.built:
            torch.manual_seed(seed)
            values = dict(vocab_size=vocab_size, block_size=64, n_layer=2, n_head=2, n_embd=16)
            model = TinyLM(ModelConfig(**{**values, **overrides})).eval()
            self.built[key] = model, torch.get_rng_state()
        model, rng_state = self.built[key]
        # the global generator as if the model had just been built: a test's later draws do not
        # depend on whether an earlier test asked for the same model
        torch.set_rng_state(rng_state)
        return copy.deepcopy(model)


@pytest.fixture(scope="session")
def tiny_model():
    """tiny_model(vocab_size, seed=0, **overrides): a fresh copy of a model built once."""
    return TinyModels()


@pytest.fixture
def model(tiny_model, bpe):
    """The default tiny model over the `bpe` tokenizer, the test's own copy."""
    return tiny_model(bpe.vocab_size)


def story(rng: random.Random) -> str:
    name, pronoun = rng.choice(PEOPLE)
    thing = rng.choice(THINGS)
    return (f"Once upon a time, {name} found a {thing}. {pronoun.capitalize()} was very happy. "
            f"{name} played with the {thing} all day, and then {pronoun} went home.")


@pytest.fixture(scope="session")
def corpus(tmp_path_factory):
    """A small TinyStories-like text (stories.txt), and one data cache for every run on it."""
    root = tmp_path_factory.mktemp("corpus")
    rng = random.Random(0)
    (root / "stories.txt").write_text("\n\n".join(story(rng) for _ in range(300)))
    return root


@pytest.fixture(scope="session")
def trained_run(corpus, tmp_path_factory):
    """(run_dir, metrics) of one uninterrupted 30-step run of TINY and TRAINED_RUN.
    Read-only: a test that writes into a run directory takes `trained_run_copy`."""
    run_dir = tmp_path_factory.mktemp("full") / "run"
    metrics = train(run_config(corpus, run_dir, *TRAINED_RUN))
    return run_dir, metrics


@pytest.fixture
def trained_run_copy(trained_run, tmp_path_factory):
    """The test's own copy of the trained run directory, its tag links kept as links (outside
    tmp_path, which the test may want to find empty)."""
    return shutil.copytree(trained_run[0], tmp_path_factory.mktemp("run_copy") / "run",
                           symlinks=True)


@pytest.fixture
def small_disk(tmp_path):
    """A real, small disk: `small_disk(kib)` mounts a tmpfs of that size and returns its folder,
    unmounted after the test. Needs Linux and root (CI has both); skipped elsewhere, saying why.
    Fill it with `fill_disk` to leave only a few bytes free."""
    import subprocess
    import sys
    if not sys.platform.startswith("linux") or os.geteuid() != 0:
        pytest.skip("a real full disk needs a tmpfs mount: Linux, as root")
    mounts = []

    def mount(kib: int):
        where = tmp_path / f"disk{len(mounts)}"
        where.mkdir()
        result = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={kib}k", "tmpfs",
                                 str(where)], capture_output=True, text=True)
        if result.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {result.stderr.strip()}")
        mounts.append(where)
        return where
    yield mount
    for where in reversed(mounts):
        subprocess.run(["umount", "-l", str(where)], check=False)


def fill_disk(folder, leave: int = 0):
    """Fill the disk that holds `folder` until at most `leave` bytes are free (a file `filler`)."""
    with open(folder / "filler", "wb") as f:
        chunk = b"\0" * 65536
        while True:
            free = shutil.disk_usage(folder).free
            if free <= leave:
                break
            try:
                f.write(chunk[:max(1, min(len(chunk), free - leave))])
                f.flush()
            except OSError:
                break
