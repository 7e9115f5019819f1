"""Hydra's basic sweeper, which hands its whole list of jobs to a check before it runs the first:
a bad value in the last job of a sweep stops the sweep before the first job trains.

A Hydra plugin (Hydra finds plugins in the hydra_plugins namespace package only);
conf/hydra/sweeper/checked.yaml picks it and names the check, tinylm.cli.train.check_sweep. The
jobs and the sweep are the basic sweeper's own (split_arguments, in the order it runs them).
"""

from __future__ import annotations

from typing import Any

from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.utils import get_method


class CheckedSweeper(BasicSweeper):
    """BasicSweeper; `check(jobs, compose)` gets every job's overrides, and `compose(job)`, the
    config the launcher will give that job, before any job is launched."""

    def __init__(self, check: str, max_batch_size: int | None = None,
                 params: dict[str, str] | None = None) -> None:
        super().__init__(max_batch_size, params)
        self.check = check

    def sweep(self, arguments: list[str]) -> Any:
        loader = self.hydra_context.config_loader
        overrides = OverridesParser.create(config_loader=loader).parse_overrides(
            [*self._parse_config(), *arguments])
        jobs = [job for batch in self.split_arguments(overrides, self.max_batch_size)
                for job in batch]
        get_method(self.check)(jobs, lambda job: loader.load_sweep_config(self.config, list(job)))
        return super().sweep(arguments)
