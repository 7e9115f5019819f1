"""tinylm-generate: sample text from a checkpoint, streamed; inspect=true adds attention maps.

    tinylm-generate checkpoint=<run dir> prompt="Once upon a time" max_new_tokens=100
    tinylm-generate checkpoint=<run dir> prompt="Lily and Tom went to the park. She" inspect=true
    (options: conf/generate.yaml)
"""

from __future__ import annotations

import hydra
from omegaconf import DictConfig

from tinylm.cli import check_command_line_or_exit, run_or_exit, without_hydra
from tinylm.config import config_dir


@hydra.main(version_base="1.3", config_path=str(config_dir(register=False)), config_name="generate")
def _generate(cfg: DictConfig) -> None:
    """Compose conf/generate.yaml and generate; bad inputs exit with one clear line."""
    from tinylm.generate import run_generate

    run_or_exit("tinylm-generate",
                lambda: run_generate(_config(cfg)))


def _config(cfg: DictConfig):
    """GenerateConfig from the composed config: every value checked."""
    from tinylm.config import to_dataclass
    from tinylm.generate import GenerateConfig

    return to_dataclass(GenerateConfig, without_hydra(cfg), "generate")


def main() -> None:
    """Console entry: check the command line (one line per mistake), then hand it to Hydra."""
    check_command_line_or_exit("tinylm-generate", "generate", _config)
    run_or_exit("tinylm-generate", _generate, errors=())  # a Ctrl-C while starting: 130


if __name__ == "__main__":
    main()
