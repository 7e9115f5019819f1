"""tinylm-prepare: tokenize a corpus once into data/<corpus>-<tokenizer>/ (reused while current).

    tinylm-prepare                                        # TinyStories sample, byte-level BPE
    tinylm-prepare data=tinyshakespeare tokenizer=char
    tinylm-prepare data=text 'data.files=[notes/*.txt]' tokenizer.vocab_size=1024
    python scripts/prepare.py data=tinystories            # the same
    (options: conf/data/*.yaml, conf/tokenizer/*.yaml; conf/prepare.yaml composes conf/config.yaml
    like training, and writes no run directory)
"""

from __future__ import annotations

import shlex
import sys
from collections.abc import Callable
from pathlib import Path

from tinylm.cli import command, key_and_value, run_or_exit, run_schema, run_schemas
from tinylm.config import to_dataclass
from tinylm.data import DataConfig, cache_path, prepare_data
from tinylm.tokenizer import TokenizerConfig


def prepare(values: dict) -> None:
    """Prepare the data and tokenizer of the composed training config."""
    data = to_dataclass(DataConfig, values["data"], "data")
    tokenizer = to_dataclass(TokenizerConfig, values["tokenizer"], "tokenizer")
    run_or_exit("tinylm-prepare", lambda: prepare_data(data, tokenizer, log=print),
                interrupted="interrupted (no partial cache is left behind)",
                errors=(ValueError, FileNotFoundError, RuntimeError),  # RuntimeError: the hub
                intact=cache_intact("tinylm-prepare", cache_path(data, tokenizer)))


def cache_intact(prog: str, cache: Path) -> Callable[[str], str]:
    """What a prepare that the disk refused says: the cache it would have replaced is as it
    was, and the commands that continue, on this disk or on another."""
    def intact(when: str) -> str:
        before = f"{cache}/ is as it was" if cache.is_dir() else f"{cache}/ was not made"
        args = [a for a in sys.argv[1:] if key_and_value(a)[0] != "data.cache_dir"]
        return (f"{before}, and no build folder is left; {when}, run the same "
                f"command again: {shlex.join([prog, *sys.argv[1:]])}; or prepare on a disk "
                f"with room: {shlex.join([prog, *args, 'data.cache_dir=/path/with/room'])}")
    return intact


main = command("tinylm-prepare", "prepare", run_schema(), prepare, build=dict,
               schemas=run_schemas(), groups=("experiment",))


if __name__ == "__main__":
    main()
