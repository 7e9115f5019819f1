"""tinylm-prepare: tokenize a corpus once into data/<corpus>-<tokenizer>/ (reused while current).

    tinylm-prepare                                        # TinyStories sample, byte-level BPE
    tinylm-prepare data=tinyshakespeare tokenizer=char
    tinylm-prepare data=text 'data.files=[notes/*.txt]' tokenizer.vocab_size=1024
    python scripts/prepare.py data=tinystories            # the same
    (options: conf/data/*.yaml, conf/tokenizer/*.yaml; conf/prepare.yaml composes conf/config.yaml
    like training, and writes no run directory)
"""

from __future__ import annotations

from tinylm.cli import command, run_or_exit, run_schema, run_schemas
from tinylm.config import to_dataclass
from tinylm.data import DataConfig, prepare_data
from tinylm.tokenizer import TokenizerConfig


def prepare(values: dict) -> None:
    """Prepare the data and tokenizer of the composed training config."""
    data = to_dataclass(DataConfig, values["data"], "data")
    tokenizer = to_dataclass(TokenizerConfig, values["tokenizer"], "tokenizer")
    run_or_exit("tinylm-prepare", lambda: prepare_data(data, tokenizer, log=print),
                interrupted="interrupted (no partial cache is left behind)",
                errors=(ValueError, FileNotFoundError, RuntimeError))  # RuntimeError: the hub


main = command("tinylm-prepare", "prepare", run_schema(), prepare, build=dict,
               schemas=run_schemas(), groups=("experiment",))


if __name__ == "__main__":
    main()
