"""tinylm-prepare: tokenize a corpus once into data/<corpus>-<tokenizer>/, reused while current.
It composes the training config (conf/prepare.yaml extends conf/config.yaml; examples there), so a
run's command line prepares the very data that run reads, and writes no run directory."""

from __future__ import annotations

import shlex
import sys

from tinylm.cli import command, key_and_value, run_schema, run_schemas
from tinylm.config import to_dataclass
from tinylm.data import DataConfig, cache_path, prepare_data
from tinylm.tokenizer import TokenizerConfig

PROG = "tinylm-prepare"


def configs(values: dict) -> tuple[DataConfig, TokenizerConfig]:
    """The data and tokenizer of the composed training config, checked."""
    return (to_dataclass(DataConfig, values["data"], "data"),
            to_dataclass(TokenizerConfig, values["tokenizer"], "tokenizer"))


def cache_intact(when: str, built: tuple[DataConfig, TokenizerConfig] | None) -> str:
    """After a write the disk refused: the cache is as it was; the commands that continue, on this
    disk or on another."""
    cache = cache_path(*built) if built else None
    before = "" if cache is None else \
        f"{cache}/ is as it was, and " if cache.is_dir() else f"{cache}/ was not made, and "
    args = [a for a in sys.argv[1:] if key_and_value(a)[0] != "data.cache_dir"]
    return (f"{before}no build folder is left; {when}, run the same command again: "
            f"{shlex.join([PROG, *sys.argv[1:]])}; or prepare on a disk with room: "
            f"{shlex.join([PROG, *args, 'data.cache_dir=/path/with/room'])}")


main = command(PROG, "prepare", run_schema(), lambda built: prepare_data(*built, log=print),
               build=configs, schemas=run_schemas(), groups=("experiment",),
               errors=(ValueError, FileNotFoundError, RuntimeError),  # RuntimeError: the hub
               intact=cache_intact,
               interrupted=lambda err, built: "interrupted (no partial cache is left behind)")


if __name__ == "__main__":
    main()
