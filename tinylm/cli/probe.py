"""tinylm-probe: score attention heads on pronoun probes, pronoun agreement, head ablation.

    tinylm-probe checkpoint=<run dir>                       # data/probes/pronouns + agreement
    tinylm-probe checkpoint=<run dir> probe_file=data/probes/agreement.jsonl ablate=true
    (options: conf/probe.yaml; the file format: tinylm/inspection/probe_items.py; the scores: tinylm/inspection/probe.py)

Output: a console summary; a JSON report (`out`, default <logdir>/probe.json) with the fields of
tinylm.inspection.probe.probe's report, plus `checkpoint`, `probe_files` and `logdir`; layer x head heatmaps
in TensorBoard (`logdir`, default <run dir>/probe/<timestamp>), also saved as PNG. Nothing is
written until everything is computed.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from tinylm.inspection import deciding
from tinylm.checkpoint import default_logdir, load_checkpoint
from tinylm.cli.command_line import checked_config, console_entry
from tinylm.config import flag, integer, one_of
from tinylm.device import resolve_device
from tinylm.files import write_json_atomic
from tinylm.inspection.probe import ABLATION, probe
from tinylm.inspection.probe_items import SHIPPED_PROBES, load_probe_file, shipped_probe
from tinylm.tables import columns
from tinylm.train.threads import apply_threads, check_threads_setting, start_sample


@dataclass
class ProbeConfig:
    """Options of tinylm-probe; the schema of conf/probe.yaml (defaults: here only)."""

    checkpoint: str | None = None  # a run directory, its checkpoints/, or one checkpoint directory
    # JSONL file(s); None: the shipped data/probes/ sets. Any: OmegaConf has no "str or list"
    probe_file: Any = None
    out: str | None = None  # the JSON report; None: <logdir>/probe.json
    logdir: str | None = None  # TensorBoard heatmaps; None: <run dir>/probe/<timestamp>
    ablate: bool = False  # zero each head in turn and measure the agreement margins
    top_heads: int = 5  # rows of the console ablation table
    batch_size: int = 64  # sequences per forward pass
    device: str = "auto"
    prefer: str = "best"  # which checkpoint of a run: best or last
    threads: int | str = "auto"  # torch intra-op threads; auto: the idle usable cores

    def __post_init__(self):
        if isinstance(self.probe_file, str):
            self.probe_file = [self.probe_file]
        if self.probe_file is not None and (not self.probe_file or not all(
                isinstance(p, str) for p in self.probe_file)):
            raise ValueError(f"probe_file={self.probe_file!r} is not allowed: give a JSONL path, "
                             "a list of them, or null for the shipped probe sets")
        for key in ("top_heads", "batch_size"):
            integer(key, getattr(self, key), least=1)
        flag("ablate", self.ablate)
        one_of("prefer", self.prefer, ("best", "last"))
        check_threads_setting("threads", self.threads)


def probe_files(cfg: ProbeConfig) -> list[Path]:
    """The probe files to read: cfg.probe_file, or the shipped sets."""
    if cfg.probe_file is not None:
        return [Path(p) for p in cfg.probe_file]
    return [shipped_probe(name) for name in SHIPPED_PROBES]


def _grid(entries: list[dict], key: str, n_layer: int, n_head: int) -> np.ndarray:
    """(n_layer, n_head): each entry's `key` at its layer and head; NaN where it has none."""
    grid = np.full((n_layer, n_head), np.nan)
    for e in entries:
        grid[e["layer"], e["head"]] = np.nan if e[key] is None else e[key]
    return grid


def format_report(report: dict, n_layer: int, n_head: int, top_heads: int = 5) -> list[str]:
    """The console summary: the deciding position first (evidence table, attention to the name,
    prediction match), then the resolving head accuracy table, baselines, agreement, ablation."""
    lines = (deciding.format_deciding(report, n_layer, n_head, top_heads)
             if report["deciding"] else [])
    if report["heads"]:
        grid = _grid(report["heads"], "accuracy", n_layer, n_head)
        best = report["best"]
        lines += [f"resolving: {report['n']} two-character items; accuracy = share of items on "
                  "which the head's attention",
                  "from the pronoun goes more to the antecedent than to the distractor (* = best)"]
        lines += deciding.layer_head_lines(
            {(layer, h): f"{grid[layer, h]:.2f}" for layer in range(n_layer)
             for h in range(n_head)},
            n_layer, n_head, (best["layer"], best["head"]))
        b = report["baselines"]
        lines.append(f"best head: layer {best['layer']} head {best['head']}, accuracy "
                     f"{best['accuracy']:.2f}; baselines: nearest mention "
                     f"{b['nearest mention']:.2f}, first mention {b['first mention']:.2f}")
    else:
        lines.append("attention: no two-character items (with distractor_chars) in the probe set")
    agreement = report["agreement"]
    if agreement:
        lines.append(f"agreement: {agreement['n']} one-character items, accuracy "
                     f"{agreement['accuracy']:.2f} (share with log P(pronoun) > log P(wrong "
                     f"pronoun)), mean margin {agreement['mean_margin']:+.3f} nats")
    else:
        lines.append("agreement: no one-character items (with wrong_pronoun) in the probe set")
    if report["ablation"]:
        ranked = sorted(report["ablation"], key=lambda e: -abs(e["delta_mean_margin"]))
        lines.append(f"ablation: each head {ABLATION} in turn, over the {agreement['n']} "
                     f"agreement items; the {min(top_heads, len(ranked))} heads that move the "
                     "mean margin most")
        lines += columns(
            ["layer", "head", "Δ mean margin", "Δ accuracy", "mean margin", "accuracy"],
            [[str(e["layer"]), str(e["head"]), f"{e['delta_mean_margin']:+.3f}",
              f"{e['delta_accuracy']:+.2f}", f"{e['mean_margin']:+.3f}", f"{e['accuracy']:.2f}"]
             for e in ranked[:top_heads]], ">>>>>>", gaps=(2, 3, 3, 3, 3), indent="  ")
    return lines


def write_tensorboard(report: dict, logdir: Path, n_layer: int, n_head: int,
                      console: list[str]) -> list[str]:
    """Layer x head heatmaps (images, also saved as PNG) and the console report as text."""
    # matplotlib and TensorBoard load only here, once the report is computed: --help, a bad
    # option or a bad probe line answer without waiting for them
    from torch.utils.tensorboard import SummaryWriter

    from tinylm.inspection.figures import layer_head_heatmap, log_figure

    figures = {}  # TensorBoard tag -> figure, also written as <logdir>/<tag>.png
    if report["heads"]:
        figures["probe/attention_accuracy"] = layer_head_heatmap(
            _grid(report["heads"], "accuracy", n_layer, n_head),
            f"pronoun -> antecedent accuracy ({report['n']} items)", "accuracy")
    d = report["deciding"]
    if d and d["agreement_attention"]:
        n_first = d["n_name_first_word"]
        for key, items in (("mean_attention", f"{d['n_agreement']} items"),
                           ("mean_attention_name_first_word",
                            f"{n_first} items with the name first"),
                           ("mean_attention_name_later",
                            f"{d['n_agreement'] - n_first} items with the name later")):
            tag = "probe/deciding_attention" + key.removeprefix("mean_attention")
            figures[tag] = layer_head_heatmap(
                _grid(d["agreement_attention"], key, n_layer, n_head),
                f"deciding: token before the pronoun -> name ({items})", "attention")
    if d and d["prediction_match"]:
        figures["probe/prediction_match"] = layer_head_heatmap(
            _grid(d["prediction_match"], "match", n_layer, n_head),
            f"deciding attention predicts the model's pronoun ({d['n_attention']} items)",
            "share of items")
        figures["probe/prediction_correlation"] = layer_head_heatmap(
            _grid(d["prediction_match"], "correlation", n_layer, n_head),
            "deciding attention difference vs log P difference", "Pearson r", fmt="{:+.2f}",
            center=0.0)
    if report["ablation"]:
        for key in ("delta_mean_margin", "delta_accuracy"):
            figures[f"probe/ablation_{key}"] = layer_head_heatmap(
                _grid(report["ablation"], key, n_layer, n_head),
                f"agreement: change in {key[6:].replace('_', ' ')} with the head {ABLATION}",
                key.replace("_", " "), fmt="{:+.2f}", center=0.0)
    writer = SummaryWriter(log_dir=str(logdir))
    try:
        for tag, fig in figures.items():
            log_figure(writer, tag, fig, png_dir=logdir)
        writer.add_text("probe/report", "\n".join("    " + line for line in console), 0)
    finally:
        writer.close()
    return list(figures)


def run_probe(cfg: ProbeConfig, out=None) -> dict:
    """Load checkpoint and probe files, score, print the summary, write JSON and TensorBoard."""
    cpu_sample = start_sample()
    out = out or sys.stdout
    if not cfg.checkpoint:
        raise ValueError("checkpoint= is required: a run directory or a checkpoint directory")
    if cfg.out and Path(cfg.out).is_dir():  # refused before the work, not when writing it
        raise ValueError(f"out={cfg.out} is a directory; name the report file, e.g. "
                         f"out={Path(cfg.out) / 'probe.json'}")
    files = probe_files(cfg)
    items = [item for path in files for item in load_probe_file(path)]
    device = resolve_device(cfg.device)
    ckpt = load_checkpoint(cfg.checkpoint, device=device, prefer=cfg.prefer)
    model, c = ckpt.model, ckpt.config
    threads = apply_threads(cfg.threads, cpu_sample)
    print(f"loaded {ckpt.directory} ({c.n_layer} layers x {c.n_head} heads) on {device}"
          f"{f', {threads.describe()}' if device.type == 'cpu' else ''}; "
          f"{len(items)} probe items from {', '.join(map(str, files))}", file=sys.stderr)

    start = time.perf_counter()
    report = probe(model, ckpt.tokenizer, items, cfg.ablate, cfg.batch_size)
    seconds = time.perf_counter() - start
    if cfg.ablate and report["ablation"] is None:
        print("note: ablate=true needs agreement items (with wrong_pronoun), e.g. "
              "probe_file=data/probes/agreement.jsonl; no ablation done", file=sys.stderr)

    logdir = Path(cfg.logdir) if cfg.logdir else default_logdir(ckpt.directory, "probe")
    json_path = Path(cfg.out) if cfg.out else logdir / "probe.json"
    report = {"checkpoint": str(ckpt.directory), "probe_files": [str(p) for p in files],
              "logdir": str(logdir), **report}
    console = format_report(report, c.n_layer, c.n_head, cfg.top_heads)
    # everything is computed; only now is anything written
    write_json_atomic(json_path, report)
    write_tensorboard(report, logdir, c.n_layer, c.n_head, console)
    for line in console:
        print(line, file=out)
    print(f"[{seconds:.1f}s] report: {json_path}\nheatmaps: tensorboard --logdir {logdir}",
          file=out)
    return report


main = console_entry("tinylm-probe", "probe",
                     checked_config(ProbeConfig, "probe"), run_probe)


if __name__ == "__main__":
    main()
