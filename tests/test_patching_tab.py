"""Activation patching in the attention tab: the summary tinylm-probe patch=true writes, the routes
that serve it (one pair at a time, NaN as null, crafted reports listed as skipped), and the tab in
headless Chromium showing it beside the attention of the pair's clean text.
"""

import json
import os
import urllib.error
import urllib.parse

import numpy as np
import pytest
import test_plugin_logdir as logdir_tests
import test_tensorboard_plugin as tab
from helpers import STARTUP_TIMEOUT_S, causal_weights, tensorboard_server
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.compat.proto import types_pb2
from tensorboard.util import tensor_util
from torch.utils.tensorboard import SummaryWriter

from tinylm.inspection.capture import AttentionCapture, find_words, token_word_index, word_level
from tinylm.inspection.tensorboard_plugin import PROBE_PLUGIN_NAME
from tinylm.inspection.tensorboard_plugin.reading import MAX_CHARS, MAX_PATCHED
from tinylm.inspection.tensorboard_plugin.summary import (
    PATCHING_POSITIONS_TAG,
    PATCHING_TAG,
    PROBE_READS,
    PROBE_TAG,
    patching_summary,
    write_attention,
    write_patching,
    write_probe,
)

ROUTE = tab.ROUTE
N_LAYER, N_HEAD = 2, 3  # not square: a grid served transposed would show
TEXT = "Lily saw Tom. She ran."
CLEAN = [list("Lily saw Tom. "), list("Ann ran. ")]  # each pair's clean tokens: up to "She"
T_MAX = max(map(len, CLEAN))
browser = tab.browser  # the headless Chromium of the tab's own tests


def pairs() -> list[dict]:
    return [{"source": f"agreement.jsonl:{i}", "tokens": tokens, "position": len(tokens) - 1,
             "m_clean": np.float32(2.5 - i), "m_counterfactual": -1.25, "pronoun": " She",
             "wrong_pronoun": " He"} for i, tokens in enumerate(CLEAN)]


def report_arrays(seed: int = 0):
    """Effects (L, nh) with an undefined one, intervals (L, nh, 2), effects per pair and position
    (P, L, nh, T_max) NaN-padded after each pair's tokens."""
    rng = np.random.default_rng(seed)
    effects = rng.uniform(-0.5, 1.2, (N_LAYER, N_HEAD)).astype(np.float32)
    effects[1, 2] = np.nan
    intervals = np.stack([effects - 0.1, effects + 0.2], axis=-1)
    by_position = np.full((len(CLEAN), N_LAYER, N_HEAD, T_MAX), np.nan, np.float32)
    for p, tokens in enumerate(CLEAN):
        by_position[p, ..., :len(tokens)] = rng.uniform(-1, 1, (N_LAYER, N_HEAD, len(tokens)))
    return effects, intervals, by_position


def capture(text: str = TEXT, seed: int = 0) -> AttentionCapture:
    """Char-level random attention over `text` of a model of the report's shape."""
    t, spans = len(text), find_words(text)
    offsets = [(i, i + 1) for i in range(t)]
    return AttentionCapture(text, list(range(t)), list(text), offsets,
                            causal_weights(seed, (N_LAYER, N_HEAD, t, t)), spans,
                            token_word_index(offsets, spans, t), 0, t)


def write_run(directory, write) -> None:
    writer = SummaryWriter(str(directory))
    write(writer)
    writer.close()


def write_probe_run(directory) -> None:
    """What tinylm-probe patch=true writes: the accuracy grid, the patching report, the attention
    of the first pair's clean text."""
    def write(writer):
        write_probe(writer, 8, np.full((N_LAYER, N_HEAD), 0.5))
        write_patching(writer, *report_arrays(), pairs(), n_skipped=3, interval_level=0.9)
        write_attention(writer, "patching/pair_000", capture(), 0)
    write_run(directory, write)


def nan_as_null(array) -> list:
    return [nan_as_null(a) for a in array] if np.ndim(array) else (
        None if np.isnan(array) else float(array))


# ------------------------------------------------------------------------------- the data


def test_a_patching_report_round_trips_through_its_summary(tmp_path):
    write_run(tmp_path, lambda writer: write_patching(writer, *report_arrays(), pairs(), 3))
    events = EventAccumulator(str(tmp_path), size_guidance={"tensors": 0})
    events.Reload()
    assert sorted(events.Tags()["tensors"]) == [PATCHING_TAG, PATCHING_POSITIONS_TAG]
    effects, intervals, by_position = report_arrays()
    stored = {}
    for tag in (PATCHING_TAG, PATCHING_POSITIONS_TAG):
        plugin_data = events.SummaryMetadata(tag).plugin_data
        assert plugin_data.plugin_name == PROBE_PLUGIN_NAME
        (event,) = events.Tensors(tag)
        assert event.tensor_proto.dtype == types_pb2.DT_FLOAT
        stored[tag] = json.loads(plugin_data.content), tensor_util.make_ndarray(
            event.tensor_proto)
    content, grid = stored[PATCHING_TAG]
    np.testing.assert_array_equal(grid, np.concatenate([effects[..., None], intervals], -1))
    np.testing.assert_array_equal(stored[PATCHING_POSITIONS_TAG][1], by_position)  # NaN too
    assert content["shape"] == [2, N_LAYER, N_HEAD, T_MAX] and content["n_skipped"] == 3
    assert content["interval_level"] is None  # not given
    # numpy numbers in the pairs are written as plain JSON numbers
    assert content["pairs"] == [{**pair, "m_clean": float(pair["m_clean"])} for pair in pairs()]


def test_patching_arrays_of_shapes_that_do_not_fit_are_refused(tmp_path):
    effects, intervals, by_position = report_arrays()
    for bad in ((effects, intervals[:1], by_position), (effects, intervals, by_position[:1]),
                (effects, intervals, by_position[..., 0]), (effects[0], intervals, by_position)):
        with pytest.raises(ValueError, match="patching shapes do not fit"):
            patching_summary(*bad, pairs(), 0)


# ------------------------------------------------------------------------------- the routes


def test_the_routes_serve_the_grid_and_one_pair_at_a_time_with_nan_as_null(tmp_path):
    write_probe_run(tmp_path / "run" / "probe")
    client = tab.in_process_app(tmp_path)
    effects, intervals, by_position = report_arrays()

    body = client.get(f"{ROUTE}/patching").data
    (report,) = logdir_tests.strict_json(body)["reports"]
    assert report == {"run": "run/probe", "run_label": "run/probe", "n_skipped": 3,
                      "interval_level": 0.9, "shape": [N_LAYER, N_HEAD],
                      "effect": nan_as_null(effects), "interval": nan_as_null(intervals),
                      "pairs": [{**{k: v for k, v in json.loads(json.dumps(pair, default=float))
                                    .items() if k != "tokens"},
                                 "text": "".join(tokens).strip() + " She"}
                                for pair, tokens in zip(pairs(), CLEAN, strict=True)]}
    assert report["effect"][1][2] is None and report["interval"][1][2] == [None, None]
    assert len(body) < 2000  # a few numbers per head, a line per pair

    for p, tokens in enumerate(CLEAN):
        query = urllib.parse.urlencode({"run": "run/probe", "pair": p})
        body = client.get(f"{ROUTE}/patching_pair?{query}").data
        served = logdir_tests.strict_json(body)
        assert served["pair"] == p and served["tokens"] == tokens
        assert served["position"] == len(tokens) - 1 and served["m_counterfactual"] == -1.25
        # cut to the pair's own tokens: the padding is not served
        assert served["effect"] == nan_as_null(by_position[p, ..., :len(tokens)])
        assert len(body) < 30 * N_LAYER * N_HEAD * len(tokens) + 1000

    for query in ("run=run/probe&pair=2", "run=run/probe&pair=-1", "run=run/probe&pair=x",
                  "run=run/probe&pair=%D9%A3", "run=run/probe", "run=run&pair=0",
                  "run=../elsewhere&pair=0", "pair=0"):
        response = client.get(f"{ROUTE}/patching_pair?{query}")
        assert response.status_code == 404 and response.json == {
            "error": "no such run and pair"}, query
    # the probe report beside it is served as before; the patching tags are not taken for one
    assert client.get(f"{ROUTE}/probes").json == {"reports": [{
        "run": "run/probe", "run_label": "run/probe", "n": 8,
        "accuracy": np.full((N_LAYER, N_HEAD), 0.5).tolist(), "chance": 0.5,
        "reads": PROBE_READS}], "problems": []}


def test_a_report_of_more_than_1024_pairs_is_served_and_each_pair_named_by_its_sentence(tmp_path):
    n = 1100  # the bound was 1,024 pairs: such a report was written, and the tab refused it
    rng = np.random.default_rng(1)
    many = [{**pairs()[i % 2], "tokens": [f"Kid{i}", " ran", "."], "position": 2,
             "source": f"mine.jsonl, line {i + 1}"} for i in range(n)]
    effects = rng.uniform(-0.2, 0.8, (N_LAYER, N_HEAD)).astype(np.float32)
    by_position = rng.uniform(-1, 1, (n, N_LAYER, N_HEAD, 3)).astype(np.float32)
    write_run(tmp_path / "many", lambda writer: write_patching(
        writer, effects, np.stack([effects - 0.1, effects + 0.1], -1), by_position, many, 0))
    client = tab.in_process_app(tmp_path)
    listing = logdir_tests.strict_json(client.get(f"{ROUTE}/patching").data)
    assert listing["problems"] == []
    (report,) = listing["reports"]
    assert len(report["pairs"]) == n and report["pairs"][n - 1]["text"] == f"Kid{n - 1} ran. She"
    served = logdir_tests.strict_json(client.get(
        f"{ROUTE}/patching_pair?run=many&pair={n - 1}").data)
    assert served["tokens"] == [f"Kid{n - 1}", " ran", "."]
    assert served["effect"] == nan_as_null(by_position[n - 1])


def description_with(**changes):
    """A function of a written patching description: `changes` applied to it, or to its first
    pair for keys starting with pair_."""
    def change(content):
        first = {**content["pairs"][0], **{k[5:]: v for k, v in changes.items()
                                           if k.startswith("pair_")}}
        return {**content, "pairs": [first, *content["pairs"][1:]],
                **{k: v for k, v in changes.items() if not k.startswith("pair_")}}
    return change


def crafted_report(description=None, grid=None, by_position=None, arrays=None):
    """The two summaries of a patching report (of `arrays`, or report_arrays()), its description
    or either tensor replaced."""
    summary = patching_summary(*(arrays or report_arrays()), pairs(), 3)
    main, positions = summary.value
    for value, tensor in ((main, grid), (positions, by_position)):
        if tensor is not None:
            value.tensor.CopyFrom(tensor)
    return logdir_tests.replaced(summary, description)


def infinite_effect():
    effects, intervals, by_position = report_arrays()
    by_position[1, 0, 2, 3] = np.inf
    return effects, intervals, by_position


# case: (its summaries, the reason it is skipped)
CRAFTED_REPORTS = {
    "truncated": (crafted_report(b'{"version": 1, "shape": ['),
                  "its description is not readable JSON"),
    "nested": (crafted_report(b"[" * 100_000), "its description is not readable JSON"),
    "old_format": (crafted_report(description_with(version=0)),
                   "written in a tinylm patching report format 0"),
    "huge_shape": (crafted_report(description_with(shape=[10**6, 12, 12, 1024])),
                   "its shape is not (pairs, layers <= "),
    "too_many_effects": (crafted_report(description_with(shape=[MAX_PATCHED // 4096 + 1, 64, 64,
                                                                1])),
                         "its shape is not (pairs, layers <= "),
    "no_skipped": (crafted_report(description_with(n_skipped=-1)),
                   "its count of skipped pairs is not a number"),
    "far_level": (crafted_report(description_with(interval_level=95)),
                  "its interval level is not a number between 0 and 1"),
    "fewer_pairs": (crafted_report(description_with(pairs=[])), "its pairs are not a list of 2"),
    "pair_list": (crafted_report(description_with(pairs=[[], []])), "its pair 0 is not an object"),
    "many_tokens": (crafted_report(description_with(pair_tokens=["x"] * (T_MAX + 1))),
                    f"its pair 0 has not 1..{T_MAX} tokens"),
    "long_token": (crafted_report(description_with(pair_tokens=["x" * (MAX_CHARS + 1)])),
                   f"its pair 0 has not 1..{T_MAX} tokens"),
    "far_position": (crafted_report(description_with(pair_position=T_MAX)),
                     "its pair 0's position is not one of its"),
    "nan_margin": (crafted_report(description_with(pair_m_clean=float("nan"))),
                   "its pair 0's margins are not finite numbers"),
    # written as 1 and 400 zeros: an int no float holds (it made every run's /patching a 500)
    "huge_margin": (crafted_report(description_with(pair_m_clean=10**400)),
                    "its pair 0's margins are not finite numbers"),
    "infinite_margin": (crafted_report(description_with(pair_m_counterfactual=float("inf"))),
                        "its pair 0's margins are not finite numbers"),  # as 1e400 reads
    "huge_level": (crafted_report(description_with(interval_level=-10**400)),
                   "its interval level is not a number between 0 and 1"),
    "string_margin": (crafted_report(description_with(pair_m_counterfactual="1")),
                      "its pair 0's margins are not finite numbers"),
    "no_pronoun": (crafted_report(description_with(pair_pronoun=None)),
                   "its pair 0's source and pronouns are not texts"),
    "wrong_grid": (crafted_report(grid=logdir_tests.half_tensor((2, 2, 3), b"\0" * 24)),
                   "its effects are not 2 x 3 x 3 numbers"),
    "short_bytes": (crafted_report(grid=logdir_tests.half_tensor((10**6, 10**6), b"\0" * 10)),
                    "its effects cannot be decoded"),
    "strings": (crafted_report(by_position=logdir_tests.STRINGS),
                f"its effects per position are not 2 x 2 x 3 x {T_MAX} numbers"),
    "infinite": (crafted_report(arrays=infinite_effect()),
                 "its effects per position hold infinite numbers"),
}


def test_a_crafted_patching_report_ends_in_a_listed_problem_never_a_traceback(tmp_path):
    logdir, outside = tmp_path / "logs", tmp_path / "elsewhere"
    for case, (summary, _) in CRAFTED_REPORTS.items():
        logdir_tests.write_run(logdir / case, [summary])
    half = patching_summary(*report_arrays(), pairs(), 3)
    del half.value[1]
    logdir_tests.write_run(logdir / "half", [half])
    write_probe_run(logdir / "good")
    write_probe_run(outside / "run")
    os.symlink(outside / "run", logdir / "linked")
    client = tab.in_process_app(logdir)

    listing = logdir_tests.strict_json(client.get(f"{ROUTE}/patching").data)
    assert [r["run"] for r in listing["reports"]] == ["good"]
    skipped = {p["run"]: p["message"] for p in listing["problems"]}
    expected = {case: why for case, (_, why) in CRAFTED_REPORTS.items()}
    expected["half"] = f"{PATCHING_POSITIONS_TAG} is not in the run"
    expected["linked"] = logdir_tests.OUT_OF_LOGDIR
    assert skipped.keys() == expected.keys()
    for run, why in expected.items():
        assert skipped[run].startswith(f"{PATCHING_TAG}: {why}"), (run, skipped[run])
        # the pair route names the same reason, in strict JSON
        response = client.get(f"{ROUTE}/patching_pair?run={run}&pair=0")
        assert response.status_code == 200, run
        problem = logdir_tests.strict_json(response.data)["problem"]
        assert problem == {"run": run, "tag": PATCHING_TAG, "message": skipped[run]}
    # the probe reports beside them: only the accuracy grids, the good and the linked one
    probes = client.get(f"{ROUTE}/probes").json
    assert [r["run"] for r in probes["reports"]] == ["good"]
    assert [(p["run"], p["tag"]) for p in probes["problems"]] == [("linked", PROBE_TAG)]


# ------------------------------------------------------------------------------- the browser


@pytest.fixture(scope="module")
def patching_server(tmp_path_factory):
    """`tensorboard --logdir` over a probe run with patching beside the attention of its first
    pair's clean text, and a run with a text and no patching; yields its base URL."""
    logdir = tmp_path_factory.mktemp("patching_tab")
    write_probe_run(logdir / "probe")
    write_run(logdir / "train", lambda writer: write_attention(
        writer, "inspect", capture("Tom and Ann ran. He fell. She saw it.", seed=1), 0))
    with tensorboard_server(logdir, logdir / "tensorboard.log") as (process, base):
        def loaded():
            assert process.poll() is None, (logdir / "tensorboard.log").read_text()
            get = logdir_tests.http_get(base)
            try:
                texts, patching = get(f"{ROUTE}/texts"), get(f"{ROUTE}/patching")
            except (urllib.error.URLError, ConnectionError):
                return False
            return len(json.loads(texts[1])["texts"]) == 2 and json.loads(
                patching[1])["reports"]

        tab.wait_for(loaded, STARTUP_TIMEOUT_S, "tensorboard to load the runs")
        yield base


def selected_cells(browser, table: str) -> list[tuple[int, int]]:
    return [tuple(map(int, pair)) for pair in browser.execute_script(
        f"return [...document.querySelectorAll('.{table} td.selected')]"
        ".map(td => [td.dataset.layer, td.dataset.head])")]


def expected_strip(pair: int, layer: int, head: int) -> list[tuple[str, str]]:
    values = report_arrays()[2][pair, layer, head, :len(CLEAN[pair])]
    return [(t, f"{v:.4f}") for t, v in zip(CLEAN[pair], values, strict=True)]


def strip(browser) -> list[tuple[str, str]]:
    """(token, effect as shown) of each position of the patching strip."""
    return [tuple(x) for x in browser.execute_script(
        "return [...document.querySelectorAll('#patch-strip .patch-token')]"
        ".map(s => [s.dataset.token, s.dataset.effect])")]


@pytest.mark.slow
def test_the_tab_shows_patching_beside_attention_and_both_grids_select_one_head(
        patching_server, browser, tmp_path):
    tab.open_tab(browser, patching_server)
    # texts named by what they hold; the probe's pairs are one entry, each pair by its sentence
    assert tab.option_labels(browser) == [
        ["train", "inspect", '"Tom and Ann ran. He fell. She saw it." (inspected)'],
        ["probe", "probe", '"Lily saw Tom. She" (probe pair 1 of 2)']]
    tab.choose_text(browser, "probe", kind="probe")
    assert tab.js(browser, "[...document.querySelectorAll('#pair-select option')]"
                           ".map(o => o.text)") == ["1. Lily saw Tom. She",
                                                    "2. Ann ran. She (patching only)"]

    # opened on the head with the largest patching effect, its first pronoun selected and its
    # attention row shaded (word level), without a click
    effects, intervals, _ = report_arrays()
    layer, head = np.unravel_index(np.nanargmax(effects), effects.shape)
    assert browser.find_element("id", "head-why").text.startswith(
        f"Opened on layer {layer} head {head}: the head whose patching carries the most")
    she = TEXT.index("She")
    assert browser.execute_script(
        "return [...document.querySelectorAll('#tokens .token.query')].map(s => +s.dataset.i)"
    ) == [she, she + 1, she + 2]
    weights, token_words = capture().weights, capture().token_words
    words = word_level(weights.astype(np.float64), token_words, max(token_words) + 1)
    p = token_words[she]
    expected = {t: words[layer, head, p, w] for t, w in enumerate(token_words) if 0 <= w <= p}
    shaded = tab.shading(browser)
    assert shaded.keys() == expected.keys()
    np.testing.assert_allclose([shaded[t] for t in expected], list(expected.values()), atol=2e-4)
    assert browser.find_elements("css selector", ".best-per-head")  # the attention grid

    # the patching grid: one cell per head, the value shown, its interval in the tooltip
    cells = browser.find_elements("css selector", ".patch-grid td")
    assert len(cells) == N_LAYER * N_HEAD
    cell = browser.find_element("css selector", ".patch-grid td[data-layer='1'][data-head='0']")
    assert cell.text == f"{effects[1, 0]:.2f}"
    assert cell.get_attribute("title") == (
        f"layer 1 head 0: effect {effects[1, 0]:.3f}, 90% bootstrap interval "
        f"{intervals[1, 0, 0]:.3f} .. {intervals[1, 0, 1]:.3f}")
    undefined = browser.find_element("css selector",
                                     ".patch-grid td[data-layer='1'][data-head='2']")
    assert undefined.get_attribute("data-effect") == "undefined"
    assert selected_cells(browser, "patch-grid") == selected_cells(browser, "best-per-head") == [
        (layer, head)]
    # its legend: 0, no effect, the baseline between the two directions
    assert browser.find_element("css selector", ".patch-grid + .legend .baseline").text == \
        "0: none"

    # clicking a head in the patching grid selects it in the attention grid, and the strip of
    # its effect per position is pair 1's, over its clean tokens, each effect written under
    cell.click()
    assert browser.find_element("id", "layer-select").get_attribute("value") == "1"
    assert browser.find_element("id", "head-select").get_attribute("value") == "0"
    assert selected_cells(browser, "best-per-head") == selected_cells(browser, "patch-grid") == [
        (1, 0)]
    assert strip(browser) == expected_strip(0, 1, 0)
    # and the other way round
    browser.find_element("css selector",
                         ".best-per-head td[data-layer='0'][data-head='2']").click()
    assert selected_cells(browser, "patch-grid") == [(0, 2)]
    assert strip(browser) == expected_strip(0, 0, 2)
    browser.save_screenshot(str(tmp_path / "patching.png"))

    # one pair picker: pair 2 moves the strip and the text, which tinylm-probe did not write
    tab.choose(browser, "pair-select", 1)
    tab.wait_for(lambda: len(strip(browser)) == len(CLEAN[1]), 10, "pair 2's strip")
    assert strip(browser) == expected_strip(1, 0, 2)
    assert tab.js(browser, "document.getElementById('text-select').selectedOptions[0].text") \
        == '"Ann ran. She" (probe pair 2 of 2)'
    assert not tab.tokens_shown(browser)
    assert "pair 2 has its patching effects only" in browser.find_element("id", "note").text
    tab.choose(browser, "pair-select", 0)
    tab.wait_for(lambda: tab.tokens_shown(browser) == list(TEXT), 10, "pair 1's text")
    assert strip(browser) == expected_strip(0, 0, 2)

    # a text of a run without patching opens on its first pronoun too, and names the run that has
    tab.choose_text(browser, "train")
    text = "Tom and Ann ran. He fell. She saw it."
    assert browser.execute_script(
        "return [...document.querySelectorAll('#tokens .token.query')].map(s => +s.dataset.i)"
    ) == [text.index("He"), text.index("He") + 1]
    assert tab.shading(browser)
    assert not browser.find_elements("css selector", ".patch-grid")
    assert 'Activation patching of run "probe"' in browser.find_element("id", "patching").text
