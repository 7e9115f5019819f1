"""The TensorBoard backend of the attention tab: its ES module, the texts, weights, probe scores.

Routes (under /data/plugin/tinylm_attention/):
    /index.js, /style.css,   the frontend, served from static/ (no CDN, no build step)
    /arithmetic.js
    /texts                   every (run, text, step) with tinylm attention, what each holds (its
                             sentence, who wrote it), and what was skipped
    /attention?run=&tag=     one text's JSON content, cut to the tokens the model read
    /weights?run=&tag=       its weights: raw little-endian float16 bytes, (L, nh, T, T)
    /arithmetic?run=&tag=&layer=&head=&query=   the steps behind one weight (arithmetic.py)
    /probes                  layer x head accuracy of each tinylm-probe report in the logdir,
                             with its chance level and what it reads
    /patching                each activation-patching report: layer x head effects, intervals,
                             its pairs (their sentences, without their tokens)
    /patching_pair?run=&pair=  one pair: its clean tokens and (L, nh, T) effects per position

Numbers a route cannot define (a patching effect over no difference) are served as null.

Everything served comes from TensorBoard's data provider: the summaries it loaded from the
logdir's event files (it skips a record cut off by a crash), looked up by the run and tag names it
lists, never opened as paths; this plugin opens no file of the logdir. A run folder that resolves
outside the logdir (a link to elsewhere) is not served; one that a writer killed mid-write left
behind (a hidden folder, `.<name>.tmp-<pid>-<hex>` as tinylm's writers name theirs, or a `*.tmp`
one) is not a run: it is never listed nor served.

A logdir may hold anything. A summary that cannot be served (of another format version, crafted,
of a size beyond the bounds below) is skipped and listed with the reason among the route's
problems; a route answers strict JSON (no NaN) whose size the model's shape bounds: a text is
checked against the limits below before anything of it is served.
"""

from __future__ import annotations

import json
import math
import os
import pkgutil
import re
import sys
from pathlib import Path

import numpy as np
from tensorboard import plugin_util
from tensorboard.backend import http_util
from tensorboard.data import provider
from tensorboard.plugins import base_plugin
from werkzeug import wrappers

from tinylm.inspection.capture import FEMALE_NAMES, MALE_NAMES, PERSON_PRONOUNS, PRONOUN_GENDER
from tinylm.inspection.tensorboard_plugin import PLUGIN_NAME, PROBE_PLUGIN_NAME, arithmetic
from tinylm.inspection.tensorboard_plugin.summary import (
    FORMAT_VERSION,
    PATCHING_POSITIONS_TAG,
    PATCHING_TAG,
    PROBE_READS,
    PROBE_TAG,
)

STATIC_FILES = {"/index.js": "text/javascript", "/style.css": "text/css",
                "/" + arithmetic.STATIC: "text/javascript"}
HOW_TO_MAKE_DATA = ("No tinylm attention in this logdir. Train a run (tinylm-train), which writes "
                    "the probe prompt's attention at every evaluation, or inspect a text: "
                    "tinylm-generate checkpoint=<run dir> prompt=\"...\" inspect=true; then point "
                    "tensorboard --logdir at that run dir.")
# The largest text served: far above any tinylm model (GPT-2 has 12 layers x 12 heads over 1024
# tokens), and weights of at most 2**26 float16 numbers (128 MiB), about what a tab can draw.
MAX_LAYERS, MAX_HEADS, MAX_TOKENS, MAX_WEIGHTS = 64, 64, 1024, 2**26
MAX_CHARS = 256  # of one token, word, text name or note; no tokenizer makes longer ones
MAX_CONTENT_BYTES = 2**24  # a text's description holds the whole text, as long as it may be
SENTENCE_CHARS = 80  # of a text or a pair, as the pickers name it
# A patching report: effects per pair, layer, head and position that decode in a blink (GPT-2's
# 144 heads over 1,024 pairs of 64 tokens are 9.4M); within that, as many pairs as its
# description holds (MAX_CONTENT_BYTES): the shipped agreement set has 108.
MAX_PATCHED = 2**24
MAX_PAIRS = MAX_PATCHED  # one effect per pair at least
PATCHING_TAGS = [PATCHING_TAG, PATCHING_POSITIONS_TAG]
# Who wrote a text, from its name: training (the probe prompt at each evaluation), tinylm-probe
# (the clean text of a patched pair) or inspect=true (any other name).
TRAINING_TEXT, PROBE_TEXT = "probe_prompt", re.compile(r"patching/pair_(\d+)")
# A folder a killed writer left: hidden (tinylm's writers build in `.<name>.tmp-<pid>-<hex>`, and
# move an old folder aside as `.<name>.old-<pid>-<hex>`), or named `*.tmp` as other writers do.
LEFTOVER_PART = re.compile(r"^\.(?!\.?$)|\.tmp$|\.tmp-")


class Skipped(ValueError):
    """Something in the logdir that is not served; the message says why, for the tab."""


def _json(request, data, code: int = 200) -> wrappers.Response:
    return http_util.Respond(request, json.dumps(data, allow_nan=False), "application/json",
                             code=code)


def _where(request) -> dict:
    """The data provider's context and experiment id of a request, as keyword arguments."""
    return {"ctx": plugin_util.context(request.environ),
            "experiment_id": plugin_util.experiment_id(request.environ)}


def _require(ok: bool, why: str) -> None:
    if not ok:
        raise Skipped(why)


def _is_int(value, low: int, high: int) -> bool:
    """An int (not a bool) with low <= value < high."""
    return type(value) is int and low <= value < high


def _is_text(value) -> bool:
    return isinstance(value, str) and len(value) <= MAX_CHARS


def _is_number(value) -> bool:
    """An int or float (not a bool) within a float's finite range: what strict JSON can hold.
    Compared, not converted: an int of 400 digits is out of range, never an OverflowError."""
    return type(value) in (int, float) and abs(value) <= sys.float_info.max  # NaN: False


def is_leftover(run: str) -> bool:
    """Whether a run lies in a folder a killed writer left behind (LEFTOVER_PART): not a run."""
    return any(LEFTOVER_PART.search(part) for part in re.split(r"[\\/]", run))


def sentence(text: str, ends: bool = False) -> str:
    """A text as a picker names it, its whitespace made single spaces: its first SENTENCE_CHARS
    characters, "…" where it was cut; with `ends`, its start and its end around the "…"."""
    if len(text) > 4 * SENTENCE_CHARS:  # only its ends can show: fold no more than those
        head = text[:2 * SENTENCE_CHARS]
        text = head + " " + text[-2 * SENTENCE_CHARS:] if ends else head
    text = " ".join(text.split())
    if len(text) <= SENTENCE_CHARS:
        return text
    if not ends:
        return text[:SENTENCE_CHARS - 1].rstrip() + "…"
    half = SENTENCE_CHARS // 2
    return text[:half].rstrip() + " … " + text[3 - half:].lstrip()


def text_kind(name: str) -> str:
    """"training", "probe" or "inspect": who wrote a text of this name (see TRAINING_TEXT)."""
    return ("training" if name == TRAINING_TEXT else "probe" if PROBE_TEXT.fullmatch(name)
            else "inspect")


def _nan_as_null(array: np.ndarray) -> list:
    """`array` as nested lists with None for NaN (an undefined number): strict JSON has no NaN."""
    values = array.astype(object)
    values[np.isnan(array)] = None
    return values.tolist()


def read_description(raw: bytes | str, kind: str) -> dict:
    """A summary's JSON description, of this tinylm's format version; Skipped if it is not JSON
    (cut off, not UTF-8, nested deeper than Python's recursion limit) or not `kind`'s."""
    _require(len(raw) <= MAX_CONTENT_BYTES, f"its description is over {MAX_CONTENT_BYTES} bytes")
    try:
        content = json.loads(raw)
    except (ValueError, RecursionError):  # UnicodeDecodeError is a ValueError
        raise Skipped("its description is not readable JSON (truncated?)") from None
    _require(isinstance(content, dict) and "version" in content,
             f"its description is not {kind}")
    version = content["version"]
    _require(version == FORMAT_VERSION, (
        f"written in {kind} format {str(version)[:20]}; this tinylm reads format "
        f"{FORMAT_VERSION} (write it again with this version)"))
    return content


def read_content(raw: bytes | str | dict) -> dict:
    """One text's description (or read_description's reading of it), checked, as the tab reads
    it: the tokens the model read, the words they belong to (renumbered in order), the pronouns
    and names among those words, each layer's key/value heads. Its size is bounded by the checked
    shape (L, nh, T, T): T tokens and at most T words of MAX_CHARS, L counts."""
    content = raw if isinstance(raw, dict) else read_description(raw, "tinylm attention")
    shape = content.get("shape")
    _require(isinstance(shape, list) and len(shape) == 4 and _is_int(shape[0], 1, MAX_LAYERS + 1)
             and _is_int(shape[1], 1, MAX_HEADS + 1) and _is_int(shape[2], 1, MAX_TOKENS + 1)
             and shape[3] == shape[2] and math.prod(shape) <= MAX_WEIGHTS,
             f"its shape is not (layers <= {MAX_LAYERS}, heads <= {MAX_HEADS}, T, T) with "
             f"T <= {MAX_TOKENS} and at most {MAX_WEIGHTS} weights")
    t, words, tokens = shape[2], content.get("words"), content.get("tokens")
    token_words = content.get("token_words")
    _require(isinstance(words, list) and isinstance(tokens, list) and len(tokens) == t
             and all(map(_is_text, tokens)) and isinstance(token_words, list)
             and len(token_words) == t
             and all(_is_int(w, -1, len(words)) for w in token_words),
             f"its tokens and their words are not {t} tokens of at most {MAX_CHARS} characters "
             "each, with a word index each")
    kept = sorted({w for w in token_words if w >= 0})  # the words of the tokens the model read
    number = {w: i for i, w in enumerate(kept)}
    served = {"version": content["version"], "name": content.get("name"),
              "step": content.get("step"), "shape": shape, "tokens": tokens,
              "words": [words[w] for w in kept],
              "token_words": [number.get(w, -1) for w in token_words],
              "window_note": content.get("window_note", ""),
              # absent (tinylm's own models, data written before it was recorded): every head
              # has its own key/value head
              "kv_heads": content.get("kv_heads", [shape[1]] * shape[0])}
    kv = served["kv_heads"]
    _require(isinstance(kv, list) and len(kv) == shape[0]
             and all(_is_int(n, 1, shape[1] + 1) and shape[1] % n == 0 for n in kv),
             f"its kv_heads are not {shape[0]} counts of key/value heads that divide its "
             f"{shape[1]} heads")
    for key in ("pronouns", "names"):
        indices = content.get(key)
        _require(isinstance(indices, list) and all(_is_int(w, 0, len(words)) for w in indices),
                 f"its {key} are not word indices")
        served[key] = sorted({number[w] for w in indices if w in number})
    _require(_is_text(served["name"]) and served["name"] != "" and _is_int(served["step"], 0, 2**63)
             and all(map(_is_text, served["words"])) and _is_text(served["window_note"]),
             f"its name, step, words or note are not texts of at most {MAX_CHARS} characters "
             "and a step number")
    # what the readings may mean, from capture.py's lists (data of any age gets them): the
    # pronouns read against names (not "it"), and the gender of pronouns and listed names, so
    # that a head pointing at a name of the other gender is flagged
    shown = served["words"]
    served["person_pronouns"] = [w for w in served["pronouns"] if shown[w] in PERSON_PRONOUNS]
    names = set(served["names"])
    for gender, listed in (("female", FEMALE_NAMES), ("male", MALE_NAMES)):
        served[f"{gender}_words"] = [
            w for w, word in enumerate(shown)
            if (w in names and word in listed) or (w in served["person_pronouns"]
                                                   and PRONOUN_GENDER.get(word) == gender)]
    return served


def read_listed(raw: bytes | str) -> dict:
    """One text as /texts lists it: read_content's checks, its name and step, who wrote it and
    the start of its text (its sentence), for a picker a class can read."""
    description = read_description(raw, "tinylm attention")
    content, text = read_content(description), description.get("text")
    if not isinstance(text, str):  # a description without its text: its words
        text = " ".join(content["words"])
    return {"name": content["name"], "step": content["step"], "kind": text_kind(content["name"]),
            "sentence": sentence(text)}


def read_pair(pair, i: int, t_max: int) -> dict:
    """Pair i of a patching report's description, checked: 1..t_max clean tokens, the deciding
    position among them, finite margins, its pronouns; its source cut to MAX_CHARS."""
    _require(isinstance(pair, dict), f"its pair {i} is not an object")
    tokens = pair.get("tokens")
    _require(isinstance(tokens, list) and 1 <= len(tokens) <= t_max
             and all(map(_is_text, tokens)), f"its pair {i} has not 1..{t_max} tokens of at most "
             f"{MAX_CHARS} characters")
    _require(_is_int(pair.get("position"), 0, len(tokens)),
             f"its pair {i}'s position is not one of its {len(tokens)} tokens")
    _require(_is_number(pair.get("m_clean")) and _is_number(pair.get("m_counterfactual")),
             f"its pair {i}'s margins are not finite numbers")
    _require(_is_text(pair.get("pronoun")) and _is_text(pair.get("wrong_pronoun"))
             and isinstance(pair.get("source"), str),
             f"its pair {i}'s source and pronouns are not texts")
    return {"source": pair["source"][:MAX_CHARS], "tokens": tokens,
            # the pair named as a class reads it: its clean text, up to and with its pronoun
            "text": sentence("".join(tokens) + pair["pronoun"], ends=True),
            **{key: pair[key] for key in ("position", "m_clean", "m_counterfactual", "pronoun",
                                          "wrong_pronoun")}}


def read_patching(raw: bytes | str) -> dict:
    """A patching report's description, checked: its shape (P, L, nh, T_max) within the bounds,
    the pairs skipped, the intervals' level, P pairs."""
    content = read_description(raw, "a tinylm patching report")
    shape = content.get("shape")
    _require(isinstance(shape, list) and len(shape) == 4 and _is_int(shape[0], 0, MAX_PAIRS + 1)
             and _is_int(shape[1], 1, MAX_LAYERS + 1) and _is_int(shape[2], 1, MAX_HEADS + 1)
             and _is_int(shape[3], 0, MAX_TOKENS + 1) and math.prod(shape) <= MAX_PATCHED,
             f"its shape is not (pairs, layers <= {MAX_LAYERS}, heads <= {MAX_HEADS}, "
             f"T <= {MAX_TOKENS}) with at most {MAX_PATCHED} effects")
    _require(_is_int(content.get("n_skipped"), 0, 2**63),
             "its count of skipped pairs is not a number")
    level = content.get("interval_level")
    _require(level is None or (_is_number(level) and 0 < level < 1),
             "its interval level is not a number between 0 and 1")
    pairs = content.get("pairs")
    _require(isinstance(pairs, list) and len(pairs) == shape[0],
             f"its pairs are not a list of {shape[0]}")
    return {"shape": shape, "n_skipped": content["n_skipped"], "interval_level": level,
            "pairs": [read_pair(pair, i, shape[3]) for i, pair in enumerate(pairs)]}


def read_floats(array, what: str, fits, shape: str) -> np.ndarray:
    """`array` if it holds floats in a shape that fits(shape) accepts; Skipped, saying why, if
    not."""
    _require(isinstance(array, np.ndarray) and array.dtype.kind == "f" and fits(array.shape),
             f"{what} are not {shape} numbers")
    return array


def read_numbers(array, what: str, fits, shape: str) -> np.ndarray:
    """`array` if it holds floats in 0..1 (attention weights and accuracies both do) in a shape
    that fits(shape) accepts; Skipped, saying why, if not."""
    read_floats(array, what, fits, shape)
    # the comparisons also refuse NaN and infinities: every comparison with NaN is False
    _require(bool(np.all((array >= 0) & (array <= 1))),
             f"{what} hold numbers outside 0..1 (NaN, infinite or negative)")
    return array


def _is_grid(shape: tuple) -> bool:
    """Whether an array of this shape is a layer x head grid within the bounds."""
    return len(shape) == 2 and 1 <= shape[0] <= MAX_LAYERS and 1 <= shape[1] <= MAX_HEADS


class AttentionPlugin(base_plugin.TBPlugin):
    """Serves tinylm's attention summaries and the tab that draws them."""

    plugin_name = PLUGIN_NAME

    def __init__(self, context: base_plugin.TBContext):
        self.data_provider = context.data_provider
        self.logdir = Path(context.logdir) if context.logdir else None

    def get_plugin_apps(self):
        apps = {route: self._serve_static for route in STATIC_FILES}
        apps.update({"/texts": self._serve_texts, "/attention": self._serve_attention,
                     "/weights": self._serve_weights, "/probes": self._serve_probes,
                     "/patching": self._serve_patching,
                     "/patching_pair": self._serve_patching_pair,
                     arithmetic.ROUTE: wrappers.Request.application(
                         lambda request: arithmetic.serve(self, request))})
        return apps

    def is_active(self) -> bool:
        return True  # without data the tab says what to run to make some

    def frontend_metadata(self):
        return base_plugin.FrontendMetadata(es_module_path="/index.js",
                                            tab_name="tinylm attention")

    @wrappers.Request.application
    def _serve_static(self, request):
        name = request.path.rsplit("/", 1)[1]  # one of STATIC_FILES: only those are routed
        return http_util.Respond(request, pkgutil.get_data(__package__, f"static/{name}"),
                                 STATIC_FILES["/" + name])

    def _series(self, request, plugin_name: str = PLUGIN_NAME, runs: list[str] | None = None,
                tags: list[str] | None = None) -> dict:
        """{run: {tag: TensorTimeSeries}} of a plugin, optionally of these runs and tags only;
        never a killed writer's leftover folder (is_leftover)."""
        series = self.data_provider.list_tensors(
            **_where(request), plugin_name=plugin_name,
            run_tag_filter=provider.RunTagFilter(runs=runs, tags=tags))
        return {run: tags for run, tags in series.items() if not is_leftover(run)}

    def _run_label(self, run: str) -> str:
        """A run as the tab names it: "." (the logdir itself) by the logdir's last two folders."""
        if run != "." or self.logdir is None:
            return run
        return "/".join(Path(os.path.abspath(self.logdir)).parts[-2:])

    def _tensor(self, request, plugin_name: str, run: str, tag: str, what: str):
        """The array last written under `run` and `tag`, as the data provider decodes it."""
        try:
            data = self.data_provider.read_tensors(
                **_where(request), plugin_name=plugin_name, downsample=1,
                run_tag_filter=provider.RunTagFilter(runs=[run], tags=[tag]))
            (datum,) = data[run][tag]
            return datum.numpy
        except (ValueError, TypeError, KeyError, MemoryError):  # a crafted tensor proto
            raise Skipped(f"{what} cannot be decoded") from None

    def _require_inside(self, run: str) -> None:
        """Skipped if the run's folder, every link resolved, lies outside the logdir (also
        resolved): a link to elsewhere."""
        _require(self.logdir is None or Path(os.path.realpath(self.logdir / run)).is_relative_to(
            os.path.realpath(self.logdir)), "its folder resolves outside the logdir: not served")

    @wrappers.Request.application
    def _serve_texts(self, request):
        texts, problems = {}, []
        for run, tags in sorted(self._series(request).items()):
            try:
                self._require_inside(run)
            except Skipped as why:
                problems.append({"run": run, "message": str(why)})
                continue
            for tag, ts in sorted(tags.items()):
                try:
                    listed = read_listed(ts.plugin_content)
                except Skipped as why:
                    problems.append({"run": run, "tag": tag, "message": f"{tag}: {why}"})
                    continue
                entry = texts.setdefault((run, listed["name"]), {
                    "run": run, "name": listed["name"], "steps": [],
                    "run_label": self._run_label(run), "kind": listed["kind"]})
                entry["steps"].append({"step": listed["step"], "tag": tag,
                                       "sentence": listed["sentence"]})
        for entry in texts.values():
            entry["steps"].sort(key=lambda s: s["step"])
            # what the text holds, as its last step has it (a probe prompt stays the same)
            entry["sentence"] = entry["steps"][-1]["sentence"]
            for step in entry["steps"]:
                del step["sentence"]
        return _json(request, {"texts": list(texts.values()), "problems": problems,
                               "empty": HOW_TO_MAKE_DATA if not texts else None})

    def _answer_one(self, request, answer) -> wrappers.Response:
        """Answer a request naming one text with answer(run, tag, content); 404 when the data
        provider lists no such run and tag, the reason (200) when the text is skipped."""
        run, tag = request.args.get("run"), request.args.get("tag")
        ts = self._series(request, PLUGIN_NAME, [run], [tag]).get(run, {}).get(tag) if (
            run and tag) else None
        if ts is None:
            return _json(request, {"error": "no such run and tag"}, 404)
        try:
            self._require_inside(run)
            return answer(run, tag, read_content(ts.plugin_content))
        except Skipped as why:
            return _json(request, {"problem": {"run": run, "tag": tag,
                                               "message": f"{tag}: {why}"}})

    @wrappers.Request.application
    def _serve_attention(self, request):
        return self._answer_one(request, lambda run, tag, content: _json(request, content))

    @wrappers.Request.application
    def _serve_weights(self, request):
        return self._answer_one(request, lambda run, tag, content: http_util.Respond(
            request, self._weights(request, run, tag, content["shape"]).tobytes(),
            "application/octet-stream"))

    def _weights(self, request, run: str, tag: str, shape: list[int]) -> np.ndarray:
        """The text's last written weights as float16 (L, nh, T, T), checked against its shape."""
        weights = self._tensor(request, PLUGIN_NAME, run, tag, "its weights")
        return read_numbers(weights, "its weights", lambda s: list(s) == shape,
                            " x ".join(map(str, shape))).astype("<f2")

    def _probe(self, request, run: str, tag: str, ts) -> dict:
        """One tinylm-probe summary as the tab draws it: its item count, layer x head accuracy,
        the accuracy of chance (0.5 where the summary does not say: two characters) and what it
        reads."""
        self._require_inside(run)
        description = read_description(ts.plugin_content, "a tinylm-probe report")
        n = description.get("n")
        _require(_is_int(n, 0, 2**63), "its item count is not a number")
        chance, reads = description.get("chance", 0.5), description.get("reads", PROBE_READS)
        _require(_is_number(chance) and 0 < chance < 1, "its chance level is not between 0 and 1")
        _require(isinstance(reads, str) and len(reads) <= 4 * MAX_CHARS,
                 f"what it reads is not a text of at most {4 * MAX_CHARS} characters")
        accuracy = self._tensor(request, PROBE_PLUGIN_NAME, run, tag, "its accuracies")
        read_numbers(accuracy, "its accuracies", _is_grid,
                     f"(layers <= {MAX_LAYERS}) x (heads <= {MAX_HEADS})")
        return {"run": run, "run_label": self._run_label(run), "n": n,
                "accuracy": accuracy.tolist(), "chance": chance, "reads": reads}

    @wrappers.Request.application
    def _serve_probes(self, request):
        reports, problems = [], []
        # the patching report beside it is another tag of the same plugin, served on its own
        series = self._series(request, PROBE_PLUGIN_NAME, tags=[PROBE_TAG])
        for run, tags in sorted(series.items()):
            for tag, ts in sorted(tags.items()):
                try:
                    reports.append(self._probe(request, run, tag, ts))
                except Skipped as why:
                    problems.append({"run": run, "tag": tag, "message": f"{tag}: {why}"})
        return _json(request, {"reports": reports, "problems": problems})

    def _patching(self, request, run: str, tags: dict) -> tuple[dict, np.ndarray, np.ndarray]:
        """A run's patching report, checked: its description, its float (L, nh, 3) effects and
        intervals, its float (P, L, nh, T_max) effects per pair and position; NaN (undefined)
        may stand anywhere among them, an infinity nowhere."""
        self._require_inside(run)
        for tag in PATCHING_TAGS:
            _require(tag in tags, f"{tag} is not in the run: a patching report is written as "
                     f"{PATCHING_TAG} and {PATCHING_POSITIONS_TAG}")
        description = read_patching(tags[PATCHING_TAG].plugin_content)
        read_description(tags[PATCHING_POSITIONS_TAG].plugin_content, "a tinylm patching report")
        n_pairs, n_layer, n_head, t_max = description["shape"]
        return (description,
                self._effects(request, run, PATCHING_TAG, "its effects", (n_layer, n_head, 3)),
                self._effects(request, run, PATCHING_POSITIONS_TAG, "its effects per position",
                              (n_pairs, n_layer, n_head, t_max)))

    def _effects(self, request, run: str, tag: str, what: str, shape: tuple) -> np.ndarray:
        """A patching tensor of `shape`: floats, NaN (undefined) allowed, infinities not."""
        array = read_floats(self._tensor(request, PROBE_PLUGIN_NAME, run, tag, what), what,
                            lambda s: s == shape, " x ".join(map(str, shape)))
        _require(not np.isinf(array).any(), f"{what} hold infinite numbers")
        return array

    @wrappers.Request.application
    def _serve_patching(self, request):
        reports, problems = [], []
        for run, tags in sorted(self._series(request, PROBE_PLUGIN_NAME, tags=PATCHING_TAGS)
                                .items()):
            try:
                description, grid, _ = self._patching(request, run, tags)
            except Skipped as why:
                problems.append({"run": run, "tag": PATCHING_TAG,
                                 "message": f"{PATCHING_TAG}: {why}"})
                continue
            reports.append({
                "run": run, "run_label": self._run_label(run),
                "n_skipped": description["n_skipped"],
                "interval_level": description["interval_level"],
                "shape": description["shape"][1:3], "effect": _nan_as_null(grid[..., 0]),
                "interval": _nan_as_null(grid[..., 1:]),
                # their tokens come with their effects per position, one pair at a time
                "pairs": [{k: v for k, v in pair.items() if k != "tokens"}
                          for pair in description["pairs"]]})
        return _json(request, {"reports": reports, "problems": problems})

    @wrappers.Request.application
    def _serve_patching_pair(self, request):
        run, pair = request.args.get("run"), request.args.get("pair", "")
        tags = self._series(request, PROBE_PLUGIN_NAME, [run], PATCHING_TAGS).get(run, {}) if (
            run) else {}
        if not tags or not (pair.isascii() and pair.isdigit() and len(pair) <= 6):
            return _json(request, {"error": "no such run and pair"}, 404)
        try:
            description, _, by_position = self._patching(request, run, tags)
        except Skipped as why:
            return _json(request, {"problem": {"run": run, "tag": PATCHING_TAG,
                                               "message": f"{PATCHING_TAG}: {why}"}})
        i = int(pair)
        if i >= len(description["pairs"]):
            return _json(request, {"error": "no such run and pair"}, 404)
        chosen = description["pairs"][i]
        return _json(request, {"run": run, "pair": i, **chosen, "effect": _nan_as_null(
            by_position[i, :, :, :len(chosen["tokens"])])})  # (L, nh, T): T of its tokens
