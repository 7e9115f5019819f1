"""tinylm-bench: time tinylm beside torch's nn.MultiheadAttention and a Hugging Face GPT-2
(examples in conf/bench.yaml; docs/benchmarks.md; the peers: pip install -e ".[bench]")."""

from __future__ import annotations

from tinylm.bench.config import BenchConfig, bench_config
from tinylm.bench.report import run_bench
from tinylm.cli import command, run_schemas

main = command("tinylm-bench", "bench", BenchConfig, run_bench, build=bench_config,
               schemas={"bench_schema": BenchConfig, **run_schemas()},
               errors=(ValueError, FileNotFoundError, ModuleNotFoundError))


if __name__ == "__main__":
    main()
