"""tinylm-export: a tinylm run as a Hugging Face GPT-2 folder, which transformers loads without
tinylm (examples in conf/export.yaml; the format: tinylm/pretrained/gpt2.py's export_gpt2)."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

from tinylm.checkpoint import CHECKPOINTS_DIR, MODEL_CONFIG_FILE
from tinylm.cli import command
from tinylm.cli.loading import load_for_command
from tinylm.config import check, choice
from tinylm.files import nearest_folder, published_atomically
from tinylm.pretrained import export_gpt2


@dataclass
class ExportConfig:
    """Options of tinylm-export; the schema of conf/export.yaml (defaults: here only)."""

    checkpoint: str | None = None  # a run directory, its checkpoints/, or one checkpoint directory
    out: str | None = None  # the folder to write, made if missing
    prefer: str = "best"  # which checkpoint of a run: best or last

    def __post_init__(self):
        check(self, prefer=choice("best", "last"))


def refuse_out(folder: Path, value: str) -> None:
    """Refuse an `out` that would mix the export with other files, before any work: a tinylm run
    or checkpoint, or inside one (its model.safetensors and config.json would be replaced), or a
    folder that holds files (an old tokenizer.json left beside the export is read with it)."""
    place = folder.resolve()  # through links too: a link into a run is that run
    for above in [place, *place.parents]:
        if (above / MODEL_CONFIG_FILE).is_file():
            what = "the tinylm checkpoint"
        elif (above / CHECKPOINTS_DIR).is_dir():
            what = "the tinylm run"
        else:
            continue
        where = what if above == place else f"inside {what}"
        raise ValueError(f"out={value} is {where} {above}: the export would overwrite or mix "
                         "with its files; name a new folder outside it, e.g. "
                         "out=exported/my-run")
    if place.is_dir() and any(place.iterdir()):
        raise ValueError(f"out={value} is a folder that already holds files: old files would "
                         "stay beside the export and be read with it; name a new or empty "
                         f"folder, or remove {folder} first")


def run_export(cfg: ExportConfig, out=None) -> Path:
    """Write the checkpoint as GPT-2 into cfg.out, all at once, each file whole."""
    out = out or sys.stdout
    if not cfg.out:
        raise ValueError("checkpoint= and out= are required: tinylm-export checkpoint=<run dir> "
                         "out=<folder to write>")
    folder = Path(cfg.out)
    nearest_folder(folder, "out", cfg.out, "cannot hold the export")  # refused before the work
    refuse_out(folder, cfg.out)
    ckpt = load_for_command(cfg.checkpoint, prefer=cfg.prefer).checkpoint  # on the CPU
    with published_atomically(folder) as build:
        note = export_gpt2(ckpt.model, ckpt.tokenizer, build)
    print(f"exported {ckpt.directory} as GPT-2 to {folder}: "
          f"transformers.AutoModelForCausalLM.from_pretrained({str(folder)!r}) loads it", file=out)
    if note:
        print(f"note: {note}", file=sys.stderr)
    return folder


main = command("tinylm-export", "export", ExportConfig, run_export)


if __name__ == "__main__":
    main()
