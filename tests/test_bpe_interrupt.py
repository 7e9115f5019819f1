"""A prepare stopped while HF tokenizers trains its BPE: SIGTERM ends it at once, and a prepare
killed outright leaves no trainer running (the trainer runs in a child process)."""

import os
import random
import signal
import subprocess
import sys
import time

import psutil
import pytest

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """A folder holding words.txt: ~16 MB of random words, whose BPE training (vocab 30,000)
    takes over 10 s on 2 cores, where ordinary text of that size takes a few."""
    folder = tmp_path_factory.mktemp("words")
    rng = random.Random(0)
    words = ["".join(rng.choices("abcdefghijklmnopqrstuvwxyz", k=rng.randint(2, 12)))
             for _ in range(300_000)]
    paragraphs = "\n\n".join(" ".join(rng.choices(words, k=60)) for _ in range(8_000))
    (folder / "words.txt").write_text(f"{paragraphs}\n\n" * 4, encoding="utf-8")
    return folder


def start_bpe_training(corpus, tmp_path):
    """tinylm-prepare of the corpus, once it has begun training the BPE: (process, its children:
    the trainer). Its temporary files go to tmp_path/tmp."""
    (tmp_path / "tmp").mkdir()
    process = subprocess.Popen(
        [sys.executable, "-m", "tinylm.cli.prepare", "data=text", "data.files=[words.txt]",
         "tokenizer.vocab_size=30000", f"data.cache_dir={tmp_path / 'cache'}"],
        cwd=corpus, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1", "TMPDIR": str(tmp_path / "tmp")})
    for line in process.stdout:
        if line.startswith("Training byte-level BPE"):
            time.sleep(1)  # well into the training, which goes on for seconds
            return process, psutil.Process(process.pid).children(recursive=True)
    process.kill()
    pytest.fail(f"prepare ended before training its BPE: {process.communicate()}")


def test_sigterm_during_bpe_training_ends_the_prepare_at_once_in_one_line(corpus, tmp_path):
    process, trainers = start_bpe_training(corpus, tmp_path)
    assert trainers, "the BPE trains in a child process"
    process.send_signal(signal.SIGTERM)
    sent = time.monotonic()
    _, err = process.communicate(timeout=60)
    assert time.monotonic() - sent < 3  # not once the training is done
    assert process.returncode == 128 + signal.SIGTERM
    assert err.strip() == "tinylm-prepare: interrupted (no partial cache is left behind)"
    assert not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in trainers)
    assert not (tmp_path / "cache").exists() or not any((tmp_path / "cache").iterdir())
    assert not any((tmp_path / "tmp").iterdir())


def test_a_prepare_killed_during_bpe_training_leaves_no_trainer_running(corpus, tmp_path):
    process, trainers = start_bpe_training(corpus, tmp_path)
    assert trainers
    process.kill()  # SIGKILL: no handler, no cleanup in the prepare itself
    process.wait()  # not its pipes: the trainer holds them open while it lives
    _, alive = psutil.wait_procs(trainers, timeout=3)
    assert alive == []
    process.stdout.close(), process.stderr.close()


def test_ctrl_c_as_the_trainer_starts_ends_the_prepare_in_one_line(corpus, tmp_path):
    """A terminal's Ctrl-C reaches every process of its group: the trainer too, while it is still
    importing, where it must not print a traceback of its own."""
    (tmp_path / "tmp").mkdir()
    process = subprocess.Popen(
        [sys.executable, "-m", "tinylm.cli.prepare", "data=text", "data.files=[words.txt]",
         "tokenizer.vocab_size=30000", f"data.cache_dir={tmp_path / 'cache'}"],
        cwd=corpus, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        start_new_session=True,  # its own process group, as a terminal's command has
        env={**os.environ, "TMPDIR": str(tmp_path / "tmp")})
    deadline = time.monotonic() + 60
    while not (trainers := psutil.Process(process.pid).children()) and time.monotonic() < deadline:
        time.sleep(0.005)
    assert trainers, "the BPE trains in a child process"
    # what Ctrl-C signals is the command's group: the trainer, just started, is not in it
    assert [os.getpgid(t.pid) for t in trainers] != [os.getpgid(process.pid)]
    os.killpg(process.pid, signal.SIGINT)
    _, err = process.communicate(timeout=60)
    assert process.returncode == 128 + signal.SIGINT
    assert err.strip() == "tinylm-prepare: interrupted (no partial cache is left behind)"
