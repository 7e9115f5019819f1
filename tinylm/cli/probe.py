"""tinylm-probe: score attention heads on pronoun probes, pronoun agreement, head ablation.

    tinylm-probe checkpoint=<run dir>                       # data/probes/pronouns + agreement
    tinylm-probe checkpoint=<run dir> probe_file=data/probes/agreement.jsonl ablate=true
    (options: conf/probe.yaml)
"""

from __future__ import annotations

import hydra
from omegaconf import DictConfig

from tinylm.cli import check_command_line_or_exit, run_or_exit, without_hydra
from tinylm.config import config_dir


@hydra.main(version_base="1.3", config_path=str(config_dir(register=False)), config_name="probe")
def _probe(cfg: DictConfig) -> None:
    """Compose conf/probe.yaml and probe; bad inputs exit with one clear line."""
    from tinylm.probe import run_probe

    run_or_exit("tinylm-probe", lambda: run_probe(_config(cfg)))


def _config(cfg: DictConfig):
    """ProbeConfig from the composed config: every value checked."""
    from tinylm.config import to_dataclass
    from tinylm.probe import ProbeConfig

    return to_dataclass(ProbeConfig, without_hydra(cfg), "probe")


def main() -> None:
    """Console entry: check the command line (one line per mistake), then hand it to Hydra."""
    check_command_line_or_exit("tinylm-probe", "probe", _config)
    run_or_exit("tinylm-probe", _probe, errors=())  # a Ctrl-C while starting: 130


if __name__ == "__main__":
    main()
