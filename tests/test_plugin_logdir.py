"""A logdir may hold anything: the attention tab's routes serve only the summaries TensorBoard's
data provider loaded, skip the crafted ones (texts and probe reports) and run folders that resolve
outside the logdir, list each with the reason, never open a file themselves (broken and looping
links, FIFOs, sockets, devices, crafted probe.json files lie there unread), and answer strict JSON
no larger than the model's shape allows; the tab says what it skipped and draws the rest. Checked
in-process and against a real TensorBoard server, in headless Chromium too.
"""

import json
import os
import stat
import threading
import urllib.error
import urllib.parse
import urllib.request

import numpy as np
import pytest
import test_tensorboard_plugin as tab
from helpers import STARTUP_TIMEOUT_S, tensorboard_server
from tensorboard.compat.proto import tensor_pb2, tensor_shape_pb2, types_pb2
from torch.utils.tensorboard import SummaryWriter

from tinylm.inspection.capture import AttentionCapture, find_words, token_word_index
from tinylm.inspection.tensorboard_plugin.reading import (
    MAX_CHARS,
    MAX_HEADS,
    MAX_LAYERS,
    SENTENCE_CHARS,
    is_leftover,
    read_content,
)
from tinylm.inspection.tensorboard_plugin.summary import (
    PROBE_READS,
    PROBE_TAG,
    attention_summary,
    probe_summary,
    step_tag,
)

ROUTE = tab.ROUTE
TEXT = "Lily saw Tom. She ran."
N_LAYER, N_HEAD, T = 2, 2, len(TEXT)
TIMEOUT_S = 10  # per request: a route that opened a FIFO would wait for a writer forever
browser = tab.browser  # the headless Chromium of the tab's own tests


def capture(text: str = TEXT) -> AttentionCapture:
    """Char-level attention over `text` without a model: each token looks evenly at itself and
    every earlier token."""
    t, spans = len(text), find_words(text)
    offsets = [(i, i + 1) for i in range(t)]
    causal = np.tril(np.ones((t, t), np.float32)) / np.arange(1, t + 1, dtype=np.float32)[:, None]
    return AttentionCapture(text, list(range(t)), list(text), offsets,
                            np.broadcast_to(causal, (N_LAYER, N_HEAD, t, t)).copy(), spans,
                            token_word_index(offsets, spans, t), 0, t)


def half_tensor(shape, content: bytes, dtype=types_pb2.DT_HALF) -> tensor_pb2.TensorProto:
    return tensor_pb2.TensorProto(dtype=dtype, tensor_content=content,
                                  tensor_shape=tensor_shape_pb2.TensorShapeProto(
                                      dim=[tensor_shape_pb2.TensorShapeProto.Dim(size=n)
                                           for n in shape]))


def weights_with(value) -> tensor_pb2.TensorProto:
    weights = capture().weights.copy()
    weights[1, 1, 5, 2] = value
    return half_tensor(weights.shape, weights.astype("<f2").tobytes())


def replaced(summary, description=None, tensor=None):
    """`summary` with its description (bytes, or a function of the written one) or tensor
    replaced."""
    value = summary.value[0]
    if callable(description):
        description = json.dumps(description(json.loads(value.metadata.plugin_data.content)))
    if description is not None:
        value.metadata.plugin_data.content = (
            description if isinstance(description, bytes) else description.encode())
    if tensor is not None:
        value.tensor.CopyFrom(tensor)
    return summary


def crafted(name: str, description=None, tensor=None):
    """One text's summary as write_attention writes it, its description or tensor replaced."""
    return replaced(attention_summary(name, capture(), 0), description, tensor)


STRINGS = tensor_pb2.TensorProto(dtype=types_pb2.DT_STRING, string_val=[b"x"] * 4,
                                 tensor_shape=tensor_shape_pb2.TensorShapeProto(dim=[
                                     tensor_shape_pb2.TensorShapeProto.Dim(size=n)
                                     for n in (1, 1, 2, 2)]))
# name: (a new description: bytes, or a function of the written one; the reason it is skipped)
CRAFTED_DESCRIPTIONS = {
    "truncated": (b'{"version": 1, "tokens": [', "its description is not readable JSON"),
    "nested": (b"[" * 100_000, "its description is not readable JSON"),
    "not_utf8": (b"\xff\xfe{}", "its description is not readable JSON"),
    "a_list": (b"[1, 2]", "its description is not tinylm attention"),
    "old_format": (lambda c: {**c, "version": 0}, "written in tinylm attention format 0"),
    "nan_step": (lambda c: {**c, "step": float("nan")}, "its name, step, words or note"),
    "huge_shape": (lambda c: {**c, "shape": [10**6, 12, 128, 128]}, "its shape is not"),
    "huge_tokens": (lambda c: {**c, "tokens": ["x"] * 100_000}, "its tokens and their words"),
    "long_token": (lambda c: {**c, "tokens": ["x" * 100_000, *c["tokens"][1:]]},
                   "its tokens and their words"),
    "far_word": (lambda c: {**c, "token_words": [10**9, *c["token_words"][1:]]},
                 "its tokens and their words"),
    "far_pronoun": (lambda c: {**c, "pronouns": [10**9]}, "its pronouns are not word indices"),
    "odd_kv_heads": (lambda c: {**c, "kv_heads": [2, 3]}, "its kv_heads are not 2 counts"),
    "kv_heads_text": (lambda c: {**c, "kv_heads": "x" * 100_000}, "its kv_heads are not 2 counts"),
}
# name: (a new tensor, the reason /weights skips it); their descriptions are whole
CRAFTED_TENSORS = {
    "nan_weights": (weights_with(np.nan), "its weights hold numbers outside 0..1"),
    "inf_weights": (weights_with(np.inf), "its weights hold numbers outside 0..1"),
    "negative_weights": (weights_with(-0.5), "its weights hold numbers outside 0..1"),
    "wrong_shape": (half_tensor((2, 2, 5, 5), np.zeros(100, "<f2").tobytes()),
                    f"its weights are not 2 x 2 x {T} x {T} numbers"),
    "short_bytes": (half_tensor((N_LAYER, N_HEAD, T, T), b"\x00" * 10),
                    "its weights cannot be decoded"),
    "strings": (STRINGS, f"its weights are not 2 x 2 x {T} x {T} numbers"),
}
# served, cut to what the tab reads: a text of 200,000 words, a NaN in a field the tab ignores;
# and served with it, both heads of each layer sharing one key/value head
SERVED = {"long_text": lambda c: {**c, "text": TEXT + " word" * 200_000,
                                  "words": c["words"] + ["word"] * 200_000},
          "nan_elsewhere": lambda c: {**c, "loss": float("nan"), "more": [float("inf")]},
          "shared_kv_heads": lambda c: {**c, "kv_heads": [1, 1]}}

GOOD_REPORT = {"n": 3, "heads": [{"layer": layer, "head": head, "accuracy": (layer + head) / 4}
                                 for layer in range(2) for head in range(2)]}
GOOD_ACCURACY = np.array([[0.0, 0.25], [0.25, 0.5]])


def report_with(**head) -> str:
    return json.dumps({**GOOD_REPORT, "heads": [{**GOOD_REPORT["heads"][0], **head}]})


def probe_with(description=None, tensor=None, accuracy=GOOD_ACCURACY):
    """A probe report's summary as write_probe writes it, its description or tensor replaced."""
    return replaced(probe_summary(3, accuracy), description, tensor)


def accuracy_with(value) -> np.ndarray:
    accuracy = GOOD_ACCURACY.copy()
    accuracy[1, 0] = value
    return accuracy


GRID = f"its accuracies are not (layers <= {MAX_LAYERS}) x (heads <= {MAX_HEADS}) numbers"
# case: (its probe summary, the reason it is skipped); written by make_probe_runs, in
# probe_runs/<case>/, beside probe.json files the plugin never opens (make_probe_files)
CRAFTED_PROBES = {
    "truncated": (probe_with(b'{"version": 1, "n": '), "its description is not readable JSON"),
    "nested": (probe_with(b"[" * 100_000), "its description is not readable JSON"),
    "a_list": (probe_with(b"[]"), "its description is not a tinylm-probe report"),
    "old_format": (probe_with(lambda c: {**c, "version": 0}),
                   "written in a tinylm-probe report format 0"),
    "no_n": (probe_with(b'{"version": 1}'), "its item count is not a number"),
    "huge_n": (probe_with(lambda c: {**c, "n": "x" * 1000}), "its item count is not a number"),
    "nan": (probe_with(accuracy=accuracy_with(np.nan)), "its accuracies hold numbers outside 0..1"),
    "infinite": (probe_with(accuracy=accuracy_with(np.inf)),
                 "its accuracies hold numbers outside 0..1"),
    "far_layer": (probe_with(accuracy=np.zeros((MAX_LAYERS + 1, 2))), GRID),
    "far_head": (probe_with(accuracy=np.zeros((2, MAX_HEADS + 1))), GRID),
    "short_bytes": (probe_with(tensor=half_tensor((10**6, 10**6), b"\x00" * 10)),
                    "its accuracies cannot be decoded"),
    "strings": (probe_with(tensor=STRINGS), GRID),
    "far_chance": (probe_with(lambda c: {**c, "chance": 1.5}),
                   "its chance level is not between 0 and 1"),
    "huge_chance": (probe_with(lambda c: {**c, "chance": 10**400}),  # no OverflowError
                    "its chance level is not between 0 and 1"),
    "long_reads": (probe_with(lambda c: {**c, "reads": "x" * 100_000}),
                   "what it reads is not a text of at most"),
}
OUT_OF_LOGDIR = "its folder resolves outside the logdir: not served"


def write_run(directory, summaries) -> None:
    writer = SummaryWriter(str(directory))
    for summary in summaries:
        writer.file_writer.add_summary(summary, 0)
    writer.close()


def make_probe_files(probes, outside) -> None:
    """A probe.json in probes/<case>/ for each case, good and bad, crafted and broken as a file
    may be: the plugin reads reports from summaries only and never opens one (a device file needs
    the right to make one)."""
    files = {
        "good": json.dumps(GOOD_REPORT), "truncated": json.dumps(GOOD_REPORT)[:30],
        "nested": "[" * 100_000, "a_list": "[]", "no_heads": '{"n": 3}',
        "nan": report_with(accuracy=float("nan")), "infinite": report_with(accuracy=float("inf")),
        "far_layer": report_with(layer=10**9), "far_head": report_with(head=MAX_HEADS),
        "huge_n": json.dumps({**GOOD_REPORT, "n": "x" * 1000}),
    }
    for case, text in files.items():
        (probes / case).mkdir(parents=True)
        (probes / case / "probe.json").write_text(text)
    for case in ("oversize", "broken", "loop", "out", "fifo", "socket", "device"):
        (probes / case).mkdir()
    with open(probes / "oversize" / "probe.json", "wb") as f:
        f.truncate(10**7 + 1)  # sparse: no disk used
    os.symlink(probes / "gone.json", probes / "broken" / "probe.json")
    os.symlink(probes / "loop" / "probe.json", probes / "loop" / "probe.json")
    (outside / "probe.json").write_text(json.dumps(GOOD_REPORT))
    os.symlink(outside / "probe.json", probes / "out" / "probe.json")
    os.mkfifo(probes / "fifo" / "probe.json")
    os.mknod(probes / "socket" / "probe.json", stat.S_IFSOCK | 0o600)
    try:  # a character device like /dev/null (major 1, minor 3)
        os.mknod(probes / "device" / "probe.json", stat.S_IFCHR | 0o600, os.makedev(1, 3))
    except PermissionError:
        pass


def make_probe_runs(runs, outside) -> None:
    """A run in runs/<case>/ for each probe summary, good and crafted, and runs/out linked to a
    good one outside the logdir."""
    write_run(runs / "good", [probe_with()])
    for case, (summary, _) in CRAFTED_PROBES.items():
        write_run(runs / case, [summary])
    write_run(outside / "probe_run", [probe_with()])
    os.symlink(outside / "probe_run", runs / "out")


# Folders that writers killed mid-write leave behind, each holding a good text and probe report:
# never runs of the tab
LEFTOVERS = [".good.tmp-4242-0a1b2c3d", ".good.old-4242-0a1b2c3d", "probe_runs/.out.tmp-7-ff",
             ".hidden/run", "export.tmp", "good/.sample.tmp-1-aa"]


def make_logdir(root):
    """The logdir: runs good (one text), crafted (every crafted summary), linked (a link to a run
    folder outside the logdir), probe_runs/<case> and probes/<case>/probe.json files, and the
    LEFTOVERS of killed writers."""
    logdir, outside = root / "logs", root / "elsewhere"
    write_run(logdir / "good", [crafted("story")])
    for leftover in LEFTOVERS:
        write_run(logdir / leftover, [crafted("story"), probe_with()])
    write_run(logdir / "crafted", [
        *(crafted(name, description) for name, (description, _) in CRAFTED_DESCRIPTIONS.items()),
        *(crafted(name, tensor=tensor) for name, (tensor, _) in CRAFTED_TENSORS.items()),
        *(crafted(name, description) for name, description in SERVED.items())])
    write_run(outside / "run", [crafted("story")])
    os.symlink(outside / "run", logdir / "linked")
    make_probe_runs(logdir / "probe_runs", outside)
    make_probe_files(logdir / "probes", outside)
    return logdir


def add_bad_event_files(run_dir, outside) -> None:
    """Event files that are not: a FIFO, links to nothing, to themselves, out of the logdir; the
    data provider loads none of them. TensorBoard's own Python loader blocks on such a FIFO, so
    in-process they come after it."""
    os.mkfifo(run_dir / "events.out.tfevents.fifo")
    os.symlink(run_dir / "gone", run_dir / "events.out.tfevents.gone")
    os.symlink(run_dir / "events.out.tfevents.loop", run_dir / "events.out.tfevents.loop")
    (outside / "events.out.tfevents.0").write_bytes(b"")
    os.symlink(outside / "events.out.tfevents.0", run_dir / "events.out.tfevents.out")


def strict_json(text):
    """JSON as a browser's JSON.parse reads it: NaN and Infinity are not JSON."""
    def refuse(constant):
        raise ValueError(f"{constant} is not JSON")
    return json.loads(text, parse_constant=refuse)


def attention_bound(t: int) -> int:
    """The most bytes /attention may answer for T tokens: T tokens and at most T words of
    MAX_CHARS characters (12 bytes each at worst, as JSON escapes a character outside the BMP),
    a word index per token, pronouns, names and the pronouns read against names among the words
    and the gendered ones (at most T), a name and a note, and each layer's key/value heads."""
    return (2 * t + 2) * (12 * MAX_CHARS + 4) + 5 * t * 8 + 400


# the most bytes one probe report or problem may take: a MAX_LAYERS x MAX_HEADS grid of numbers,
# what it reads (4 * MAX_CHARS characters), its run twice
PROBE_BOUND = MAX_LAYERS * MAX_HEADS * 26 + 12 * 4 * MAX_CHARS + 1000
# the most bytes /texts may take per text listed: its run twice, name, kind, steps and sentence
TEXT_BOUND = 500 + 12 * SENTENCE_CHARS
N_PROBE_RUNS = len(CRAFTED_PROBES) + 2  # and good, out


def answer(get, path: str) -> tuple[int, bytes]:
    """(status, body) of get(path), which must answer within TIMEOUT_S."""
    result = []
    thread = threading.Thread(target=lambda: result.append(get(path)), daemon=True)
    thread.start()
    thread.join(TIMEOUT_S)
    assert result, f"{path} did not answer within {TIMEOUT_S} s"
    return result[0]


def every_route(get) -> dict:
    """Request every route, every listed text and the crafted ones; check each answers in time,
    200 with strict JSON (404 for a name that is no run) of bounded size. Returns the answers:
    {"texts": ..., "probes": ..., ("attention" | "weights", run, tag): JSON or bytes}."""
    answers, size = {}, {}
    for route in ("texts", "probes"):
        status, body = answer(get, f"{ROUTE}/{route}")
        assert status == 200, (route, body[:300])
        answers[route], size[route] = strict_json(body), len(body)
    texts = answers["texts"]
    # a few hundred bytes per text or problem listed; at most a grid per probe file
    assert size["texts"] <= 500 * len(texts["problems"]) + TEXT_BOUND * len(texts["texts"])
    assert size["probes"] <= PROBE_BOUND * N_PROBE_RUNS
    for route in ("index.js", "style.css"):
        assert answer(get, f"{ROUTE}/{route}")[0] == 200
    names = [(t["run"], s["tag"]) for t in texts["texts"] for s in t["steps"]]
    names += [("crafted", step_tag(name, 0)) for name in CRAFTED_DESCRIPTIONS]
    names += [("linked", step_tag("story", 0))]
    for run, tag in names:
        query = urllib.parse.urlencode({"run": run, "tag": tag})
        status, body = answer(get, f"{ROUTE}/attention?{query}")
        assert status == 200 and len(body) <= attention_bound(T), (run, tag, len(body))
        answers["attention", run, tag] = strict_json(body)
        status, body = answer(get, f"{ROUTE}/weights?{query}")
        assert status == 200 and len(body) <= 2 * N_LAYER * N_HEAD * T * T, (run, tag)
        answers["weights", run, tag] = body
    for run in ("../elsewhere/run", "/etc", "linked/../../elsewhere/run", *LEFTOVERS):
        query = urllib.parse.urlencode({"run": run, "tag": step_tag("story", 0)})
        for route in ("attention", "weights"):
            status, body = answer(get, f"{ROUTE}/{route}?{query}")
            assert status == 404 and strict_json(body) == {"error": "no such run and tag"}
    return answers


def check_answers(answers) -> None:
    """What every_route's answers must say about the crafted logdir."""
    texts = answers["texts"]
    assert sorted((t["run"], t["name"]) for t in texts["texts"]) == sorted(
        [("good", "story")] + [("crafted", name) for name in [*CRAFTED_TENSORS, *SERVED]])
    # each named by what it holds: the start of its text, and who wrote it
    good_text = next(t for t in texts["texts"] if t["run"] == "good")
    assert (good_text["sentence"], good_text["kind"], good_text["run_label"]) == (
        TEXT, "inspect", "good")
    long_text = next(t for t in texts["texts"] if t["name"] == "long_text")
    assert len(long_text["sentence"]) == SENTENCE_CHARS and long_text["sentence"].endswith("…")
    # a killed writer's leftover folder is no run: neither listed nor skipped
    # the bad event files beside "good" hold no summaries: nothing to list
    problems = {(p["run"], p.get("tag")): p["message"] for p in texts["problems"]}
    expected = {("crafted", step_tag(name, 0)): f"{step_tag(name, 0)}: {why}"
                for name, (_, why) in CRAFTED_DESCRIPTIONS.items()}
    expected[("linked", None)] = OUT_OF_LOGDIR
    assert problems.keys() == expected.keys()
    for key, message in expected.items():
        assert problems[key].startswith(message), (key, problems[key])

    # a served text: the good one, whole; one of 200,000 words, cut to the words the model read
    good = answers["attention", "good", step_tag("story", 0)]
    assert good["tokens"] == list(TEXT) and good["words"] == ["Lily", "saw", "Tom", "She", "ran"]
    assert [good["words"][w] for w in good["pronouns"]] == ["She"]
    # written without key/value heads (tinylm's own models, older data): every head has its own
    assert good["kv_heads"] == [N_HEAD] * N_LAYER
    assert answers["attention", "crafted", step_tag("shared_kv_heads", 0)]["kv_heads"] == [1, 1]
    assert answers["attention", "crafted", step_tag("long_text", 0)]["words"] == good["words"]
    assert "loss" not in answers["attention", "crafted", step_tag("nan_elsewhere", 0)]
    weights = np.frombuffer(answers["weights", "good", step_tag("story", 0)], "<f2")
    np.testing.assert_array_equal(weights, capture().weights.astype("<f2").ravel())

    # a skipped text answers why, on both of its routes
    for name, (_, why) in CRAFTED_DESCRIPTIONS.items():
        tag = step_tag(name, 0)
        problem = answers["attention", "crafted", tag]["problem"]
        assert problem["message"].startswith(f"{tag}: {why}")
        assert json.loads(answers["weights", "crafted", tag]) == {"problem": problem}
    for name, (_, why) in CRAFTED_TENSORS.items():
        tag = step_tag(name, 0)
        assert json.loads(answers["weights", "crafted", tag])["problem"]["message"].startswith(
            f"{tag}: {why}")
    linked = json.loads(answers["weights", "linked", step_tag("story", 0)])["problem"]
    assert linked["message"].endswith(OUT_OF_LOGDIR)

    # the probe.json files under probes/ are never opened: only summaries are reports
    probes = answers["probes"]
    assert probes["reports"] == [{"run": "probe_runs/good", "run_label": "probe_runs/good", "n": 3,
                                  "accuracy": [[0.0, 0.25], [0.25, 0.5]], "chance": 0.5,
                                  "reads": PROBE_READS}]
    skipped = {p["run"]: p["message"] for p in probes["problems"]}
    assert all(p["tag"] == PROBE_TAG for p in probes["problems"])
    assert skipped.keys() == {f"probe_runs/{case}" for case in [*CRAFTED_PROBES, "out"]}
    for case, (_, why) in CRAFTED_PROBES.items():
        assert skipped[f"probe_runs/{case}"].startswith(f"{PROBE_TAG}: {why}"), case
    assert skipped["probe_runs/out"] == f"{PROBE_TAG}: {OUT_OF_LOGDIR}"


@pytest.fixture(scope="module")
def crafted_app(tmp_path_factory):
    """A werkzeug client of the plugin in-process over the crafted logdir."""
    root = tmp_path_factory.mktemp("crafted")
    logdir = make_logdir(root)
    client = tab.in_process_app(logdir)
    add_bad_event_files(logdir / "good", root / "elsewhere")
    return client


def test_a_killed_writers_leftover_folder_is_no_run():
    for run in LEFTOVERS + [".out.tmp-123-abcdef01", "runs\\.x.tmp-1-ab", "a/b.tmp", ".git/x"]:
        assert is_leftover(run), run
    for run in [".", "good", "probe/2026-12-01_07-48-40", "tmpdir", "a.tmpl", "my.temp/x",
                "inspect/2026_tmp"]:
        assert not is_leftover(run), run


def test_every_route_answers_strict_bounded_json_and_lists_what_it_skipped(crafted_app):
    def get(path):
        response = crafted_app.get(path)
        return response.status_code, response.data

    check_answers(every_route(get))


def test_the_largest_description_of_gpt2s_shape_is_served_within_the_stated_bound():
    # 12 layers x 12 heads over 128 tokens, every string as long and as costly as JSON allows:
    # the bound is reached within 2 KB
    t, longest = 128, "\U0001F600" * MAX_CHARS  # outside the BMP: 12 bytes as a JSON escape
    description = {"version": 1, "name": longest, "step": 2**63 - 1, "shape": [12, 12, t, t],
                   "tokens": [longest] * t, "words": [longest] * t,
                   "token_words": list(range(t)), "pronouns": list(range(t)),
                   "names": list(range(t)), "window_note": longest}
    served = json.dumps(read_content(json.dumps(description)), allow_nan=False)
    assert attention_bound(t) - 4200 < len(served) <= attention_bound(t) == 799_128
    assert 2 * 12 * 12 * t * t == 4_718_592  # its weights, float16


def test_a_run_folder_linked_from_outside_the_logdir_is_not_served(crafted_app):
    query = urllib.parse.urlencode({"run": "linked", "tag": step_tag("story", 0)})
    for route in ("attention", "weights"):
        response = crafted_app.get(f"{ROUTE}/{route}?{query}")
        assert response.status_code == 200 and "tokens" not in response.json
        assert response.json["problem"]["run"] == "linked"


# ------------------------------------------------------------------------ a real TensorBoard


@pytest.fixture(scope="module")
def crafted_server(tmp_path_factory):
    """`tensorboard --logdir` over the crafted logdir, as a user starts it (its own loader copes
    with the bad event files); yields its base URL."""
    root = tmp_path_factory.mktemp("crafted_server")
    logdir = make_logdir(root)
    add_bad_event_files(logdir / "good", root / "elsewhere")
    with tensorboard_server(logdir, root / "tensorboard.log") as (process, base):
        def loaded():
            assert process.poll() is None, (root / "tensorboard.log").read_text(errors="replace")
            try:
                with urllib.request.urlopen(f"{base}{ROUTE}/texts", timeout=TIMEOUT_S) as r:
                    listing = json.loads(r.read())
            except (urllib.error.URLError, ConnectionError):
                return False
            return {t["run"] for t in listing["texts"]} == {"good", "crafted"} and any(
                p["run"] == "linked" for p in listing["problems"])

        tab.wait_for(loaded, STARTUP_TIMEOUT_S, "tensorboard to load the crafted logdir")
        yield base


def http_get(base):
    def get(path):
        try:
            with urllib.request.urlopen(base + path, timeout=TIMEOUT_S) as response:
                return response.status, response.read()
        except urllib.error.HTTPError as error:
            return error.code, error.read()
    return get


@pytest.mark.slow
def test_a_real_tensorboard_serves_every_route_of_a_crafted_logdir(crafted_server):
    check_answers(every_route(http_get(crafted_server)))


@pytest.mark.slow
def test_the_tab_says_what_it_skipped_and_draws_the_first_text_it_can(crafted_server, browser):
    tab.open_tab(browser, crafted_server)
    lines = browser.execute_script(
        "return [...document.querySelectorAll('#problems .problem')].map(p => p.textContent)")
    # the text listed first has crafted weights: it is named, and the next one drawn instead
    first, second = sorted([*CRAFTED_TENSORS, *SERVED])[:2]
    assert (f'Skipped run "crafted", {step_tag(first, 0)}: {CRAFTED_TENSORS[first][1]}'
            in "\n".join(lines)), lines
    for case, (_, why) in CRAFTED_PROBES.items():
        assert f'Skipped run "probe_runs/{case}", {PROBE_TAG}: {why}' in "\n".join(lines), case
    assert any(line.startswith('Skipped run "linked", its folder resolves outside') for line
               in lines)
    assert not any("probe.json" in line or "tfevents" in line for line in lines), lines
    drawn = browser.execute_script(
        "const o = document.querySelector('#text-select').selectedOptions[0];"
        "return [o.dataset.run, o.dataset.name, o.text]")
    assert drawn[:2] == ["crafted", second] and drawn[2].startswith(f'"{TEXT}')
    assert "(inspected)" in drawn[2]
    assert len(browser.find_elements("css selector", "#tokens .token")) == T
    tab.choose_text(browser, "good")
    assert browser.find_element("css selector", ".probe-grid td[data-layer='1'][data-head='1']"
                                ).text == "0.50"
