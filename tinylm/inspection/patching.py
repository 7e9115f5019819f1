"""Activation patching: which heads carry the name's gender to the pronoun, as causes (a head
may look at the name and pass on nothing the pronoun needs). Two texts differ only in the name:

    clean            "Lily went to the park. After a while,"   -> " she"
    counterfactual   "Jack went to the park. After a while,"   -> " he"

m = log P(clean pronoun) - log P(clean wrong pronoun) at the deciding position (the token before
the pronoun), the same two tokens in both runs. Copy one head's output (its slice of
blocks.{layer}.attn.hook_z) at one position from the counterfactual run into the clean run:

    effect = (m_patched - m_clean) / (m_counterfactual - m_clean)    # 0: none of it, 1: all

Over pairs a ratio of means, with a bootstrap interval. Attribution patching estimates every cell
from one backward pass: m_patched - m_clean ≈ (a_counterfactual - a_clean) · ∂m/∂a.

    pairs, skipped = build_pairs(tokenizer, items, model.config.block_size)
    result = patch_heads(model, pairs)    # result.effects(): (n_layer, n_head)
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch
from torch.nn.utils.rnn import pad_sequence
from tqdm.auto import tqdm

from tinylm.files import json_number, json_numbers
from tinylm.hooks import caching, resolve
from tinylm.inspection.interventions import head_replaced
from tinylm.inspection.probe_items import (
    ProbeFileError,
    ProbeItem,
    counterfactual_item,
    encode_agreement_item,
)

METRIC = ("m = log P(clean pronoun) - log P(wrong pronoun) from the logits at the deciding "
          "position (the token before the pronoun), for the first token of each, in both runs; "
          "effect = mean over pairs of (m_patched - m_clean) / mean of "
          "(m_counterfactual - m_clean)")
# said after METRIC where two pronouns begin with the same tokens (a character tokenizer's space)
SHARED = ("; where the two pronouns begin with the same tokens (e.g. a space), those are read in "
          "both texts and m compares the first token where they differ")
POSITIONS = ("effect_by_position is aligned at the deciding position: its last entry is the "
             "deciding position, the one before it the token before, and so on; each entry "
             "averages the pairs long enough to have that position")
MAX_M = 1e9  # nats: a larger m read from a report is no model's (and its sums overflow)


@dataclass
class PatchPair:
    """A clean text and its counterfactual as ids up to the deciding position, and the two
    pronoun tokens m compares."""

    source: str  # "<file>, line <n>" of the clean item
    clean_ids: list[int]
    counterfactual_ids: list[int]  # as many as clean_ids
    target_ids: tuple[int, int]  # the first token where the clean pronoun and the wrong differ
    shared: int = 0  # tokens both pronouns begin with, at the end of both texts' ids

    @property
    def position(self) -> int:  # the deciding one, whose logits predict the pronoun
        return len(self.clean_ids) - 1


def make_pair(tokenizer, item: ProbeItem, partner: ProbeItem, block_size: int
              ) -> PatchPair | str:
    """The PatchPair of an agreement item and its partner, or why there is none. The tokens
    both pronouns begin with (a character model's space) are read in both texts."""
    clean = encode_agreement_item(tokenizer, item, block_size)
    try:
        other = encode_agreement_item(tokenizer, partner, block_size)
    except ProbeFileError as err:  # e.g. a name the char tokenizer never saw: only this pair
        return f"the counterfactual: {str(err).removeprefix(f'{partner.source}: ')}"
    written, wrong = clean.written[clean.n_context:], clean.wrong[clean.n_context:]
    shared = next((k for k, (a, b) in enumerate(zip(written, wrong, strict=False))
                   if a != b), None)
    if shared is None:
        return (f"the pronouns' tokens {tokenizer.token_strings(written)} and "
                f"{tokenizer.token_strings(wrong)} do not differ before one ends")
    context = clean.written[:clean.n_context + shared]
    other_context = other.written[:other.n_context] + written[:shared]
    # positions are compared one to one: a partner of another length would misalign every one
    if len(other_context) != len(context):
        return (f"the counterfactual's context is {len(other_context)} tokens, the clean one "
                f"{len(context)}")
    if other_context == context:
        return "the counterfactual's context is the clean one's"
    return PatchPair(item.source, context, other_context, (written[shared], wrong[shared]), shared)


def build_pairs(tokenizer, items: list[ProbeItem], block_size: int
                ) -> tuple[list[PatchPair], list[dict]]:
    """Agreement items that name a counterfactual -> pairs; skipped ones as {"source", "reason"}."""
    pairs, skipped = [], []
    for item in (i for i in items if i.kind == "agreement"):
        made = ("no counterfactual" if item.counterfactual is None
                else make_pair(tokenizer, item, counterfactual_item(item), block_size))
        if isinstance(made, str):
            skipped.append({"source": item.source, "reason": made})
        else:
            pairs.append(made)
    return pairs, skipped


def _ratio(num: np.ndarray, den: np.ndarray) -> np.ndarray:
    """num / den, NaN where den is 0 (no difference to carry: undefined)."""
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(den != 0, num / np.where(den != 0, den, 1.0), np.nan)


@dataclass
class PatchingResult:
    """m of every pair on the clean text, the counterfactual, and each patched run."""

    pairs: list[PatchPair]
    skipped: list[dict]
    m_clean: np.ndarray  # (P,)
    m_counterfactual: np.ndarray  # (P,), the clean pair's target tokens
    m_patched_by_position: np.ndarray  # (P, L, nh, T_max), NaN past each pair's length
    m_patched_all: np.ndarray  # (P, L, nh): the head patched at every position at once
    method: str  # "exact" or "attribution"

    def effects(self) -> np.ndarray:
        """(L, nh): each head patched at every position, as a ratio of means over pairs."""
        moved = (self.m_patched_all - self.m_clean[:, None, None]).mean(0)
        return _ratio(moved, (self.m_counterfactual - self.m_clean).mean())

    def effects_by_position(self) -> np.ndarray:
        """(L, nh, T_max): ratio of means per position counted back from the deciding one (the
        last entry): the texts differ in length, the deciding position is the one all share."""
        P, L, nh, T = self.m_patched_by_position.shape
        aligned = np.full((P, L, nh, T), np.nan)
        for i, pair in enumerate(self.pairs):
            n = len(pair.clean_ids)
            aligned[i, ..., T - n:] = self.m_patched_by_position[i, ..., :n]
        reaches = ~np.isnan(aligned[:, 0, 0, :])  # (P, T): which pairs have each offset
        moved = np.nansum(aligned - self.m_clean[:, None, None, None], axis=0)  # (L, nh, T)
        change = (reaches * (self.m_counterfactual - self.m_clean)[:, None]).sum(0)  # (T,)
        return _ratio(moved, change)  # sums over the same pairs: their ratio is that of means

    def pair_effects(self) -> np.ndarray:
        """(P, L, nh, T_max): each pair's own effect at each position of its clean text."""
        change = (self.m_counterfactual - self.m_clean)[:, None, None, None]
        return _ratio(self.m_patched_by_position - self.m_clean[:, None, None, None], change)

    def intervals(self, n_resamples: int = 1000, level: float = 0.95, seed: int = 0
                  ) -> np.ndarray:
        """(L, nh, 2): a percentile bootstrap interval of effects(), resampling the pairs."""
        P, L, nh = self.m_patched_all.shape
        rng = np.random.default_rng(seed)
        # each resample as how many times it draws each pair: sums become one matrix product
        counts = rng.multinomial(P, np.full(P, 1 / P), size=n_resamples)  # (n, P)
        moved = counts @ (self.m_patched_all - self.m_clean[:, None, None]).reshape(P, L * nh)
        change = counts @ (self.m_counterfactual - self.m_clean)  # (n,)
        defined = change != 0
        if not defined.any():
            return np.full((L, nh, 2), np.nan)
        ratios = moved[defined] / change[defined, None]  # (n', L*nh)
        bounds = np.quantile(ratios, [(1 - level) / 2, (1 + level) / 2], axis=0)  # (2, L*nh)
        return bounds.T.reshape(L, nh, 2)

    @classmethod
    def from_json(cls, section) -> PatchingResult:
        """The result back from to_json's section (null: NaN); anything else (a wrong type or
        shape, a missing key, an m beyond ±MAX_M) is a one-line ValueError naming the key."""
        _want(isinstance(section, dict), "", "is not an object")
        _want(section.get("method") in ("exact", "attribution"), "method",
              "is not exact or attribution")
        skipped, entries = section.get("skipped"), section.get("pairs")
        _want(isinstance(skipped, list) and all(
            isinstance(s, dict) and isinstance(s.get("source"), str)
            and isinstance(s.get("reason"), str) for s in skipped), "skipped",
            "is not a list of {source, reason}")
        _want(isinstance(entries, list) and len(entries) > 0, "pairs", "is not a list of pairs")
        first = entries[0].get("m_patched_all") if isinstance(entries[0], dict) else None
        _want(isinstance(first, list) and len(first) > 0 and isinstance(first[0], list)
              and len(first[0]) > 0, "pairs[0].m_patched_all", "is not a layers x heads list")
        shape = (len(first), len(first[0]))
        pairs, margins = [], []
        for i, p in enumerate(entries):
            key = f"pairs[{i}]"
            _want(isinstance(p, dict), key, "is not an object")
            clean, other, target = (p.get(k) for k in ("clean_ids", "counterfactual_ids",
                                                       "target_ids"))
            _want(_token_ids(clean) and _token_ids(other) and len(clean) == len(other), key,
                  "has no clean_ids and counterfactual_ids of as many token ids")
            _want(_token_ids(target) and len(target) == 2, f"{key}.target_ids", "are not 2 ids")
            shared = p.get("shared", 0)
            _want(type(shared) is int and 0 <= shared < len(clean), f"{key}.shared",
                  "is not a count of its tokens")
            _want(isinstance(p.get("source"), str), f"{key}.source", "is not a text")
            pairs.append(PatchPair(p["source"], clean, other, tuple(target), shared))
            margins.append([_numbers(p.get(k), dims, f"{key}.{k}") for k, dims in (
                ("m_clean", ()), ("m_counterfactual", ()), ("m_patched_all", shape),
                ("m_patched_by_position", (*shape, len(clean))))])
        m_clean, m_counterfactual, at_all, rows = zip(*margins, strict=True)
        by_position = np.full((len(pairs), *shape, max(len(p.clean_ids) for p in pairs)), np.nan)
        for i, row in enumerate(rows):
            by_position[i, ..., :row.shape[-1]] = row
        return cls(pairs, skipped, np.array(m_clean), np.array(m_counterfactual), by_position,
                   np.array(at_all), section["method"])

    def to_json(self, skipped: list[dict] | None = None, n_resamples: int = 1000,
                level: float = 0.95, seed: int = 0) -> dict:
        """probe.json's `patching` section; `skipped` (from build_pairs) replaces self.skipped."""
        skipped = self.skipped if skipped is None else skipped
        effects, by_position = self.effects(), self.effects_by_position()
        interval = self.intervals(n_resamples, level, seed)
        _, L, nh, _ = self.m_patched_by_position.shape
        return {
            "method": self.method,
            "metric": METRIC + (SHARED if any(p.shared for p in self.pairs) else ""),
            "n_pairs": len(self.pairs), "n_skipped": len(skipped), "skipped": skipped,
            "positions": POSITIONS, "interval_level": level,
            "pairs": [{"source": p.source, "clean_ids": p.clean_ids,
                       "counterfactual_ids": p.counterfactual_ids, "position": p.position,
                       "target_ids": list(p.target_ids),
                       **({"shared": p.shared} if p.shared else {}),
                       "m_clean": json_number(clean), "m_counterfactual": json_number(other),
                       # every patched run's m, from which any effect above is re-computed
                       "m_patched_all": json_numbers(at_all),
                       "m_patched_by_position": json_numbers(by_pos[..., :len(p.clean_ids)])}
                      for p, clean, other, at_all, by_pos in zip(
                          self.pairs, self.m_clean, self.m_counterfactual, self.m_patched_all,
                          self.m_patched_by_position, strict=True)],
            "heads": [{"layer": layer, "head": head, "effect": json_number(effects[layer, head]),
                       "interval": json_numbers(interval[layer, head]),
                       "effect_by_position": json_numbers(by_position[layer, head])}
                      for layer in range(L) for head in range(nh)],
        }


def _want(ok: bool, key: str, what: str) -> None:
    """from_json's refusal: "the patching section's `key` `what`" unless `ok`."""
    if not ok:
        of = f"'s {key}" if key else ""
        raise ValueError(f"the patching section{of} {what}")


def _token_ids(ids) -> bool:
    return isinstance(ids, list) and len(ids) > 0 and all(
        type(i) is int and 0 <= i < 2**63 for i in ids)


def _numbers(value, dims: tuple[int, ...], key: str) -> np.ndarray:
    """`value`, nested lists of numbers within ±MAX_M (a patched run's m may be null: NaN), as
    a float64 array of shape `dims`."""
    null = "m_patched" in key

    def fits(v, dims: tuple[int, ...]) -> bool:
        if dims:
            return isinstance(v, list) and len(v) == dims[0] and all(fits(x, dims[1:]) for x in v)
        return (v is None and null) or (type(v) in (int, float) and abs(v) <= MAX_M)
    _want(fits(value, dims), key, f"is not {' x '.join(map(str, dims)) or 'a'} number"
          f"{'s' if dims else ''} within ±{MAX_M:g}{' or null' if null else ''}")
    return np.array(value, dtype=float)


# ---- the runs ---------------------------------------------------------------------------------

class Run(NamedTuple):
    """What one pass over sequences leaves, each padded to the longest (T_max)."""

    resid: torch.Tensor  # (L, N, T_max, C): each block's input, the residual stream
    heads: torch.Tensor  # (L, N, T_max, nh, hs): each head's output (hook_z), before out_proj
    m: torch.Tensor | None  # (N,) at each sequence's last position, when targets are given
    grads: torch.Tensor | None  # (L, N, T_max, nh, hs): ∂m/∂heads, when asked for


def _tail(model, x: torch.Tensor, first: int, positions: torch.Tensor) -> torch.Tensor:
    """The final-normed state (R, C) at positions (R,), from block `first`'s input x (R, T, C)."""
    h = model.forward_from(first, x)  # (R, T, C)
    return h[torch.arange(len(h), device=h.device), positions]


def _margin(model, h: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """m (R,) from final-normed states h (R, C) and targets (R, 2). log P(a) - log P(b) is
    logit a - logit b (the softmax's normaliser cancels): two rows of the LM head are enough."""
    w = model.lm_head.weight
    return (h.float() * (w[targets[:, 0]] - w[targets[:, 1]]).float()).sum(-1)


def padded(sequences: list[list[int]], device) -> torch.Tensor:
    """(B, T_max) ids, right-padded with 0: under the causal mask padding is never looked at."""
    return pad_sequence([torch.tensor(s) for s in sequences], batch_first=True).to(device)


def _capture(model, sequences: list[list[int]], batch_size: int,
             targets: torch.Tensor | None = None, grads: bool = False) -> Run:
    """Run the sequences in batches, keeping every block's input and heads' output; with targets
    (N, 2) also m, and with grads its gradient with respect to the heads' outputs."""
    p = next(model.parameters())
    N, T_max = len(sequences), max(map(len, sequences))
    resid_names, z_names = resolve(model, ["hook_resid_pre"]), resolve(model, ["hook_z"])
    resid = heads = grad = None  # (L, N, T_max, ...), shaped by the first batch's activations
    m = None if targets is None else torch.zeros(N, device=p.device)
    for start in range(0, N, batch_size):
        rows = slice(start, start + batch_size)
        idx = padded(sequences[rows], p.device)
        T = idx.size(1)
        last = torch.tensor([len(s) - 1 for s in sequences[rows]], device=p.device)
        # with grads the heads' outputs stay in the graph, for m's gradient with respect to them
        with caching(model, resid_names) as block_inputs, \
                caching(model, z_names, detach=not grads) as head_outputs, \
                torch.enable_grad() if grads else torch.no_grad():
            h = _tail(model, model.embed(idx), 0, last)  # eval: embed adds no dropout
            if targets is not None:
                m_rows = _margin(model, h, targets[rows])
                m[rows] = m_rows.detach()
            zs = [head_outputs[name] for name in z_names]  # (B, nh, T, hs) each
            if resid is None:
                L, (_, nh, _, hs) = len(zs), zs[0].shape
                resid = torch.zeros(L, N, T_max, block_inputs[resid_names[0]].size(-1),
                                    dtype=p.dtype, device=p.device)
                heads = torch.zeros(L, N, T_max, nh, hs, dtype=p.dtype, device=p.device)
                grad = torch.zeros_like(heads) if grads else None
            if grads:
                for layer, g in enumerate(torch.autograd.grad(m_rows.sum(), zs)):
                    grad[layer, rows, :T] = g.transpose(1, 2)
            resid[:, rows, :T] = torch.stack([block_inputs[name] for name in resid_names])
            heads[:, rows, :T] = torch.stack(zs).transpose(2, 3).detach()  # (L, B, T, nh, hs)
    return Run(resid, heads, m, grad)


def head_output_means(model, sequences: list[list[int]], batch_size: int = 64
                      ) -> list[torch.Tensor]:
    """Per layer (T_max, nh·hs): each head's output averaged over the sequences reaching each
    position (the heads side by side, head h in columns h*hs..(h+1)*hs)."""
    run = _capture(model, sequences, batch_size)
    heads = run.heads.flatten(-2)  # (L, N, T_max, nh·hs): out_proj's input
    lengths = torch.tensor([len(s) for s in sequences], device=heads.device)
    reach = (torch.arange(heads.size(2), device=lengths.device) < lengths[:, None])  # (N, T)
    sums = (heads * reach[None, :, :, None]).sum(1)  # (L, T_max, nh·hs)
    return list(sums / reach.sum(0)[None, :, None])


def _result(pairs: list[PatchPair], m_clean, m_counterfactual, by_position, at_all,
            method: str) -> PatchingResult:
    """A PatchingResult in float64 numpy, NaN past each pair's length."""
    by_position = by_position.double().cpu().numpy()  # (P, L, nh, T_max)
    for i, pair in enumerate(pairs):
        by_position[i, ..., len(pair.clean_ids):] = np.nan
    return PatchingResult(pairs, [], m_clean.double().cpu().numpy(),
                          m_counterfactual.double().cpu().numpy(), by_position,
                          at_all.double().cpu().numpy(), method)


@torch.inference_mode()
def patch_heads(model, pairs: list[PatchPair], batch_size: int = 64) -> PatchingResult:
    """Exact patching: every head at every position of every pair (and at all positions at
    once), counterfactual output into the clean run, each run from the cached clean residual."""
    device = next(model.parameters()).device
    targets = torch.tensor([p.target_ids for p in pairs], device=device)  # (P, 2)
    clean = _capture(model, [p.clean_ids for p in pairs], batch_size, targets)
    other = _capture(model, [p.counterfactual_ids for p in pairs], batch_size, targets)
    n_layer, _, T_max, n_head, _ = clean.heads.shape
    # one row per (pair, patched position), and per pair one with every position patched (-1);
    # pairs of similar length share batches, which then hold little padding
    order = sorted(range(len(pairs)), key=lambda i: len(pairs[i].clean_ids))
    rows = [(i, p) for i in order for p in [*range(len(pairs[i].clean_ids)), -1]]
    by_position = torch.zeros(len(pairs), n_layer, n_head, T_max, dtype=torch.float64)
    at_all = torch.zeros(len(pairs), n_layer, n_head, dtype=torch.float64)
    batches = []
    for start in range(0, len(rows), batch_size):
        chunk = rows[start:start + batch_size]
        pair, patched = torch.tensor([i for i, _ in chunk]), torch.tensor([p for _, p in chunk])
        lengths = torch.tensor([len(pairs[i].clean_ids) for i in pair.tolist()])
        T = int(lengths.max())
        at = torch.arange(T)
        where = (at == patched[:, None]) | ((patched[:, None] == -1) & (at < lengths[:, None]))
        batches.append((pair, patched, lengths - 1, where.to(device), T))
    heads = tqdm(list(itertools.product(range(n_layer), range(n_head))), desc="patching",
                 unit="head", leave=False, disable=None)
    for layer, head in heads:
        for pair, patched, last, where, T in batches:
            values = other.heads[layer, pair, :T, head]  # (R, T, hs)
            # from the layer's clean input on: the layers below it are the clean run's
            with head_replaced(model, layer, head, values, where):
                h = _tail(model, clean.resid[layer, pair, :T], layer, last.to(device))
            m = _margin(model, h, targets[pair]).double().cpu()
            one = patched >= 0
            by_position[pair[one], layer, head, patched[one]] = m[one]
            at_all[pair[~one], layer, head] = m[~one]
    return _result(pairs, clean.m, other.m, by_position, at_all, "exact")


def attribution_patch(model, pairs: list[PatchPair], batch_size: int = 64) -> PatchingResult:
    """Attribution patching: every cell of patch_heads estimated to first order from one
    forward and backward pass per batch, m_patched - m_clean ≈ (a_cf - a_clean) · ∂m/∂a."""
    targets = torch.tensor([p.target_ids for p in pairs], device=next(model.parameters()).device)
    clean = _capture(model, [p.clean_ids for p in pairs], batch_size, targets, grads=True)
    other = _capture(model, [p.counterfactual_ids for p in pairs], batch_size, targets)
    with torch.no_grad():
        terms = (other.heads - clean.heads) * clean.grads  # (L, P, T_max, nh, hs)
        moved = terms.sum(-1)  # (L, P, T_max, nh)
        moved = moved.permute(1, 0, 3, 2).double()  # (P, L, nh, T_max)
        # padding has no gradient (nothing reads it): the sum over positions is over the text
        m_clean = clean.m.double()[:, None, None]
        return _result(pairs, clean.m, other.m, m_clean[..., None] + moved,
                       m_clean + moved.sum(-1), "attribution")
