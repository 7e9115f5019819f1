"""tinylm-prepare: tokenize a corpus once into data/<corpus>-<tokenizer>/ (reused while current).

    tinylm-prepare                                        # TinyStories sample, byte-level BPE
    tinylm-prepare data=tinyshakespeare tokenizer=char
    tinylm-prepare data=text 'data.files=[notes/*.txt]' tokenizer.vocab_size=1024
    python scripts/prepare.py data=tinystories            # the same
    (options: conf/data/*.yaml, conf/tokenizer/*.yaml; conf/prepare.yaml composes conf/config.yaml
    like training, and writes no run directory)
"""

from __future__ import annotations

import hydra
from omegaconf import DictConfig

from tinylm.cli import print_what_stdout_can, run_or_exit
from tinylm.cli.command_line import check_command_line_or_exit
from tinylm.config import config_dir, to_dataclass


@hydra.main(version_base="1.3", config_path=str(config_dir(register=False)), config_name="prepare")
def _prepare(cfg: DictConfig) -> None:
    # here, once Hydra has parsed the command line, so that --help does not wait for torch and
    # tokenizers, which these bring
    from tinylm.data import DataConfig, prepare_data
    from tinylm.tokenizer import TokenizerConfig

    run_or_exit("tinylm-prepare",
                lambda: prepare_data(to_dataclass(DataConfig, cfg.data, "data"),
                                     to_dataclass(TokenizerConfig, cfg.tokenizer, "tokenizer"),
                                     log=print),
                interrupted="interrupted (no partial cache is left behind)",
                errors=(ValueError, FileNotFoundError, RuntimeError))  # RuntimeError: hub failures


def main() -> None:
    """Console entry: compose conf/prepare.yaml with the command line and prepare the data."""
    print_what_stdout_can()
    check_command_line_or_exit("tinylm-prepare", "prepare")
    run_or_exit("tinylm-prepare", _prepare, errors=())  # a Ctrl-C while starting: 130


if __name__ == "__main__":
    main()
