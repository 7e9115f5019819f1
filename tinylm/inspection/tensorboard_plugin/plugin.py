"""The TensorBoard backend of the attention tab: its ES module, the texts, weights, probe scores.

Routes (under /data/plugin/tinylm_attention/):
    /index.js, /style.css    the frontend, served from static/ (no CDN, no build step)
    /texts                   every (run, text, step) with tinylm attention, and what cannot be read
    /attention?run=&tag=     one text's JSON content (tokens, words, pronouns, ...)
    /weights?run=&tag=       its weights: raw little-endian float16 bytes, (L, nh, T, T)
    /probes                  layer x head accuracy of each probe.json found under the logdir

`run` and `tag` are only ever looked up among the names TensorBoard's data provider lists, never
opened as paths; the only files this plugin opens itself are probe.json reports and event-file
headers found by walking the logdir, each resolved and checked to lie inside it.
"""

from __future__ import annotations

import json
import os
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
MAX_PROBE_REPORT_BYTES = 10_000_000  # far above any real report; a bigger file is not one


def _json(request, data, code: int = 200) -> wrappers.Response:
    return http_util.Respond(request, json.dumps(data), "application/json", code=code)


def _where(request) -> dict:
    """The data provider's context and experiment id of a request, as keyword arguments."""
    return {"ctx": plugin_util.context(request.environ),
            "experiment_id": plugin_util.experiment_id(request.environ)}


def inside(root: Path, path: Path) -> bool:
    """Whether `path`, with every symlink resolved, lies inside `root` (also resolved)."""
    try:
        return path.resolve().is_relative_to(root.resolve())
    except OSError:
        return False


def truncated_records(path: Path) -> int | None:
    """Bytes cut off the end of a TFRecord event file (None: it ends on a whole record); walks
    the record headers only (8-byte length, 4-byte CRC, data, 4-byte CRC)."""
    size, position = path.stat().st_size, 0
    with path.open("rb") as f:
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


def find_probe_reports(logdir: Path) -> list[dict]:
    """Every readable probe.json under `logdir` (not following links out of it), as grids."""
    reports = []
    for directory, _, files in os.walk(logdir):
        if "probe.json" not in files:
            continue
        path = Path(directory) / "probe.json"
        relative = path.relative_to(logdir).as_posix()
        if not inside(logdir, path) or path.stat().st_size > MAX_PROBE_REPORT_BYTES:
            continue
        try:
            report = json.loads(path.read_text(encoding="utf-8"))
            heads = [(int(h["layer"]), int(h["head"]), float(h["accuracy"]))
                     for h in report["heads"]]
        except (OSError, ValueError, KeyError, TypeError):
            reports.append({"path": relative, "error": "not a tinylm-probe report"})
            continue
        if not heads:
            continue
        grid = np.full((max(h[0] for h in heads) + 1, max(h[1] for h in heads) + 1), np.nan)
        for layer, head, accuracy in heads:
            grid[layer, head] = accuracy
        reports.append({"path": relative, "n": report.get("n"),
                        "accuracy": [[None if np.isnan(v) else v for v in row] for row in grid]})
    return sorted(reports, key=lambda r: r["path"])


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

    def _truncated_event_files(self, runs) -> list[dict]:
        """Event files of these runs that end in a cut-off record (a crash mid-write)."""
        problems = []
        if self.logdir is None:
            return problems
        for run in runs:
            directory = self.logdir / run
            if not inside(self.logdir, directory) or not directory.is_dir():
                continue
            for path in sorted(directory.iterdir()):
                if EVENT_FILE_MARK not in path.name or not inside(self.logdir, path):
                    continue
                cut = truncated_records(path)
                if cut is not None:
                    problems.append({"run": run, "file": path.name, "message": (
                        f"{path.name} is truncated ({cut} bytes of an unfinished record at the "
                        "end): what was written after its last whole record is missing")})
        return problems

    @wrappers.Request.application
    def _serve_texts(self, request):
        texts, problems = {}, []
        series = self._series(request)
        for run, tags in sorted(series.items()):
            for tag, ts in sorted(tags.items()):
                try:
                    content = json.loads(ts.plugin_content)
                    version = content["version"]
                except (ValueError, KeyError, TypeError):
                    problems.append({"run": run, "tag": tag,
                                     "message": f"{tag}: its description is not readable JSON"})
                    continue
                if version != FORMAT_VERSION:
                    problems.append({"run": run, "tag": tag, "message": (
                        f"{tag}: written in tinylm attention format {version}; this tinylm reads "
                        f"format {FORMAT_VERSION} (write it again with this version)")})
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

    def _one(self, request):
        """(run, tag, TensorTimeSeries) named by the request, or None if there is no such."""
        run, tag = request.args.get("run"), request.args.get("tag")
        if not run or not tag:
            return None
        ts = self._series(request, run, tag).get(run, {}).get(tag)
        return None if ts is None else (run, tag, ts)

    @wrappers.Request.application
    def _serve_attention(self, request):
        found = self._one(request)
        if found is None:
            return _json(request, {"error": "no such run and tag"}, 404)
        return http_util.Respond(request, found[2].plugin_content, "application/json")

    @wrappers.Request.application
    def _serve_weights(self, request):
        found = self._one(request)
        if found is None:
            return _json(request, {"error": "no such run and tag"}, 404)
        run, tag, _ = found
        data = self.data_provider.read_tensors(
            **_where(request), plugin_name=PLUGIN_NAME, downsample=1,
            run_tag_filter=provider.RunTagFilter(runs=[run], tags=[tag]))
        (datum,) = data[run][tag]
        weights = np.asarray(datum.numpy, dtype="<f2")  # (L, nh, T, T)
        return http_util.Respond(request, weights.tobytes(), "application/octet-stream")

    @wrappers.Request.application
    def _serve_probes(self, request):
        return _json(request, {"reports": find_probe_reports(self.logdir) if self.logdir else []})
