"""tinylm-prepare: tokenize a corpus once into data/<corpus>-<tokenizer>/ (reused while current).

    tinylm-prepare                                        # TinyStories sample, byte-level BPE
    tinylm-prepare data=tinyshakespeare tokenizer=char
    tinylm-prepare data=text 'data.files=[notes/*.txt]' tokenizer.vocab_size=1024
    python scripts/prepare.py data=tinystories            # the same
    (options: conf/data/*.yaml, conf/tokenizer/*.yaml; composes conf/config.yaml like training)
"""

from __future__ import annotations

import sys

import hydra
from omegaconf import DictConfig

from tinylm.cli import check_command_line_or_exit, run_or_exit
from tinylm.config import config_dir

# Preparing writes only the cache directory. conf/config.yaml sends Hydra's outputs to a
# training run directory (runs/<date>/<time> with .hydra/ and a log file); these overrides keep
# this command from creating one: run "in" the current directory, without .hydra/ or log file.
NO_RUN_DIR = ("hydra.run.dir=.", "hydra.output_subdir=null", "hydra/job_logging=none")


@hydra.main(version_base="1.3", config_path=str(config_dir(register=False)), config_name="config")
def _prepare(cfg: DictConfig) -> None:
    # the heavy imports wait until Hydra has parsed the command line, so --help is quick
    from tinylm.config import to_dataclass
    from tinylm.data import DataConfig, prepare_data
    from tinylm.tokenizer import TokenizerConfig

    run_or_exit("tinylm-prepare",
                lambda: prepare_data(to_dataclass(DataConfig, cfg.data, "data"),
                                     to_dataclass(TokenizerConfig, cfg.tokenizer, "tokenizer")),
                interrupted="interrupted (no partial cache is left behind)",
                errors=(ValueError, FileNotFoundError, RuntimeError))  # RuntimeError: hub failures


def main() -> None:
    """Console entry: compose conf/config.yaml with the command line and prepare the data."""
    check_command_line_or_exit("tinylm-prepare", "config")
    given = {arg.split("=", 1)[0].lstrip("+~") for arg in sys.argv[1:]}
    sys.argv[1:1] = [o for o in NO_RUN_DIR if o.split("=", 1)[0] not in given]
    run_or_exit("tinylm-prepare", _prepare, errors=())  # a Ctrl-C while starting: 130


if __name__ == "__main__":
    main()
