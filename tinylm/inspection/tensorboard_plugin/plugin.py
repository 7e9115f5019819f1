"""The TensorBoard backend of the attention tab: its ES module, the texts, weights, probe scores.

Routes (under /data/plugin/tinylm_attention/):
    /index.js, /style.css    the frontend, served from static/ (no CDN, no build step)
    /texts                   every (run, text, step) with tinylm attention, and what was skipped
    /attention?run=&tag=     one text's JSON content, cut to the tokens the model read
    /weights?run=&tag=       its weights: raw little-endian float16 bytes, (L, nh, T, T)
    /probes                  layer x head accuracy of each probe.json found under the logdir

`run` and `tag` are only ever looked up among the names TensorBoard's data provider lists, never
opened as paths; the only files this plugin opens itself are probe.json reports and event-file
headers found by walking the logdir, each resolved and checked to lie inside it.

A logdir may hold anything. What cannot be served (a broken or looping link, a FIFO, socket or
device, a truncated or crafted file, a run folder that resolves outside the logdir) is skipped
and listed with the reason among the route's problems; a route never opens a file that is not a
regular one, so nothing blocks, and it answers strict JSON (no NaN) whose size the model's shape
bounds: a text is checked against the limits below before anything of it is served.
"""

from __future__ import annotations

import errno
import json
import math
import os
import stat
from pathlib import Path

import numpy as np
from tensorboard import plugin_util
from tensorboard.backend import http_util
from tensorboard.data import provider
from tensorboard.plugins import base_plugin
from werkzeug import wrappers

from tinylm.inspection.tensorboard_plugin import PLUGIN_NAME
from tinylm.inspection.tensorboard_plugin.summary import FORMAT_VERSION

STATIC = Path(__file__).parent / "static"
STATIC_FILES = {"/index.js": "text/javascript", "/style.css": "text/css"}
HOW_TO_MAKE_DATA = ("No tinylm attention in this logdir. Train a run (tinylm-train), which writes "
                    "the probe prompt's attention at every evaluation, or inspect a text: "
                    "tinylm-generate checkpoint=<run dir> prompt=\"...\" inspect=true; then point "
                    "tensorboard --logdir at that run dir.")
EVENT_FILE_MARK = "tfevents"
# The largest text served: far above any tinylm model (GPT-2 has 12 layers x 12 heads over 1024
# tokens), and weights of at most 2**26 float16 numbers (128 MiB), about what a tab can draw.
MAX_LAYERS, MAX_HEADS, MAX_TOKENS, MAX_WEIGHTS = 64, 64, 1024, 2**26
MAX_CHARS = 256  # of one token, word, text name or note; no tokenizer makes longer ones
MAX_CONTENT_BYTES = 2**24  # a text's description holds the whole text, as long as it may be
MAX_PROBE_REPORT_BYTES = 10_000_000  # far above any real report; a bigger file is not one


class Skipped(ValueError):
    """Something in the logdir that is not served; the message says why, for the tab."""


def _json(request, data, code: int = 200) -> wrappers.Response:
    return http_util.Respond(request, json.dumps(data, allow_nan=False), "application/json",
                             code=code)


def _where(request) -> dict:
    """The data provider's context and experiment id of a request, as keyword arguments."""
    return {"ctx": plugin_util.context(request.environ),
            "experiment_id": plugin_util.experiment_id(request.environ)}


def inside(root: Path, path: Path) -> bool:
    """Whether `path`, with every symlink resolved, lies inside `root` (also resolved); a link
    that loops resolves to itself, and reading it later says so."""
    return Path(os.path.realpath(path)).is_relative_to(os.path.realpath(root))


def unreadable(err: OSError) -> Skipped:
    """Why a file found in the logdir cannot be read, in words."""
    return Skipped({errno.ENOENT: "it is a link to nothing",
                    errno.ELOOP: "it is a link that loops"}.get(
        err.errno, f"it cannot be read ({err.strerror or err})"))


def open_regular(path: Path):
    """`path` opened for reading if it is a regular file. A FIFO, socket or device is never
    opened (a FIFO blocks its reader); O_NONBLOCK covers one put there since the check."""
    try:
        if not stat.S_ISREG(os.stat(path).st_mode):
            raise Skipped("it is not a regular file (a folder, FIFO, socket or device): not "
                          "opened")
        return os.fdopen(os.open(path, os.O_RDONLY | os.O_NONBLOCK), "rb")
    except OSError as err:
        raise unreadable(err) from None


def truncated_records(path: Path) -> int | None:
    """Bytes cut off the end of a TFRecord event file (None: it ends on a whole record); walks
    the record headers only (8-byte length, 4-byte CRC, data, 4-byte CRC)."""
    with open_regular(path) as f:
        size, position = os.fstat(f.fileno()).st_size, 0
        while position < size:
            header = f.read(12)
            if len(header) < 12:
                return size - position
            end = position + 12 + int.from_bytes(header[:8], "little") + 4
            if end > size:
                return size - position
            position = end
            f.seek(position)
    return None


def _require(ok: bool, why: str) -> None:
    if not ok:
        raise Skipped(why)


def _is_int(value, low: int, high: int) -> bool:
    """An int (not a bool) with low <= value < high."""
    return type(value) is int and low <= value < high


def _is_text(value) -> bool:
    return isinstance(value, str) and len(value) <= MAX_CHARS


def read_json(raw: bytes | str, what: str):
    """JSON read from a file or a text's description; Skipped if it is not JSON (cut off, not
    UTF-8, nested deeper than Python's recursion limit)."""
    try:
        return json.loads(raw)
    except (ValueError, RecursionError):  # UnicodeDecodeError is a ValueError
        raise Skipped(f"{what} is not readable JSON (truncated?)") from None


def read_content(raw: bytes | str) -> dict:
    """One text's description, checked, as the tab reads it: the tokens the model read, the words
    they belong to (renumbered in order), the pronouns and names among those words. Its size is
    bounded by the checked shape (L, nh, T, T): T tokens and at most T words of MAX_CHARS."""
    _require(len(raw) <= MAX_CONTENT_BYTES, f"its description is over {MAX_CONTENT_BYTES} bytes")
    content = read_json(raw, "its description")
    _require(isinstance(content, dict) and "version" in content,
             "its description is not tinylm attention")
    version = content["version"]
    _require(version == FORMAT_VERSION, (
        f"written in tinylm attention format {str(version)[:20]}; this tinylm reads format "
        f"{FORMAT_VERSION} (write it again with this version)"))
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
    served = {"version": version, "name": content.get("name"), "step": content.get("step"),
              "shape": shape, "tokens": tokens, "words": [words[w] for w in kept],
              "token_words": [number.get(w, -1) for w in token_words],
              "window_note": content.get("window_note", "")}
    for key in ("pronouns", "names"):
        indices = content.get(key)
        _require(isinstance(indices, list) and all(_is_int(w, 0, len(words)) for w in indices),
                 f"its {key} are not word indices")
        served[key] = sorted({number[w] for w in indices if w in number})
    _require(_is_text(served["name"]) and served["name"] != "" and _is_int(served["step"], 0, 2**63)
             and all(map(_is_text, served["words"])) and _is_text(served["window_note"]),
             f"its name, step, words or note are not texts of at most {MAX_CHARS} characters "
             "and a step number")
    return served


def read_probe_report(path: Path) -> dict:
    """A probe.json as the tab draws it: its item count and a layer x head accuracy grid."""
    with open_regular(path) as f:
        raw = f.read(MAX_PROBE_REPORT_BYTES + 1)
    _require(len(raw) <= MAX_PROBE_REPORT_BYTES,
             f"it is over {MAX_PROBE_REPORT_BYTES} bytes, more than any tinylm-probe report")
    report = read_json(raw, "it")
    heads = report.get("heads") if isinstance(report, dict) else None
    n = report.get("n") if isinstance(report, dict) else None
    _require(isinstance(heads, list) and (n is None or _is_int(n, 0, 2**63)),
             "it is not a tinylm-probe report")
    # the range checks refuse NaN and infinities too: every comparison with NaN is False
    _require(all(isinstance(h, dict) and _is_int(h.get("layer"), 0, MAX_LAYERS)
                 and _is_int(h.get("head"), 0, MAX_HEADS)
                 and type(h.get("accuracy")) in (int, float) and 0 <= h["accuracy"] <= 1
                 for h in heads),
             f"its heads are not layers < {MAX_LAYERS} and heads < {MAX_HEADS} with an accuracy "
             "in 0..1 each")
    grid = [[None] * (1 + max((h["head"] for h in heads), default=-1))
            for _ in range(1 + max((h["layer"] for h in heads), default=-1))]
    for h in heads:
        grid[h["layer"]][h["head"]] = h["accuracy"]
    return {"n": n, "accuracy": grid}


def find_probe_reports(logdir: Path) -> tuple[list[dict], list[dict]]:
    """(reports, problems): every probe.json under `logdir` with heads, as a grid, and every one
    skipped with the reason; links out of the logdir are neither followed nor opened."""
    reports, problems = [], []

    def skip(path: str, why: Skipped) -> None:
        problems.append({"path": path, "message": f"{path}: {why}"})

    def relative(path) -> str:
        return Path(path).relative_to(logdir).as_posix()

    for directory, _, files in os.walk(logdir, onerror=lambda e: skip(
            relative(e.filename), unreadable(e))):
        if "probe.json" not in files:
            continue
        path = Path(directory) / "probe.json"
        try:
            _require(inside(logdir, path), "it links outside the logdir: not opened")
            report = read_probe_report(path)
        except Skipped as why:
            skip(relative(path), why)
            continue
        if report["accuracy"]:  # a report of agreement items only has no heads to draw
            reports.append({"path": relative(path), **report})
    return (sorted(reports, key=lambda r: r["path"]),
            sorted(problems, key=lambda p: p["path"]))


class AttentionPlugin(base_plugin.TBPlugin):
    """Serves tinylm's attention summaries and the tab that draws them."""

    plugin_name = PLUGIN_NAME

    def __init__(self, context: base_plugin.TBContext):
        self.data_provider = context.data_provider
        self.logdir = Path(context.logdir) if context.logdir else None

    def get_plugin_apps(self):
        apps = {route: self._serve_static for route in STATIC_FILES}
        apps.update({"/texts": self._serve_texts, "/attention": self._serve_attention,
                     "/weights": self._serve_weights, "/probes": self._serve_probes})
        return apps

    def is_active(self) -> bool:
        return True  # without data the tab says what to run to make some

    def frontend_metadata(self):
        return base_plugin.FrontendMetadata(es_module_path="/index.js",
                                            tab_name="tinylm attention")

    @wrappers.Request.application
    def _serve_static(self, request):
        name = request.path.rsplit("/", 1)[1]  # one of STATIC_FILES: only those are routed
        return http_util.Respond(request, (STATIC / name).read_bytes(), STATIC_FILES["/" + name])

    def _series(self, request, run: str | None = None, tag: str | None = None) -> dict:
        """{run: {tag: TensorTimeSeries}} of this plugin, optionally one run and tag only."""
        filter_ = provider.RunTagFilter(runs=[run], tags=[tag]) if run is not None else None
        return self.data_provider.list_tensors(**_where(request), plugin_name=PLUGIN_NAME,
                                               run_tag_filter=filter_)

    def _require_inside(self, run: str) -> None:
        """Skipped if the run's folder resolves outside the logdir (a link to elsewhere)."""
        _require(self.logdir is None or inside(self.logdir, self.logdir / run),
                 "its folder resolves outside the logdir: not served")

    def _truncated_event_files(self, runs) -> list[dict]:
        """Event files of these runs that end in a cut-off record (a crash mid-write), or that
        cannot be read at all."""
        problems = []
        if self.logdir is None:
            return problems
        for run in runs:
            directory = self.logdir / run
            if not inside(self.logdir, directory) or not directory.is_dir():
                continue
            try:
                paths = sorted(directory.iterdir())
            except OSError as err:
                problems.append({"run": run, "message": str(unreadable(err))})
                continue
            for path in paths:
                if EVENT_FILE_MARK not in path.name:
                    continue
                try:
                    _require(inside(self.logdir, path), "it links outside the logdir: not opened")
                    cut = truncated_records(path)
                    _require(cut is None, (
                        f"it is truncated ({cut} bytes of an unfinished record at the end): what "
                        "was written after its last whole record is missing"))
                except Skipped as why:
                    problems.append({"run": run, "file": path.name,
                                     "message": f"{path.name}: {why}"})
        return problems

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
                    content = read_content(ts.plugin_content)
                except Skipped as why:
                    problems.append({"run": run, "tag": tag, "message": f"{tag}: {why}"})
                    continue
                entry = texts.setdefault((run, content["name"]), {
                    "run": run, "name": content["name"], "steps": []})
                entry["steps"].append({"step": content["step"], "tag": tag})
        problems += self._truncated_event_files(
            run.run_name for run in self.data_provider.list_runs(**_where(request)))
        for entry in texts.values():
            entry["steps"].sort(key=lambda s: s["step"])
        return _json(request, {"texts": list(texts.values()), "problems": problems,
                               "empty": HOW_TO_MAKE_DATA if not texts else None})

    def _answer_one(self, request, answer) -> wrappers.Response:
        """Answer a request naming one text with answer(run, tag, content); 404 when the data
        provider lists no such run and tag, the reason (200) when the text is skipped."""
        run, tag = request.args.get("run"), request.args.get("tag")
        ts = self._series(request, run, tag).get(run, {}).get(tag) if run and tag else None
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
        try:
            data = self.data_provider.read_tensors(
                **_where(request), plugin_name=PLUGIN_NAME, downsample=1,
                run_tag_filter=provider.RunTagFilter(runs=[run], tags=[tag]))
            (datum,) = data[run][tag]
            weights = datum.numpy
        except (ValueError, TypeError, KeyError, MemoryError):  # a crafted tensor proto
            raise Skipped("its weights cannot be decoded") from None
        _require(isinstance(weights, np.ndarray) and weights.dtype.kind == "f"
                 and list(weights.shape) == shape,
                 f"its weights are not {' x '.join(map(str, shape))} numbers as its "
                 "description says")
        # attention weights lie in 0..1; the comparisons also refuse NaN and infinities
        _require(bool(np.all((weights >= 0) & (weights <= 1))),
                 "its weights hold numbers outside 0..1 (NaN, infinite or negative)")
        return weights.astype("<f2")

    @wrappers.Request.application
    def _serve_probes(self, request):
        reports, problems = find_probe_reports(self.logdir) if self.logdir else ([], [])
        return _json(request, {"reports": reports, "problems": problems})
