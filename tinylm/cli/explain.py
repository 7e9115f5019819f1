"""tinylm-explain: attention step by step, computed by tinylm's own attention code.

    tinylm-explain                        # the explainer's worked example
    tinylm-explain causal=true n_head=2   # see tinylm/explain.py for every option
"""

from __future__ import annotations

import os
import sys

import hydra
from omegaconf import DictConfig

from tinylm.cli import check_command_line_or_exit, run_or_exit, without_hydra
from tinylm.config import config_dir


@hydra.main(version_base="1.3", config_path=str(config_dir(register=False)), config_name="explain")
def _explain(cfg: DictConfig) -> None:
    """Compose conf/explain.yaml, print the walkthrough; bad inputs exit with one clear line."""
    from tinylm.explain import explain

    text = run_or_exit("tinylm-explain",
                       lambda: explain(_config(cfg)))
    # a console that cannot show √ or · gets "?" instead of a crash
    sys.stdout.reconfigure(errors="replace")
    try:
        print(text, flush=True)
    except BrokenPipeError:  # `tinylm-explain | head` stopped reading: fine, not an error
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


def _config(cfg: DictConfig):
    """ExplainConfig from the composed config: every value checked."""
    from tinylm.config import to_dataclass
    from tinylm.explain import ExplainConfig

    return to_dataclass(ExplainConfig, without_hydra(cfg), "explain")


def main() -> None:
    """Console entry: check the command line (one line per mistake), then hand it to Hydra."""
    check_command_line_or_exit("tinylm-explain", "explain", _config)
    run_or_exit("tinylm-explain", _explain, errors=())  # a Ctrl-C while starting: 130


if __name__ == "__main__":
    main()
