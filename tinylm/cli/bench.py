"""tinylm-bench: time tinylm beside torch's nn.MultiheadAttention and a Hugging Face GPT-2.

    tinylm-bench                    # every section: tables on stdout, JSON in runs/bench/
    tinylm-bench section=generate repeats=9 out=generate.json
    (options: conf/bench.yaml; docs/benchmarks.md; the peers: pip install -e ".[bench]")
"""

from __future__ import annotations

import hydra
from omegaconf import DictConfig, OmegaConf

from tinylm.cli import check_command_line_or_exit, run_or_exit, without_hydra
from tinylm.config import config_dir


@hydra.main(version_base="1.3", config_path=str(config_dir(register=False)), config_name="bench")
def _bench(cfg: DictConfig) -> None:
    """Compose conf/bench.yaml and run the benchmark; bad options exit with one clear line."""
    # the heavy imports (transformers) wait until Hydra has parsed the command line
    from tinylm.bench import run_bench

    run_or_exit("tinylm-bench", lambda: run_bench(_config(cfg)),
                errors=(ValueError, FileNotFoundError, ModuleNotFoundError))


def _config(cfg: DictConfig):
    """BenchConfig from the composed config: every value checked."""
    from tinylm.bench import bench_config

    return bench_config(OmegaConf.to_container(without_hydra(cfg), resolve=True))


def main() -> None:
    """Console entry: check the command line (one line per mistake), then hand it to Hydra."""
    check_command_line_or_exit("tinylm-bench", "bench", _config)
    run_or_exit("tinylm-bench", _bench, errors=())  # a Ctrl-C while starting: 130


if __name__ == "__main__":
    main()
