"""The first run, as a new user meets it: the built wheel in a fresh venv, and a bare checkout
with nothing beside it, each train the default corpus offline."""

import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from tinylm.files import project_root

pytestmark = pytest.mark.slow

COMPOSE = """
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf
from tinylm.cli import config_dir, register, run_schemas
from tinylm.train.run_config import RunConfig
conf = config_dir()
register(run_schemas())
with initialize_config_dir(config_dir=str(conf), version_base="1.3"):
    cfg = compose("config", ["experiment=shakespeare_char", "train.max_steps=7"])
run = RunConfig.from_config(OmegaConf.to_container(cfg, resolve=True), "x")
print(conf, run.data.name, run.tokenizer.name, run.model.n_embd, run.train.max_steps)
from tinylm.inspection.probe import probe_files
from tinylm.inspection.probe_types import load_probe_file
print(*(f"{path}:{len(load_probe_file(path))}" for path in probe_files(None)))
"""
# The default run (TinyStories sample, BPE), made small enough for a test.
TINY = ["tokenizer.vocab_size=300", "model.n_layer=1", "model.n_head=2", "model.n_embd=16",
        "model.block_size=32", "train.batch_size=4", "train.max_steps=5", "train.eval_interval=5",
        "train.eval_batches=1", "train.sample_tokens=0", "train.probe_prompt=''",
        "train.device=cpu", "hydra.run.dir=runs/first"]
# No network and no hint of where the corpora are: only what was installed or cloned counts.
OFFLINE = {"PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "PYTHONIOENCODING": "utf-8"}


def assert_trained_the_embedded_sample(done, corpora, cwd):
    assert done.returncode == 0, done.stderr[-3000:]
    out = done.stdout + done.stderr
    assert f"local files under {corpora}: tinystories/train-head.txt (200,111 bytes)" in out
    assert "Done: 5 steps" in out
    assert (cwd / "runs" / "first" / "checkpoints" / "last").is_file()
    assert (cwd / "data" / "tinystories-bpe" / "train.bin").is_file()


def test_built_wheel_in_a_fresh_venv_trains_offline_in_an_empty_directory(tmp_path):
    import hatchling  # noqa: F401  (the dev extra installs it: the wheel is built offline)
    pip = [sys.executable, "-m", "pip"]
    built = subprocess.run([*pip, "wheel", "--no-deps", "--no-build-isolation", "-w",
                            str(tmp_path / "dist"), str(project_root())],
                           capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, built.stderr[-3000:]
    (wheel,) = (tmp_path / "dist").glob("tinylm-*.whl")

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    site = Path(subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_path("
                               "'purelib'))"], capture_output=True, text=True,
                               check=True).stdout.strip())
    # Reuse this environment's torch and other dependencies (a path, not its .pth files, so
    # the editable tinylm of this checkout stays out); tinylm itself comes from the wheel.
    (site / "deps.pth").write_text(sysconfig.get_path("purelib"))
    installed = subprocess.run([*pip, "--python", str(python), "install", "--no-deps",
                                "--no-index", str(wheel)], capture_output=True, text=True,
                               timeout=300)
    assert installed.returncode == 0, installed.stderr[-3000:]
    package = site / "tinylm"

    empty = tmp_path / "empty"
    empty.mkdir()
    done = subprocess.run([python, "-P", "-c", COMPOSE], cwd=empty, env=OFFLINE,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == [
        str(package / "conf"), "tinyshakespeare", "char", "128", "7",
        # the shipped probe sets travel in the wheel: tinylm-probe needs no probe_file=
        f"{package / 'probes' / 'pronouns.jsonl'}:72",
        f"{package / 'probes' / 'agreement.jsonl'}:108"]

    done = subprocess.run([venv / "bin" / "tinylm-train", *TINY], cwd=empty, env=OFFLINE,
                          capture_output=True, text=True, timeout=300)
    assert_trained_the_embedded_sample(done, package / "corpora", empty)
    assert sorted(p.name for p in empty.iterdir()) == ["data", "runs"]


def test_a_bare_checkout_with_nothing_beside_it_trains_offline(tmp_path):
    """The tracked files alone (what `git clone` gives), copied where no ../shared exists."""
    root = project_root()
    listed = subprocess.run(["git", "ls-files", "-z"], cwd=root, capture_output=True,
                            check=True).stdout.decode().split("\0")
    clone = tmp_path / "tinylm"
    for name in filter(None, listed):
        if (root / name).is_file():  # a tracked file deleted in the working tree is left out
            (clone / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(root / name, clone / name)
    assert not (tmp_path / "shared").exists()

    done = subprocess.run([sys.executable, "scripts/train.py", *TINY], cwd=clone,
                          env={**OFFLINE, "PYTHONPATH": str(clone)},
                          capture_output=True, text=True, timeout=300)
    assert_trained_the_embedded_sample(done, clone / "data" / "corpora", clone)
