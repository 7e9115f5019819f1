"""tinylm-probe: score attention heads on pronoun probes, pronoun agreement, head ablation,
activation patching across counterfactual pairs (examples in conf/probe.yaml; the scores and the
file format: tinylm/inspection/). Writes probe.json (probe()'s report with `checkpoint`,
`probe_files` and `logdir`) and the heatmaps, once everything is computed, all whole or none."""

from __future__ import annotations

import shlex
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tinylm.cli import command
from tinylm.cli.loading import load_for_command, report_dir
from tinylm.cli.sizes import refuse_batch
from tinylm.config import ConfigError, at_least, check, choice
from tinylm.device import check_threads_setting
from tinylm.files import published_atomically, write_json_atomic
from tinylm.inspection.capture import capture_attention, kv_groups, kv_heads
from tinylm.inspection.probe import probe_files
from tinylm.inspection.probe_report import write_probe_figures
from tinylm.inspection.probe_types import Agreement, Patching, load_probe_file, probe

PAIRS_SHOWN = 8  # pairs whose attention the tab shows beside their patching


@dataclass
class ProbeConfig:
    """Options of tinylm-probe; the schema of conf/probe.yaml (defaults: here only)."""

    checkpoint: str | None = None  # a run directory, its checkpoints/, or one checkpoint directory
    # Any: OmegaConf has no "str or list"
    probe_file: Any = None  # JSONL file(s); None: the shipped data/probes/ sets
    out: str | None = None  # the JSON report; None: <logdir>/probe.json
    logdir: str | None = None  # TensorBoard heatmaps; None: <run dir>/probe/<timestamp>;
    #                            one holding an earlier report: a new <timestamp> folder in it
    # remove each head in turn and measure the agreement margins: true (or zero): zeroed;
    # mean: zeroed, and also replaced by its mean output over the probe's texts
    ablate: bool | str = False
    # copy each head's output from a counterfactual text (another name) into the clean one:
    # true: exact activation patching; fast: its gradient estimate (attribution patching)
    patch: bool | str = False
    top_heads: int = 5  # rows of the console ablation table
    batch_size: int = 64  # sequences per forward pass
    device: str = "auto"  # auto (cuda where there is one, else cpu), cpu, cuda, cuda:N, mps
    prefer: str = "best"  # which checkpoint of a run: best or last
    threads: int | str = "auto"  # torch intra-op threads; auto: the idle usable cores

    def __post_init__(self):
        if isinstance(self.probe_file, str):
            self.probe_file = [self.probe_file]
        if self.probe_file is not None and (not self.probe_file or not all(
                isinstance(p, str) for p in self.probe_file)):
            raise ConfigError(f"probe_file={self.probe_file!r} is not allowed: give a JSONL "
                              "path, a list of them, or null for the shipped probe sets")
        check(self, top_heads=at_least(1), batch_size=at_least(1), prefer=choice("best", "last"),
              threads=check_threads_setting, ablate=choice(False, True, "zero", "mean"),
              patch=choice(False, True, "fast"))


def run_probe(cfg: ProbeConfig, out=None) -> dict:
    """Score the checkpoint's heads on the probe files, print the summary, write the report;
    returns probe.json's content."""
    out = out or sys.stdout
    if cfg.out and Path(cfg.out).is_dir():  # refused before the work, not when writing it
        raise ValueError(f"out={cfg.out} is a directory; name the report file, e.g. "
                         f"out={Path(cfg.out) / 'probe.json'}")
    files = probe_files(cfg.probe_file)
    items = [item for path in files for item in load_probe_file(path)]
    loaded = load_for_command(cfg.checkpoint, cfg.device, cfg.prefer, cfg.threads)
    ckpt = loaded.checkpoint
    model, c = ckpt.model, ckpt.config
    print(loaded.line(f"{c.n_layer} layers x {c.n_head} heads")
          + f"; {len(items)} probe items from {', '.join(map(str, files))}", file=sys.stderr)

    start = time.perf_counter()
    patch = {False: None, True: "exact", "fast": "attribution"}[cfg.patch]
    report = probe(model, ckpt.tokenizer, items, cfg.ablate, cfg.batch_size,
                   before_work=lambda passes: refuse_batch(c, cfg.batch_size, passes),
                   patch=patch)
    seconds = time.perf_counter() - start
    if cfg.ablate and report.get(Agreement).ablation is None:
        print(f"note: ablate={str(cfg.ablate).lower()} needs agreement items (with "
              "wrong_pronoun), e.g. probe_file=data/probes/agreement.jsonl; no ablation done",
              file=sys.stderr)
    patching = report.get(Patching)
    if patching and not patching.result:
        skipped = patching.skipped  # to say why
        why = f"; {len(skipped)} skipped, the first: {skipped[0]['source']}: " \
              f"{skipped[0]['reason']}" if skipped else ""
        print(f"note: patch={str(cfg.patch).lower()} needs agreement items with a counterfactual"
              " whose text up to the pronoun has as many tokens, e.g. "
              f"probe_file=data/probes/agreement.jsonl; no patching done{why}", file=sys.stderr)

    logdir, note = report_dir(cfg.logdir, ckpt.directory, "probe")
    if note:
        print(note, file=sys.stderr)
    json_path = Path(cfg.out) if cfg.out else logdir / "probe.json"
    written = {"checkpoint": str(ckpt.directory), "probe_files": [str(p) for p in files],
               "logdir": str(logdir), **report.to_json()}
    console = report.console(cfg.top_heads)
    groups = kv_groups(c.n_head, kv_heads(model))
    if groups:  # the heads of a group attend with the same keys: say which they are
        console = [groups, *console]
    # the attention over the first pairs' clean texts, up to the pronoun, beside their patching
    pairs = patching.result.pairs[:PAIRS_SHOWN] if patching and patching.result else []
    texts = {f"patching/pair_{i:03d}": capture_attention(
        model, ckpt.tokenizer, ckpt.tokenizer.decode(p.clean_ids + list(p.target_ids[:1])))
        for i, p in enumerate(pairs)}
    with published_atomically(logdir) as folder:
        write_probe_figures(report, folder, console, texts)
        write_json_atomic(json_path if cfg.out else folder / json_path.name, written)
    for line in console:
        print(line, file=out)
    print(f"[{seconds:.1f}s] report: {json_path}\nheatmaps: tensorboard --logdir "
          f"{shlex.quote(str(logdir))}", file=out)
    return written


main = command("tinylm-probe", "probe", ProbeConfig, run_probe)


if __name__ == "__main__":
    main()
