"""How long activation patching takes, and how close attribution patching comes to it.

    python scripts/patching_speed.py --checkpoint runs/<date>/<time>    # a trained run, hf:<id>
    python scripts/patching_speed.py --random-gpt2 [--n-embd 96]        # 12 layers x 12 heads
    python scripts/patching_speed.py --random-gpt2 --n-embd 768 --max-pairs 12   # GPT-2 small

Prints the CPU, the seconds of patch_heads (exact: every head at every position) and of
attribution_patch (its first-order estimate), and Pearson's r between their effects, per
(layer, head) and per (layer, head, position). The checkpoint's pairs come from the probe file
(default: the shipped agreement set). The random GPT-2-shaped model gets synthetic pairs of the
lengths GPT-2's tokenizer would give those texts, about one token per word or punctuation mark
(no tokenizer is needed offline); its effects are those of random weights, so its r says how
linear a random model is, not how well attribution does on a trained one.
"""

import argparse
import platform
import re
import subprocess
import time

import numpy as np
import torch

from tinylm.checkpoint import load_checkpoint
from tinylm.inspection.patching import PatchPair, attribution_patch, build_pairs, patch_heads
from tinylm.inspection.probe_items import shipped_probe
from tinylm.inspection.probe_types import load_probe_file
from tinylm.model import ModelConfig, TinyLM


def cpu_name() -> str:
    """lscpu's model name (the platform's processor where lscpu is missing)."""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        return next(line.split(":", 1)[1].strip() for line in out.splitlines()
                    if line.startswith("Model name"))
    except (OSError, subprocess.CalledProcessError, StopIteration):
        return platform.processor() or "unknown CPU"


def gpt2_shaped(n_embd: int, seed: int = 0) -> TinyLM:
    """A random 12-layer, 12-head model shaped like GPT-2 small but n_embd wide, in eval mode
    (GELU's exact form, not GPT-2's tanh one: the same cost)."""
    torch.manual_seed(seed)
    config = ModelConfig(vocab_size=50257, block_size=1024, n_layer=12, n_head=12, n_embd=n_embd,
                         dropout=0.0, bias=True)
    return TinyLM(config).eval()


def synthetic_pairs(items, vocab_size: int, seed: int = 0) -> list[PatchPair]:
    """Per agreement item with a counterfactual: random ids as many as the words and punctuation
    marks before its pronoun, the counterfactual differing in the first."""
    g = torch.Generator().manual_seed(seed)
    pairs = []
    for item in items:
        if item.kind != "agreement" or item.counterfactual is None:
            continue
        n = len(re.findall(r"\w+|[^\w\s]", item.text[:item.pronoun_char]))
        clean = torch.randint(vocab_size, (n,), generator=g).tolist()
        targets = tuple(torch.randint(vocab_size, (2,), generator=g).tolist())
        pairs.append(PatchPair(item.source, clean, [(clean[0] + 1) % vocab_size, *clean[1:]],
                               targets))
    return pairs


def timed(function, *args):
    """(what function(*args) returns, the seconds it took)."""
    start = time.perf_counter()
    result = function(*args)
    return result, time.perf_counter() - start


def pearson(a: np.ndarray, b: np.ndarray) -> tuple[float, int]:
    """Pearson's r over the cells finite in both, and how many there were."""
    a, b = np.ravel(a), np.ravel(b)
    finite = np.isfinite(a) & np.isfinite(b)
    return float(np.corrcoef(a[finite], b[finite])[0, 1]), int(finite.sum())


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument("--checkpoint", help="a run or checkpoint directory, or hf:<id>")
    what.add_argument("--random-gpt2", action="store_true",
                      help="a random 12 x 12-head GPT-2-shaped model on synthetic pairs")
    parser.add_argument("--probe-file", default=str(shipped_probe("agreement.jsonl")))
    parser.add_argument("--n-embd", type=int, default=96, help="the random model's width")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--max-pairs", type=int, help="only the first this many pairs")
    args = parser.parse_args()

    items = load_probe_file(args.probe_file)
    if args.random_gpt2:
        model, name = gpt2_shaped(args.n_embd), "random GPT-2-shaped"
        pairs, skipped = synthetic_pairs(items, model.config.vocab_size), []
    else:
        checkpoint = load_checkpoint(args.checkpoint)
        model, name = checkpoint.model, str(checkpoint.directory)
        pairs, skipped = build_pairs(checkpoint.tokenizer, items, model.config.block_size)
    pairs = pairs[:args.max_pairs]
    c, lengths = model.config, [len(p.clean_ids) for p in pairs]
    print(f"CPU: {cpu_name()}, {torch.get_num_threads()} torch threads")
    print(f"model: {name} ({c.n_layer} layers x {c.n_head} heads, n_embd {c.n_embd}, "
          f"{next(model.parameters()).dtype}); {len(pairs)} pairs ({len(skipped)} skipped) of "
          f"{min(lengths)}-{max(lengths)} tokens from {args.probe_file}")
    exact, exact_s = timed(patch_heads, model, pairs, args.batch_size)
    estimate, estimate_s = timed(attribution_patch, model, pairs, args.batch_size)
    print(f"exact patching (patch_heads):              {exact_s:8.1f} s")
    print(f"attribution patching (attribution_patch):  {estimate_s:8.1f} s")
    r_heads, n_heads = pearson(exact.effects(), estimate.effects())
    r_cells, n_cells = pearson(exact.effects_by_position(), estimate.effects_by_position())
    print(f"Pearson r, exact vs attribution: {r_heads:.3f} over {n_heads} (layer, head) effects, "
          f"{r_cells:.3f} over {n_cells} (layer, head, position) effects")


if __name__ == "__main__":
    main()
