"""The TensorBoard backend of the attention tab. Routes, under /data/plugin/tinylm_attention/:

    /index.js, /style.css, /arithmetic.js   the frontend, from static/ (no CDN, no build step)
    /texts                   every (run, text, step) with tinylm attention, its sentence, who
                             wrote it, and what was skipped
    /attention?run=&tag=     one text's JSON content, cut to the tokens the model read
    /weights?run=&tag=       its weights: raw little-endian float16 bytes, (L, nh, T, T)
    /arithmetic?run=&tag=&layer=&head=&query=   the steps behind one weight (arithmetic.py)
    /probes                  each tinylm-probe report: layer x head accuracy, chance, reading
    /patching                each activation-patching report: layer x head effects, intervals,
                             its pairs (their sentences, without their tokens)
    /patching_pair?run=&pair=  one pair: its clean tokens and (L, nh, T) effects per position

All comes from TensorBoard's data provider, looked up by the run and tag names it lists, never
opened as a path; a run folder that resolves outside the logdir (a link) is not served. Answers
are strict JSON: a number a route cannot define (a patching effect over no difference) is null.
"""

from __future__ import annotations

import json
import os
import pkgutil
from pathlib import Path

import numpy as np
from tensorboard import plugin_util
from tensorboard.backend import http_util
from tensorboard.data import provider
from tensorboard.plugins import base_plugin
from werkzeug import wrappers

from tinylm.files import json_numbers
from tinylm.inspection.tensorboard_plugin import (
    ARITHMETIC_PLUGIN_NAME,
    PLUGIN_NAME,
    PROBE_PLUGIN_NAME,
)
from tinylm.inspection.tensorboard_plugin.arithmetic import one_weight
from tinylm.inspection.tensorboard_plugin.reading import (
    Skipped,
    is_leftover,
    read_arithmetic,
    read_content,
    read_description,
    read_floats,
    read_grid,
    read_listed,
    read_patching,
    read_probe,
    require,
)
from tinylm.inspection.tensorboard_plugin.summary import (
    PATCHING_POSITIONS_TAG,
    PATCHING_TAG,
    PROBE_TAG,
    qkv_tag,
    step_tag,
)

STATIC_FILES = {"/index.js": "text/javascript", "/style.css": "text/css",
                "/arithmetic.js": "text/javascript"}
HOW_TO_MAKE_DATA = ("No tinylm attention in this logdir. Train a run (tinylm-train), which writes "
                    "the probe prompt's attention at every evaluation, or inspect a text: "
                    "tinylm-generate checkpoint=<run dir> prompt=\"...\" inspect=true; then point "
                    "tensorboard --logdir at that run dir.")
PATCHING_TAGS = [PATCHING_TAG, PATCHING_POSITIONS_TAG]


def _json(request, data, code: int = 200) -> wrappers.Response:
    return http_util.Respond(request, json.dumps(data, allow_nan=False), "application/json",
                             code=code)


def _problem(run: str, tag: str, why: Skipped) -> dict:
    """Why a run's summary is skipped, as the routes list it."""
    return {"run": run, "tag": tag, "message": f"{tag}: {why}"}


def _digits(value: str | None, width: int = 6) -> int | None:
    """A request's whole number (only ASCII digits, at most `width`), else None."""
    ok = value is not None and value.isascii() and value.isdigit() and len(value) <= width
    return int(value) if ok else None


class AttentionPlugin(base_plugin.TBPlugin):
    """Serves tinylm's attention summaries and the tab that draws them."""

    plugin_name = PLUGIN_NAME

    def __init__(self, context: base_plugin.TBContext):
        self.data_provider = context.data_provider
        self.logdir = Path(context.logdir) if context.logdir else None

    def get_plugin_apps(self):
        apps = {route: self._serve_static for route in STATIC_FILES}
        apps.update({"/texts": self._serve_texts, "/attention": self._serve_attention,
                     "/weights": self._serve_weights, "/arithmetic": self._serve_arithmetic,
                     "/probes": self._serve_probes, "/patching": self._serve_patching,
                     "/patching_pair": self._serve_patching_pair})
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

    def _where(self, request) -> dict:
        """The data provider's context and experiment id of a request, as keyword arguments."""
        return {"ctx": plugin_util.context(request.environ),
                "experiment_id": plugin_util.experiment_id(request.environ)}

    def _series(self, request, plugin_name: str = PLUGIN_NAME, runs: list[str] | None = None,
                tags: list[str] | None = None) -> dict:
        """{run: {tag: TensorTimeSeries}} of a plugin, optionally of these runs and tags only;
        never a killed writer's leftover folder."""
        series = self.data_provider.list_tensors(
            **self._where(request), plugin_name=plugin_name,
            run_tag_filter=provider.RunTagFilter(runs=runs, tags=tags))
        return {run: tags for run, tags in series.items() if not is_leftover(run)}

    def _one_series(self, request, plugin_name: str, run: str | None, tag: str | None):
        """The TensorTimeSeries of one run and tag, None if the data provider lists none."""
        if not (run and tag):
            return None
        return self._series(request, plugin_name, [run], [tag]).get(run, {}).get(tag)

    def _run_label(self, run: str) -> str:
        """A run as the tab names it: "." (the logdir itself) by the logdir's last two folders."""
        if run != "." or self.logdir is None:
            return run
        return "/".join(Path(os.path.abspath(self.logdir)).parts[-2:])

    def _tensor(self, request, plugin_name: str, run: str, tag: str, what: str):
        """The array last written under `run` and `tag`, as the data provider decodes it."""
        try:
            data = self.data_provider.read_tensors(
                **self._where(request), plugin_name=plugin_name, downsample=1,
                run_tag_filter=provider.RunTagFilter(runs=[run], tags=[tag]))
            (datum,) = data[run][tag]
            return datum.numpy
        except (ValueError, TypeError, KeyError, MemoryError):  # a crafted tensor proto
            raise Skipped(f"{what} cannot be decoded") from None

    def _require_inside(self, run: str) -> None:
        """Skipped if the run's folder, every link resolved, lies outside the logdir (resolved)."""
        require(self.logdir is None or Path(os.path.realpath(self.logdir / run)).is_relative_to(
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
                    problems.append(_problem(run, tag, why))
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

    def _answer_one(self, request, answer, tag: str | None = None) -> wrappers.Response:
        """Answer a request naming one text (its run, and its tag if not given) with
        answer(run, tag, content); 404 when the data provider lists no such text, the reason
        (200) when it is skipped."""
        run, tag = request.args.get("run"), tag or request.args.get("tag")
        ts = self._one_series(request, PLUGIN_NAME, run, tag)
        if ts is None:
            return _json(request, {"error": "no such run and tag"}, 404)
        try:
            self._require_inside(run)
            return answer(run, tag, read_content(ts.plugin_content))
        except Skipped as why:
            return _json(request, {"problem": _problem(run, tag, why)})

    @wrappers.Request.application
    def _serve_attention(self, request):
        return self._answer_one(request, lambda run, tag, content: _json(request, content))

    @wrappers.Request.application
    def _serve_weights(self, request):
        def weights(run, tag, content):
            shape = tuple(content["shape"])
            array = read_floats(self._tensor(request, PLUGIN_NAME, run, tag, "its weights"),
                                "its weights", shape, weights=True)
            return http_util.Respond(request, array.astype("<f2").tobytes(),
                                     "application/octet-stream")

        return self._answer_one(request, weights)

    @wrappers.Request.application
    def _serve_arithmetic(self, request):
        args, tag = request.args, None
        if args.get("tag") is None and args.get("text") is not None:
            step = _digits(args.get("step"), 18)
            tag = step_tag(args["text"], step) if step is not None else None
        layer, head, query = (_digits(args.get(key)) for key in ("layer", "head", "query"))
        if None in (layer, head, query):
            return _json(request, {"error": "layer, head and query must be whole numbers (query: "
                                            "a token's index)"}, 400)

        def steps(run, tag, content):
            n_layer, n_head, t = content["shape"][:3]
            if not (layer < n_layer and head < n_head and query < t):
                return _json(request, {"error": f"no layer {layer}, head {head}, query {query}: "
                                                f"the text has {n_layer} layers x {n_head} heads "
                                                f"over {t} tokens"}, 400)
            stored = self._one_series(request, ARITHMETIC_PLUGIN_NAME, run, qkv_tag(tag))
            require(stored is not None, "no q, k and v were written beside its attention (data "
                    "written before the arithmetic panel, or by a writer without it): write it "
                    "again to see the arithmetic")
            described = read_arithmetic(stored.plugin_content, content["shape"])
            require(layer in described["layers"], f"layer {layer}'s q, k and v were not kept: "
                    f"{described['not_stored'] or 'not written'}")
            flat = read_floats(self._tensor(request, ARITHMETIC_PLUGIN_NAME, run, qkv_tag(tag),
                                            "its q, k and v"), "its q, k and v",
                               (described["size"],))
            require(bool(np.isfinite(flat).all()), "its q, k and v hold NaN or infinite numbers")
            end = described["layers"][layer]["offset"] + described["layers"][layer]["size"]
            forward = flat[end - n_head * t * (t + 1) // 2:end]  # the layer's weights, last
            read_floats(forward, "its weights", forward.shape, weights=True)
            return _json(request, {"run": run, "tag": tag, **one_weight(
                flat, described, layer, head, query, n_head, t, content["tokens"])})

        return self._answer_one(request, steps, tag)

    def _reports(self, request, tags: list[str], report) -> wrappers.Response:
        """Each run's report, report(run, its tags), or why it is skipped among the problems."""
        reports, problems = [], []
        for run, found in sorted(self._series(request, PROBE_PLUGIN_NAME, tags=tags).items()):
            try:
                self._require_inside(run)
                reports.append({"run": run, "run_label": self._run_label(run),
                                **report(run, found)})
            except Skipped as why:
                problems.append(_problem(run, tags[0], why))
        return _json(request, {"reports": reports, "problems": problems})

    @wrappers.Request.application
    def _serve_probes(self, request):
        def report(run, tags):
            description = read_probe(tags[PROBE_TAG].plugin_content)
            accuracy = self._tensor(request, PROBE_PLUGIN_NAME, run, PROBE_TAG, "its accuracies")
            return {**description, "accuracy": read_grid(accuracy).tolist()}

        # the patching report beside it is another tag of the same plugin, served on its own
        return self._reports(request, [PROBE_TAG], report)

    def _patching(self, request, run: str, tags: dict) -> tuple[dict, np.ndarray, np.ndarray]:
        """A run's patching report: its description, its (L, nh, 3) effects and intervals, its
        (P, L, nh, T_max) effects per pair and position; NaN (undefined) may stand anywhere among
        them, an infinity nowhere."""
        for tag in PATCHING_TAGS:
            require(tag in tags, f"{tag} is not in the run: a patching report is written as "
                    f"{PATCHING_TAG} and {PATCHING_POSITIONS_TAG}")
        description = read_patching(tags[PATCHING_TAG].plugin_content)
        read_description(tags[PATCHING_POSITIONS_TAG].plugin_content, "a tinylm patching report")
        n_pairs, n_layer, n_head, t_max = description["shape"]
        arrays = []
        for tag, what, shape in ((PATCHING_TAG, "its effects", (n_layer, n_head, 3)),
                                 (PATCHING_POSITIONS_TAG, "its effects per position",
                                  (n_pairs, n_layer, n_head, t_max))):
            array = read_floats(self._tensor(request, PROBE_PLUGIN_NAME, run, tag, what), what,
                                shape)
            require(not np.isinf(array).any(), f"{what} hold infinite numbers")
            arrays.append(array)
        return description, *arrays

    @wrappers.Request.application
    def _serve_patching(self, request):
        def report(run, tags):
            description, grid, _ = self._patching(request, run, tags)
            return {"n_skipped": description["n_skipped"],
                    "interval_level": description["interval_level"],
                    "shape": description["shape"][1:3], "effect": json_numbers(grid[..., 0]),
                    "interval": json_numbers(grid[..., 1:]),
                    # their tokens come with their effects per position, one pair at a time
                    "pairs": [{k: v for k, v in pair.items() if k != "tokens"}
                              for pair in description["pairs"]]}

        return self._reports(request, PATCHING_TAGS, report)

    @wrappers.Request.application
    def _serve_patching_pair(self, request):
        run, i = request.args.get("run"), _digits(request.args.get("pair"))
        tags = self._series(request, PROBE_PLUGIN_NAME, [run], PATCHING_TAGS).get(run, {}) if (
            run) else {}
        if not tags or i is None:
            return _json(request, {"error": "no such run and pair"}, 404)
        try:
            self._require_inside(run)
            description, _, by_position = self._patching(request, run, tags)
        except Skipped as why:
            return _json(request, {"problem": _problem(run, PATCHING_TAG, why)})
        if i >= len(description["pairs"]):
            return _json(request, {"error": "no such run and pair"}, 404)
        chosen = description["pairs"][i]
        return _json(request, {"run": run, "pair": i, **chosen, "effect": json_numbers(
            by_position[i, :, :, :len(chosen["tokens"])])})  # (L, nh, T): T of its tokens
