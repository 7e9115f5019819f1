"""The installed wheel carries conf/ and the probe sets: the commands work from anywhere."""

import subprocess
import sys

import pytest

from tinylm.config import project_root

pytestmark = pytest.mark.slow

COMPOSE = """
from hydra import compose, initialize_config_dir
import tinylm.config
from tinylm.train import RunConfig
conf = tinylm.config.config_dir()
with initialize_config_dir(config_dir=str(conf), version_base="1.3"):
    cfg = compose("config", ["experiment=shakespeare_char", "train.max_steps=7"])
run = RunConfig.from_config(cfg, "x")
print(conf, run.data.name, run.tokenizer.name, run.model.n_embd, run.train.max_steps)
from tinylm.probe import ProbeConfig, load_probe_file, probe_files
print(*(f"{path}:{len(load_probe_file(path))}" for path in probe_files(ProbeConfig())))
"""


def test_wheel_installed_elsewhere_finds_and_composes_its_configs(tmp_path):
    import hatchling  # noqa: F401  (the dev extra installs it: the wheel is built offline)
    pip = [sys.executable, "-m", "pip"]
    built = subprocess.run([*pip, "wheel", "--no-deps", "--no-build-isolation", "-w",
                            str(tmp_path / "dist"), str(project_root())],
                           capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, built.stderr[-3000:]
    (wheel,) = (tmp_path / "dist").glob("tinylm-*.whl")
    target = tmp_path / "site"
    installed = subprocess.run([*pip, "install", "--no-deps", "--target", str(target), str(wheel)],
                               capture_output=True, text=True, timeout=300)
    assert installed.returncode == 0, installed.stderr[-3000:]

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    # -I would drop PYTHONPATH; -P keeps the cwd off sys.path, so only the installed copy counts
    done = subprocess.run([sys.executable, "-P", "-c", COMPOSE], cwd=elsewhere,
                          env={"PYTHONPATH": str(target), "PATH": "/usr/bin:/bin"},
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == [
        str(target / "tinylm" / "conf"), "tinyshakespeare", "char", "128", "7",
        # the shipped probe sets travel in the wheel: tinylm-probe needs no probe_file=
        f"{target / 'tinylm' / 'probes' / 'pronouns.jsonl'}:72",
        f"{target / 'tinylm' / 'probes' / 'agreement.jsonl'}:108"]
