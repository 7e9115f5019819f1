"""tinylm-probe's probe types, registered in PROBE_TYPES. A type (ProbeType) is one class: the
probe lines it reads, how it scores a model (its result is an instance) and how that result goes
to probe.json, the console and TensorBoard; a new one added to PROBE_TYPES needs no other change.

    report = probe(model, tokenizer, items, ablate="mean", patch="exact")
    report.to_json(), report.console(top_heads=5), report.get(Agreement).margins
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import ClassVar, NamedTuple

import numpy as np
import torch

from tinylm.inspection.patching import PatchingResult, attribution_patch, build_pairs, patch_heads
from tinylm.inspection.probe import (
    ABLATION,
    DERIVED_WRONG_PRONOUN,
    MEAN_ABLATION,
    MIN_MARGIN_LOSS,
    MIN_PATCH_EFFECT,
    OVER_MEDIAN,
    ablate_heads,
    agreement_margins,
    baselines,
    deciding_report,
    evidence,
    head_accuracy,
    head_entries,
    mention_attention,
)
from tinylm.inspection.probe_items import (
    ProbeFileError,
    ProbeItem,
    encode_agreement_item,
    encode_attention_item,
    match_case,
    new_word_tokens,
    parse_pronoun_item,
    read_probe_lines,
)
from tinylm.inspection.probe_report import Heatmap, grid, layer_head_lines, number
from tinylm.tables import columns

CHANCE = 0.5  # of a choice between two: the baseline an accuracy heatmap is centred on


class ProbeType:
    """A probe type: a dataclass of its result with a `name`, a `score` and a `to_json`; the
    rest is optional."""

    name: ClassVar[str]  # the kind of the items it reads (ProbeItem.kind)

    @staticmethod
    def recognises(line: dict) -> bool:
        """Whether a decoded probe line is one of its items (none: it reads others')."""
        return False

    @classmethod
    def parse(cls, line: dict, where: str) -> ProbeItem:
        """The item of a line it recognises; ProbeFileError naming `where` if unusable."""
        return parse_pronoun_item(line, where, cls.name)

    @classmethod
    def score(cls, probing: Probing) -> ProbeType | None:
        """Its result on probing's model and items; None when the options do not ask for it."""
        raise NotImplementedError

    def to_json(self) -> dict:
        """Its keys of probe.json."""
        raise NotImplementedError

    def console(self, n_layer: int, n_head: int, top_heads: int) -> list[str]:
        """Its lines of the console summary."""
        return []

    def heatmaps(self) -> dict[str, Heatmap]:
        """Its layer x head heatmaps by TensorBoard tag (also saved as <tag>.png)."""
        return {}

    def summaries(self, writer) -> None:
        """Adds what the attention tab reads (tensorboard_plugin/summary.py) to a SummaryWriter."""


@dataclass
class Probing:
    """What the types score: the model, the options, the items tokenized once (those the model
    cannot read are skipped and counted), the results so far."""

    model: torch.nn.Module
    tokenizer: object
    items: list[ProbeItem]
    ablate: bool | str = False  # True or "zero": each head zeroed in turn; "mean": mean-ablated too
    patch: str | None = None  # "exact" (patching.patch_heads) or "attribution" (its estimate)
    batch_size: int = 64
    results: dict = field(default_factory=dict)  # ProbeType subclass -> its result

    def __post_init__(self):
        tokenizer, block_size = self.tokenizer, self.model.config.block_size
        self.unread: list[dict] = []  # {"source", "reason"}: items the model cannot read

        def attention(i: ProbeItem):
            return encode_attention_item(tokenizer, i, block_size)

        # the model's preference on a two-character item needs a wrong pronoun: the item's, else
        # the other gender's; "her" has none (such items are left out and counted)
        def preference(i: ProbeItem):
            wrong = i.wrong_pronoun or DERIVED_WRONG_PRONOUN.get(i.pronoun.lower())
            return wrong and encode_agreement_item(tokenizer, i, block_size, wrong)
        self.attention, (self.enc_attention, preferences) = self.fitting(
            Resolving, attention, preference)
        self.agreement, (self.enc_agreement, self.enc_names) = self.fitting(
            Agreement, lambda i: encode_agreement_item(tokenizer, i, block_size), attention)
        order = {item.source: k for k, item in enumerate(self.items)}  # as the files list them
        self.unread.sort(key=lambda skipped: order[skipped["source"]])
        self.scored = [k for k, e in enumerate(preferences) if e is not None]
        self.enc_preference = [preferences[k] for k in self.scored]
        self.pairs, self.skipped = (build_pairs(tokenizer, self.agreement, block_size)
                                    if self.patch else ([], []))
        self.new_word = new_word_tokens(tokenizer)

    def fitting(self, probe_type: type[ProbeType], *encoders: Callable
                ) -> tuple[list[ProbeItem], list[list]]:
        """probe_type's items that the model can read, and each encoder's list of them; the
        others (longer than its context, an unknown character) go to `unread`."""
        items, encoded = [], []
        for item in self.items_of(probe_type):
            try:
                encoded.append([encode(item) for encode in encoders])
            except ProbeFileError as err:
                self.unread.append({"source": item.source,
                                    "reason": str(err).removeprefix(f"{item.source}: ")})
                continue
            items.append(item)
        columns = [list(column) for column in zip(*encoded, strict=True)]
        return items, columns or [[] for _ in encoders]

    def items_of(self, probe_type: type[ProbeType]) -> list[ProbeItem]:
        return [i for i in self.items if i.kind == probe_type.name]

    @property
    def passes(self) -> list[list[list[int]]]:
        """The sequences (as ids) of each kind of forward pass, for a check of batch_size."""
        return [[e.ids for e in self.enc_attention], [e.ids for e in self.enc_names],
                [s for e in self.enc_agreement for s in (e.written, e.wrong)],
                [s for e in self.enc_preference for s in (e.written, e.wrong)],
                [s for p in self.pairs for s in (p.clean_ids, p.counterfactual_ids)]]

    def result(self, probe_type: type[ProbeType]) -> ProbeType | None:
        """probe_type's result, scored on first use: one type may read another's."""
        if probe_type not in self.results:
            self.results[probe_type] = probe_type.score(self)
        return self.results[probe_type]


def per_head(entries: list[dict], cell: Callable[[dict], str], n_layer: int, n_head: int,
             mark: dict | None = None) -> list[str]:
    """The layer x head table of per-head rows, each shown as cell(row); `mark`'s gets a *."""
    return layer_head_lines({(e["layer"], e["head"]): cell(e) for e in entries}, n_layer, n_head,
                            mark and (mark["layer"], mark["head"]))


def head_name(row: dict) -> str:
    return f"L{row['layer']}H{row['head']}"


# ---- the shipped types, in the order the console shows them ------------------------------------

class Reading(NamedTuple):
    """A causal reading the evidence table may set beside attention."""
    name: str  # in "singled out by"
    title: str  # its column
    key: str  # its value in an evidence row
    fmt: str
    said: str  # in the table's title
    rule: str  # what singles a head out


LOSS, EFFECT = f"a loss of {MIN_MARGIN_LOSS:g} nats", f"an effect of {MIN_PATCH_EFFECT:g}"
READINGS = (Reading("zeroed", "Δ margin zeroed", "delta_mean_margin", "+.3f",
                    "the margin it costs when zeroed", LOSS),
            Reading("mean", "Δ margin mean", "delta_mean_margin_mean", "+.3f", "when mean-ablated",
                    LOSS),
            Reading("patching", "patching", "patching_effect", ".2f", "its patching effect",
                    EFFECT))


@dataclass
class Deciding(ProbeType):
    """Every head at the deciding position (the token before the pronoun, where a causal model
    chooses it): its attention to the name, whether its preference between two characters matches
    the model's, and the causal readings beside it."""

    name: ClassVar[str] = "deciding"
    agreement_attention: list[dict]  # per head: mean_attention, over all items and two parts
    prediction_match: list[dict]  # per head: match, correlation
    n_agreement: int
    n_attention: int  # two-character items with a wrong pronoun
    n_attention_left_out: int  # those without one
    n_name_first_word: int
    evidence: list[dict] | None = None  # probe.evidence's rows, when a causal reading was measured
    measured: tuple[Reading, ...] = ()  # those readings

    @classmethod
    def score(cls, p: Probing) -> Deciding:
        result = cls(**deciding_report(p.model, p.enc_names, p.enc_attention, p.scored,
                                       p.enc_preference, p.new_word, p.batch_size))
        agreement, patching = p.result(Agreement), p.result(Patching)
        effects = patching and patching.result and head_entries({"effect": patching.effects})
        found = {"zeroed": agreement.ablation, "mean": agreement.mean_ablation,
                 "patching": effects}
        result.measured = tuple(r for r in READINGS if found[r.name])
        if result.agreement_attention and (agreement.ablation or effects):
            result.evidence = evidence(result.agreement_attention, agreement.ablation,
                                       agreement.mean_ablation, effects)
        return result

    @property
    def best(self) -> dict:
        """The head that gives the name the most attention (the first of ties)."""
        return max(self.agreement_attention, key=lambda h: h["mean_attention"])

    def to_json(self) -> dict:
        scored = self.n_agreement or self.n_attention or self.n_attention_left_out  # any item
        section = {f.name: getattr(self, f.name) for f in fields(self)[:6]}  # deciding_report's
        best = self.best if self.agreement_attention else None
        return {"deciding": section if scored else None, "evidence": self.evidence,
                "best_deciding": best and {k: best[k] for k in ("layer", "head", "mean_attention")}}

    def console(self, n_layer: int, n_head: int, top_heads: int) -> list[str]:
        lines = self.evidence_lines(top_heads) if self.evidence else []
        if self.agreement_attention:
            best, n_first = self.best, self.n_name_first_word
            lines += [f"deciding: attention from the token before the pronoun (where the model "
                      f"chooses it) to the name, {self.n_agreement} agreement items;",
                      f"all items (name first word: {n_first} items / name later: "
                      f"{self.n_agreement - n_first} items), * = most"]
            lines += per_head(self.agreement_attention, lambda e: (
                f"{e['mean_attention']:.2f} ({number(e['mean_attention_name_first_word'], '.2f')}"
                f"/{number(e['mean_attention_name_later'], '.2f')})"), n_layer, n_head, best)
            lines.append(f"best deciding head: layer {best['layer']} head {best['head']}, "
                         f"attention to the name {best['mean_attention']:.2f}")
        if self.prediction_match:
            lines += [f"prediction match: {self.n_attention} two-character items; share on which "
                      "the head's attention at the deciding position prefers the character",
                      "whose pronoun the model prefers (sign of attention to antecedent - "
                      "distractor vs log P(written) - log P(wrong)), with Pearson's r"]
            lines += per_head(self.prediction_match, lambda e: (
                f"{e['match']:.2f} r={number(e['correlation'], '+.2f')}"), n_layer, n_head)
        if self.n_attention_left_out:
            lines.append(f"prediction match: {self.n_attention_left_out} two-character items left "
                         "out: no wrong pronoun (\"her\" is object or possessive, so it has no "
                         "derived one; give wrong_pronoun to score them)")
        return lines

    def evidence_lines(self, top_heads: int) -> list[str]:
        """The evidence table: per head, attention to the name beside every causal reading
        measured, the heads each singles out, and where they part."""
        rows, measured = self.evidence, self.measured
        # the heads first by each reading: most attention, the largest changes either way
        picks = [sorted((r for r in rows if r[key] is not None), key=lambda r: -abs(r[key]))
                 [:top_heads] for key in ("mean_attention", *(r.key for r in measured))]
        shown = sorted({head_name(r): r for pick in picks for r in pick}.values(),
                       key=lambda r: -r["mean_attention"])
        names = ["attention", *(r.name for r in measured)]
        # a rule two readings share is said once
        rules = dict.fromkeys([f"attention {OVER_MEDIAN:g}x the median head's",
                               *(r.rule for r in measured)])
        lines = [f"evidence: each head's attention from the token before the pronoun to the name "
                 f"({self.n_agreement} agreement items), beside "
                 f"{', '.join(r.said for r in measured)};",
                 f"the {top_heads} heads first by each; a reading singles a head out at "
                 f"{', '.join(rules)}"]
        lines += columns(
            ["layer", "head", "attention to name", *(r.title for r in measured), "singled out by"],
            [[str(row["layer"]), str(row["head"]), f"{row['mean_attention']:.2f}",
              *(number(row[r.key], r.fmt) for r in measured),
              ", ".join(row["singled_out_by"]) or "-"] for row in shown],
            ">>>" + ">" * len(measured) + "<", gaps=2, indent="  ")
        for name in names:
            heads = [head_name(r) for r in rows if name in r["singled_out_by"]]
            lines.append(f"  singled out by {name}: {' '.join(heads) or 'no head'}")
        split = [f"{head_name(r)} ({', '.join(r['singled_out_by'])})" for r in rows
                 if 0 < len(r["singled_out_by"]) < len(names)]
        lines.append(f"  where they part: {'; '.join(split) or 'nowhere'}")
        if "mean" in names:
            moved = [f"{head_name(r)} {r['delta_mean_margin']:+.3f} zeroed, "
                     f"{r['delta_mean_margin_mean']:+.3f} mean" for r in rows
                     if abs(r["delta_mean_margin"]) >= MIN_MARGIN_LOSS
                     and abs(r["delta_mean_margin_mean"]) < MIN_MARGIN_LOSS]
            lines.append("  moved by zeroing, not by mean-ablation (a silent head is an input "
                         f"the model never saw): {'; '.join(moved) or 'no head'}")
        return lines

    def heatmaps(self) -> dict[str, Heatmap]:
        maps, n_first = {}, self.n_name_first_word
        for key, items in (("", f"{self.n_agreement} items"),
                           ("_name_first_word", f"{n_first} items with the name first"),
                           ("_name_later", f"{self.n_agreement - n_first} items with the name "
                            "later")) if self.agreement_attention else ():
            maps["probe/deciding_attention" + key] = Heatmap(
                grid(self.agreement_attention, "mean_attention" + key),
                f"deciding: token before the pronoun -> name ({items})", "attention")
        if self.prediction_match:
            maps["probe/prediction_match"] = Heatmap(
                grid(self.prediction_match, "match"),
                f"deciding attention predicts the model's pronoun ({self.n_attention} items)",
                "share of items", center=CHANCE)
            maps["probe/prediction_correlation"] = Heatmap(
                grid(self.prediction_match, "correlation"),
                "deciding attention difference vs log P difference", "Pearson r", "{:+.2f}", 0.0)
        return maps


@dataclass
class Patching(ProbeType):
    """Activation patching (patching.py) over the agreement items' counterfactual pairs: which
    heads carry the name's gender to the pronoun, as causes."""

    name: ClassVar[str] = "patching"
    LEVEL: ClassVar[float] = 0.95  # of the bootstrap intervals
    result: PatchingResult | None  # None: no pair could be made
    skipped: list[dict]  # build_pairs': {"source", "reason"}
    clean_tokens: list[list[str]] = field(default_factory=list)  # per pair, as text
    target_tokens: list[list[str]] = field(default_factory=list)  # its two pronoun tokens

    @classmethod
    def score(cls, p: Probing) -> Patching | None:
        if not p.patch:
            return None
        if not p.pairs:
            return cls(None, p.skipped)
        patched = patch_heads if p.patch == "exact" else attribution_patch
        return cls(patched(p.model, p.pairs, p.batch_size), p.skipped,
                   [p.tokenizer.token_strings(pair.clean_ids) for pair in p.pairs],
                   [p.tokenizer.token_strings(pair.target_ids) for pair in p.pairs])

    @property
    def effects(self) -> np.ndarray:
        return self.result.effects()  # (L, nh), NaN: undefined

    def to_json(self) -> dict:
        if self.result is None:
            return {"patching": None}
        section = self.result.to_json(self.skipped, level=self.LEVEL)
        for entry, clean, target in zip(section["pairs"], self.clean_tokens, self.target_tokens,
                                        strict=True):
            # the words, for a reader of the JSON and for the console's strongest cells
            entry["clean_tokens"], entry["target_tokens"] = clean, target
        return {"patching": section}

    def console(self, n_layer: int, n_head: int, top_heads: int) -> list[str]:
        """The layer x head effects with their intervals, and the strongest (layer, head,
        position) cells with the tokens there."""
        if self.result is None:
            return []
        r = self.result
        how = ("(the other name) into the clean one" if r.method == "exact"
               else "into the clean one, estimated to first order from gradients")
        skipped = (f"{len(self.skipped)} skipped: the report lists each and why"
                   if self.skipped else "none skipped")
        lines = [f"patching ({r.method}): each head's output copied from the counterfactual text "
                 f"{how}, at every position at once, over {len(r.pairs)} pairs ({skipped});",
                 "effect = the share of the counterfactual's change in log P(pronoun) - log P("
                 f"wrong pronoun) it moves, [{self.LEVEL:.0%} bootstrap interval], * = largest"]
        clean, other = np.mean(r.m_clean), np.mean(r.m_counterfactual)
        # the effects' common denominator: near 0, they are ratios of noise
        lines.append(f"the name moves m by {other - clean:+.3f} on average (clean {clean:+.3f}, "
                     f"counterfactual {other:+.3f} nats)")
        if abs(other - clean) < MIN_MARGIN_LOSS:
            lines.append(f"warning: under {MIN_MARGIN_LOSS:g} nats, every effect below is a ratio "
                         "over noise: the model barely tells the names apart, or the partners "
                         "share their gender")
        if len(r.pairs) == 1:
            lines.append("note: one pair, so the bootstrap intervals (which resample the pairs) "
                         "have no width; patch more pairs for an interval")
        effects, intervals = self.effects, r.intervals(level=self.LEVEL)
        heads = [(layer, head) for layer in range(n_layer) for head in range(n_head)]
        strongest = max((k for k in heads if np.isfinite(effects[k])), key=lambda k: effects[k],
                        default=None)
        lines += layer_head_lines(
            {k: f"{number(effects[k], '+.2f')} [{number(intervals[k][0], '+.2f')},"
                f"{number(intervals[k][1], '+.2f')}]" for k in heads}, n_layer, n_head, strongest)
        by_position = r.effects_by_position()  # (L, nh, T_max), the deciding position last
        cells = sorted(((layer, head, back, value) for layer, head in heads
                        for back, value in enumerate(by_position[layer, head, ::-1])
                        if np.isfinite(value)), key=lambda cell: -abs(cell[3]))
        lines.append(f"the {top_heads} strongest (layer, head, position) cells; positions counted "
                     "back from the deciding token (the one before the pronoun), with the tokens "
                     "found there")
        rows = []
        for layer, head, back, value in cells[:top_heads]:
            tokens = Counter(clean[pair.position - back]
                             for pair, clean in zip(r.pairs, self.clean_tokens, strict=True)
                             if pair.position >= back)
            rows.append([str(layer), str(head), "deciding" if back == 0 else f"-{back}",
                         f"{value:+.2f}",
                         ", ".join(f"{t!r} x{k}" for t, k in tokens.most_common(3))])
        lines += columns(["layer", "head", "position", "effect", "tokens there (most frequent)"],
                         rows, ">>>><", gaps=2, indent="  ")
        return lines

    def heatmaps(self) -> dict[str, Heatmap]:
        if self.result is None:
            return {}
        return {"probe/patching_effect": Heatmap(
            self.effects, f"patching ({self.result.method}): share of the name's effect each head "
            f"carries ({len(self.result.pairs)} pairs)", "effect", "{:+.2f}", 0.0)}

    def summaries(self, writer) -> None:
        """The effects, their intervals, and each pair's own effect at each position of its clean
        text, beside the pairs' words."""
        from tinylm.inspection.tensorboard_plugin.summary import write_patching

        if self.result is None:
            return
        r = self.result
        shown = [{"source": pair.source, "tokens": clean, "position": pair.position,
                  "m_clean": m_clean, "m_counterfactual": m_other, "pronoun": target[0],
                  "wrong_pronoun": target[1]}
                 for pair, clean, target, m_clean, m_other in zip(
                     r.pairs, self.clean_tokens, self.target_tokens, r.m_clean,
                     r.m_counterfactual, strict=True)]
        write_patching(writer, self.effects, r.intervals(level=self.LEVEL), r.pair_effects(),
                       shown, len(self.skipped), self.LEVEL)


@dataclass
class Resolving(ProbeType):
    """Two-character items: which heads attend from the pronoun more to the antecedent than to
    the distractor (accuracy, beside the baselines of choosing by position)."""

    name: ClassVar[str] = "attention"
    n: int
    antecedent: np.ndarray | None = None  # (N, L, nh): attention from the pronoun to it
    distractor: np.ndarray | None = None
    baselines: dict[str, float] | None = None

    @staticmethod
    def recognises(line: dict) -> bool:
        return "distractor_chars" in line

    @classmethod
    def score(cls, p: Probing) -> Resolving:
        if not p.attention:
            return cls(0)
        ante, distr = mention_attention(p.model, p.enc_attention, p.batch_size)
        return cls(len(p.attention), ante, distr, baselines(p.attention))

    @property
    def accuracy(self) -> np.ndarray:
        return head_accuracy(self.antecedent, self.distractor)  # (L, nh)

    @property
    def best(self) -> tuple[int, int]:
        """The most accurate head (the first of ties: lowest layer)."""
        layer, head = np.unravel_index(np.argmax(self.accuracy), self.accuracy.shape)
        return int(layer), int(head)

    def to_json(self) -> dict:
        if not self.n:
            return {"n": 0, "heads": [], "best": None, "baselines": None}
        accuracy, (layer, head) = self.accuracy, self.best
        heads = head_entries({"accuracy": accuracy,
                              "mean_antecedent_attention": self.antecedent.mean(axis=0),
                              "mean_distractor_attention": self.distractor.mean(axis=0)})
        return {"n": self.n, "heads": heads, "baselines": self.baselines,
                "best": {"layer": layer, "head": head, "accuracy": float(accuracy[layer, head])}}

    def console(self, n_layer: int, n_head: int, top_heads: int) -> list[str]:
        if not self.n:
            return ["attention: no two-character items (with distractor_chars) in the probe set"]
        accuracy, (layer, head), b = self.accuracy, self.best, self.baselines
        lines = [f"resolving: {self.n} two-character items; accuracy = share of items on which "
                 "the head's attention",
                 "from the pronoun goes more to the antecedent than to the distractor (* = best)"]
        lines += layer_head_lines({(l, h): f"{accuracy[l, h]:.2f}" for l in range(n_layer)
                                   for h in range(n_head)}, n_layer, n_head, (layer, head))
        lines.append(f"best head: layer {layer} head {head}, accuracy {accuracy[layer, head]:.2f}"
                     f"; baselines: nearest mention {b['nearest mention']:.2f}, first mention "
                     f"{b['first mention']:.2f}")
        return lines

    def heatmaps(self) -> dict[str, Heatmap]:
        if not self.n:
            return {}
        return {"probe/attention_accuracy": Heatmap(
            self.accuracy, f"pronoun -> antecedent accuracy ({self.n} items)", "accuracy",
            center=CHANCE)}

    def summaries(self, writer) -> None:
        """The accuracy grid the attention tab draws."""
        from tinylm.inspection.tensorboard_plugin.summary import write_probe

        if self.n:
            write_probe(writer, self.n, self.accuracy)


@dataclass
class Agreement(ProbeType):
    """One-character items: does the model prefer the name's pronoun to the wrong one as whole
    words (the margin, in nats), and which heads does that need (each removed in turn)?"""

    name: ClassVar[str] = "agreement"
    items: list[ProbeItem]
    margins: torch.Tensor | None  # (N,) log P(pronoun) - log P(wrong pronoun); None: no items
    ablate: bool | str = False  # the option: which ablations were asked for
    ablation: list[dict] | None = None  # probe.ablate_heads' rows, each head zeroed
    mean_ablation: list[dict] | None = None  # ... each head mean-ablated

    @staticmethod
    def recognises(line: dict) -> bool:
        return "distractor_chars" not in line

    @classmethod
    def score(cls, p: Probing) -> Agreement:
        if not p.agreement:
            return cls([], None, p.ablate)
        margins = agreement_margins(p.model, p.enc_agreement, p.new_word, None, p.batch_size)
        result = cls(p.agreement, margins, p.ablate)
        if p.ablate:
            result.ablation = ablate_heads(p.model, p.enc_agreement, p.new_word, p.batch_size,
                                           margins)
        if p.ablate == MEAN_ABLATION:
            result.mean_ablation = ablate_heads(p.model, p.enc_agreement, p.new_word,
                                                p.batch_size, margins, MEAN_ABLATION)
        return result

    @property
    def accuracy(self) -> float:
        return float((self.margins > 0).float().mean())

    def to_json(self) -> dict:
        section = None if self.margins is None else {
            "n": len(self.items), "accuracy": self.accuracy,
            "mean_margin": float(self.margins.mean()),
            "items": [{"source": i.source, "pronoun": i.pronoun,
                       "wrong_pronoun": match_case(i.wrong_pronoun, i.pronoun), "margin": float(m)}
                      for i, m in zip(self.items, self.margins, strict=True)]}
        mean = {"mean_ablation": self.mean_ablation} if self.ablate == MEAN_ABLATION else {}
        return {"agreement": section, "ablation": self.ablation, **mean}

    def console(self, n_layer: int, n_head: int, top_heads: int) -> list[str]:
        if self.margins is None:
            return ["agreement: no one-character items (with wrong_pronoun) in the probe set"]
        n = len(self.items)
        lines = [f"agreement: {n} one-character items, accuracy {self.accuracy:.2f} (share with "
                 "log P(pronoun) > log P(wrong pronoun)), mean margin "
                 f"{float(self.margins.mean()):+.3f} nats"]
        for entries, how in ((self.ablation, f"each head {ABLATION} in turn"),
                             (self.mean_ablation, "each head replaced in turn by its mean "
                              "output at each position over the texts")):
            if not entries:
                continue
            ranked = sorted(entries, key=lambda e: -abs(e["delta_mean_margin"]))
            lines.append(f"ablation: {how}, over the {n} agreement items; the "
                         f"{min(top_heads, len(ranked))} heads that move the mean margin most")
            lines += columns(
                ["layer", "head", "Δ mean margin", "Δ accuracy", "mean margin", "accuracy"],
                [[str(e["layer"]), str(e["head"]), f"{e['delta_mean_margin']:+.3f}",
                  f"{e['delta_accuracy']:+.2f}", f"{e['mean_margin']:+.3f}",
                  f"{e['accuracy']:.2f}"] for e in ranked[:top_heads]],
                ">>>>>>", gaps=(2, 3, 3, 3, 3), indent="  ")
        if self.mean_ablation and n == 1:
            lines.append("note: one item, so each head's mean output is its own output there and "
                         "mean-ablation moves (almost) nothing; give more agreement items")
        return lines

    def heatmaps(self) -> dict[str, Heatmap]:
        maps = {}
        for part, entries, how in (("ablation", self.ablation, ABLATION),
                                   ("mean_ablation", self.mean_ablation, "mean-ablated")):
            for key in ("delta_mean_margin", "delta_accuracy") if entries else ():
                maps[f"probe/{part}_{key}"] = Heatmap(
                    grid(entries, key),
                    f"agreement: change in {key[6:].replace('_', ' ')} with the head {how}",
                    key.replace("_", " "), "{:+.2f}", 0.0)
        return maps


# Every probe type, in the order the console shows them; a new type is added here.
PROBE_TYPES: list[type[ProbeType]] = [Deciding, Patching, Resolving, Agreement]
# probe.json keeps the key order of its earlier versions; a new type's keys follow them
JSON_ORDER = ("n", "heads", "best", "baselines", "agreement", "ablation", "deciding", "evidence",
              "best_deciding", "mean_ablation", "patching")


@dataclass
class ProbeReport:
    """Every registered type's result, in PROBE_TYPES' order (None: not asked for)."""

    results: dict[type[ProbeType], ProbeType | None]
    n_layer: int
    n_head: int
    unread: list[dict] = field(default_factory=list)  # items skipped: {"source", "reason"}

    def get(self, probe_type: type[ProbeType]) -> ProbeType | None:
        return self.results.get(probe_type)

    def shown(self) -> list[ProbeType]:
        return [r for r in self.results.values() if r is not None]

    def to_json(self) -> dict:
        """The report as probe.json holds it (without the command's keys)."""
        merged = {key: value for r in self.shown() for key, value in r.to_json().items()}
        skipped = {"n_skipped_items": len(self.unread), "skipped_items": self.unread}
        return {**{k: merged.pop(k) for k in JSON_ORDER if k in merged}, **merged,
                **(skipped if self.unread else {})}

    def console(self, top_heads: int = 5) -> list[str]:
        first = self.unread[0] if self.unread else None
        skipped = [f"{len(self.unread)} probe items skipped: the model cannot read them (the "
                   f"first: {first['source']}: {first['reason']}); probe.json lists each under "
                   "skipped_items"] if first else []
        return skipped + [line for r in self.shown()
                          for line in r.console(self.n_layer, self.n_head, top_heads)]


def probe(model, tokenizer, items: list[ProbeItem], ablate: bool | str = False,
          batch_size: int = 64,
          before_work: Callable[[list[list[list[int]]]], None] | None = None,
          patch: str | None = None) -> ProbeReport:
    """Score every registered probe type on the items (`ablate`, `patch`: Probing's). Once every
    item is tokenized, before any model work, `before_work(passes)` sees the sequences of each
    kind of forward pass: the command refuses a batch_size there that cannot be held."""
    probing = Probing(model, tokenizer, items, ablate, patch, batch_size)
    if before_work is not None:
        before_work(probing.passes)
    c = model.config
    return ProbeReport({t: probing.result(t) for t in PROBE_TYPES}, c.n_layer, c.n_head,
                       probing.unread)


def parse_item(obj, where: str) -> ProbeItem:
    """One decoded JSONL line as the probe type that recognises it parses it (ProbeFileError if
    unusable); read_probe_lines resolves and checks its counterfactual."""
    if not isinstance(obj, dict):
        raise ProbeFileError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    # the last registered first: a new type may claim lines that a shipped one reads by default
    # (agreement: every line without distractor_chars)
    probe_type = next((t for t in reversed(PROBE_TYPES) if t.recognises(obj)), None)
    if probe_type is None:
        raise ProbeFileError(f"{where}: no probe type reads this line")
    return probe_type.parse(obj, where)


def load_probe_file(path: str | Path) -> list[ProbeItem]:
    """Every line of a JSONL probe file, checked and read by the type that recognises it."""
    return read_probe_lines(path, parse_item)
