"""The "tinylm attention" TensorBoard tab: the data training and inspection write, the backend
that serves it (and nothing else), and the tab itself in headless Chromium against a real
tensorboard server.
"""

import dataclasses
import io
import json
import os
import re
import shutil
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import numpy as np
import pytest
from helpers import STARTUP_TIMEOUT_S, run_config, tensorboard_server
from PIL import Image
from tensorboard.backend import application
from tensorboard.backend.event_processing import data_provider as tb_data_provider
from tensorboard.backend.event_processing import plugin_event_multiplexer
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.plugins import base_plugin
from tensorboard.util import tensor_util
from torch.utils.tensorboard import SummaryWriter
from werkzeug.test import Client

from tinylm.checkpoint import load_checkpoint
from tinylm.cli.probe import ProbeConfig, run_probe
from tinylm.inspection.capture import (
    FEMALE_NAMES,
    MALE_NAMES,
    AttentionCapture,
    capture_attention,
    find_words,
    read_pronouns,
    word_level,
)
from tinylm.inspection.report import inspect_texts
from tinylm.inspection.tensorboard_plugin import PLUGIN_NAME
from tinylm.inspection.tensorboard_plugin.plugin import HOW_TO_MAKE_DATA, AttentionPlugin
from tinylm.inspection.tensorboard_plugin.summary import (
    PROBE_READS,
    PROBE_TAG,
    attention_summary,
    probe_summary,
    step_tag,
    write_attention,
    write_probe,
)
from tinylm.tokenizer import CharTokenizer
from tinylm.train.trainer import train

ROUTE = f"/data/plugin/{PLUGIN_NAME}"
STORY = ("Lily and Tom went to the park. She saw a big red ball. Tom ran to it and he "
         "kicked it. They played all day, and then she went home with her mum. ")


def stored_texts(logdir):
    """{tag: (content dict, float16 weights)} of one run's event files, read without the plugin."""
    events = EventAccumulator(str(logdir), size_guidance={"tensors": 0})
    events.Reload()
    found = {}
    for tag in events.Tags()["tensors"]:
        plugin_data = events.SummaryMetadata(tag).plugin_data
        if plugin_data.plugin_name != PLUGIN_NAME:
            continue
        (event,) = events.Tensors(tag)
        content = json.loads(plugin_data.content)
        found[tag] = content, tensor_util.make_ndarray(event.tensor_proto)
    return found


@pytest.fixture(scope="module")
def char_capture(tiny_model):
    def capture(text, n_layer, n_head, block_size):
        """Attention of an untrained char-level model over `text` (cut to block_size tokens)."""
        tokenizer = CharTokenizer.train([text])
        model = tiny_model(tokenizer.vocab_size, n_layer=n_layer, n_head=n_head,
                           block_size=block_size)
        return capture_attention(model, tokenizer, text)
    return capture


def write_text(logdir, name, capture, step=0):
    writer = SummaryWriter(str(logdir))
    write_attention(writer, name, capture, step)
    writer.close()


def in_process_app(logdir):
    """The plugin inside TensorBoard's WSGI app, over `logdir`, as a werkzeug test client."""
    multiplexer = plugin_event_multiplexer.EventMultiplexer(tensor_size_guidance={PLUGIN_NAME: 0})
    multiplexer.AddRunsFromDirectory(str(logdir))
    multiplexer.Reload()
    provider = tb_data_provider.MultiplexerDataProvider(multiplexer, str(logdir))
    plugin = AttentionPlugin(base_plugin.TBContext(logdir=str(logdir), data_provider=provider))
    return Client(application.TensorBoardWSGI([plugin], data_provider=provider))


# ------------------------------------------------------------------------------- the data


def test_the_summary_holds_float16_weights_and_the_words_pronouns_and_names(
        tmp_path, char_capture):
    capture = char_capture(STORY, n_layer=2, n_head=4, block_size=256)
    write_text(tmp_path, "story", capture, step=7)
    ((tag, (content, weights)),) = stored_texts(tmp_path).items()
    assert tag == step_tag("story", 7) == "story/step_00000007"
    assert weights.dtype == np.float16 and weights.shape == (2, 4, len(STORY), len(STORY))
    np.testing.assert_allclose(weights, capture.weights, atol=1e-3)
    assert content["step"] == 7 and content["text"] == STORY and content["window_note"] == ""
    assert content["tokens"] == list(STORY) and content["token_words"] == capture.token_words
    words = content["words"]
    assert [words[i] for i in content["pronouns"]] == ["She", "it", "he", "it", "They", "she",
                                                        "her"]
    assert [words[i] for i in content["names"]] == ["Lily", "Tom", "Tom"]


def test_a_text_longer_than_the_context_keeps_the_inspected_window_and_says_so(
        tmp_path, char_capture):
    capture = char_capture(STORY, n_layer=1, n_head=2, block_size=64)
    content = attention_summary("story", capture, 0).value[0].metadata.plugin_data.content
    content = json.loads(content)
    assert content["shape"] == [1, 2, 64, 64] and content["tokens"] == list(STORY[:64])
    assert content["window_note"] == (f"the text has {len(STORY)} tokens, more than fit in the "
                                      "context: these are its tokens 0..63")


@pytest.mark.slow
def test_inspect_true_writes_the_plugin_data_beside_the_images(tmp_path, tiny_model):
    tokenizer = CharTokenizer.train([STORY])
    model = tiny_model(tokenizer.vocab_size, n_layer=1, n_head=2)
    inspect_texts(model, tokenizer, ["Lily saw Tom. She ran."], tmp_path)
    ((tag, (content, weights)),) = stored_texts(tmp_path).items()
    assert tag == "inspect/step_00000000" and content["text"] == "Lily saw Tom. She ran."
    assert weights.shape == (1, 2, 22, 22)
    assert (tmp_path / "attention" / "layer_00" / "all_heads.png").is_file()


# ------------------------------------------------------------------------------- the backend


def test_an_empty_logdir_lists_no_texts_and_says_what_to_run(tmp_path):
    listing = in_process_app(tmp_path).get(f"{ROUTE}/texts").json
    assert listing == {"texts": [], "problems": [], "empty": HOW_TO_MAKE_DATA}
    assert "tinylm-train" in HOW_TO_MAKE_DATA and "inspect=true" in HOW_TO_MAKE_DATA


def test_older_data_is_named_by_run_and_tag_and_a_truncated_event_file_shows_its_whole_records(
        tmp_path, char_capture):
    capture = char_capture("Lily saw Tom. She ran.", n_layer=1, n_head=2, block_size=32)
    write_text(tmp_path / "good", "inspect", capture)
    old = attention_summary("inspect", capture, 0)
    content = json.loads(old.value[0].metadata.plugin_data.content)
    old.value[0].metadata.plugin_data.content = json.dumps({**content, "version": 0}).encode()
    writer = SummaryWriter(str(tmp_path / "old"))
    writer.file_writer.add_summary(old, 0)
    writer.close()
    writer = SummaryWriter(str(tmp_path / "cut"))
    bare = dataclasses.replace(capture, arithmetic=None)  # the attention is the last record
    write_attention(writer, "inspect", bare, 0)
    write_attention(writer, "inspect", bare, 1)
    writer.close()
    (event_file,) = (tmp_path / "cut").iterdir()
    event_file.write_bytes(event_file.read_bytes()[:-100])  # a crash in the middle of a record

    client = in_process_app(tmp_path)
    listing = client.get(f"{ROUTE}/texts").json
    # the data provider skips the record cut off: step 1 is missing, step 0 shows
    assert [(t["run"], t["name"], t["steps"]) for t in listing["texts"]] == [
        ("cut", "inspect", [{"step": 0, "tag": step_tag("inspect", 0)}]),
        ("good", "inspect", [{"step": 0, "tag": step_tag("inspect", 0)}])]
    (problem,) = listing["problems"]
    assert problem["run"] == "old" and problem["tag"] == "inspect/step_00000000"
    assert "format 0" in problem["message"]
    query = urllib.parse.urlencode({"run": "cut", "tag": step_tag("inspect", 0)})
    assert len(client.get(f"{ROUTE}/weights?{query}").data) == 2 * 2 * 22 * 22


def test_a_probe_report_is_served_from_its_summary_with_its_run(tmp_path):
    accuracy = np.array([[0.5, 0.25, 1.0], [0.0, 0.75, 0.125]])
    writer = SummaryWriter(str(tmp_path / "run" / "probe"))
    write_probe(writer, 72, accuracy)
    writer.close()
    # another probe's: three characters to choose from
    writer = SummaryWriter(str(tmp_path / "run" / "three"))
    write_probe(writer, 9, accuracy, chance=1 / 3, reads="attention from the pronoun to one of "
                "three characters")
    writer.close()
    # written before the summary said its chance: the two-character items' 0.5
    old = probe_summary(5, accuracy)
    old.value[0].metadata.plugin_data.content = json.dumps({"version": 1, "n": 5}).encode()
    writer = SummaryWriter(str(tmp_path / "old"))
    writer.file_writer.add_summary(old, 0)
    writer.close()
    assert in_process_app(tmp_path).get(f"{ROUTE}/probes").json == {"reports": [
        {"run": "old", "run_label": "old", "n": 5, "accuracy": accuracy.tolist(), "chance": 0.5,
         "reads": PROBE_READS},
        {"run": "run/probe", "run_label": "run/probe", "n": 72, "accuracy": accuracy.tolist(),
         "chance": 0.5, "reads": PROBE_READS},
        {"run": "run/three", "run_label": "run/three", "n": 9, "accuracy": accuracy.tolist(),
         "chance": 1 / 3, "reads": "attention from the pronoun to one of three characters"}],
        "problems": []}


def test_a_logdir_that_is_itself_a_run_is_named_by_its_folder_and_texts_by_their_sentence(
        tmp_path, char_capture):
    logdir = tmp_path / "run" / "probe" / "2026-12-01_07-48-40"  # tensorboard --logdir <that>
    writer = SummaryWriter(str(logdir))
    write_probe(writer, 72, np.full((2, 2), 0.5))
    write_attention(writer, "patching/pair_000",
                    char_capture("Lily went to the park. After a while, she", 1, 2, 64), 0)
    write_attention(writer, "probe_prompt", char_capture("Tom ran.  He\nfell.", 1, 2, 64), 10)
    writer.close()
    client = in_process_app(logdir)
    (report,) = client.get(f"{ROUTE}/probes").json["reports"]
    assert (report["run"], report["run_label"]) == (".", "probe/2026-12-01_07-48-40")
    texts = client.get(f"{ROUTE}/texts").json["texts"]
    assert [(t["run_label"], t["kind"], t["sentence"]) for t in texts] == [
        ("probe/2026-12-01_07-48-40", "probe", "Lily went to the park. After a while, she"),
        ("probe/2026-12-01_07-48-40", "training", "Tom ran. He fell.")]


def test_requests_can_name_only_tinylm_runs_never_a_path(tmp_path, char_capture):
    capture = char_capture("Lily saw Tom. She ran.", n_layer=1, n_head=2, block_size=32)
    write_text(tmp_path / "logs" / "run", "inspect", capture)
    secret = tmp_path / "secret"
    secret.mkdir()
    (secret / "probe.json").write_text(json.dumps(
        {"n": 1, "heads": [{"layer": 0, "head": 0, "accuracy": 0.5}]}))
    writer = SummaryWriter(str(secret))
    write_probe(writer, 1, np.full((1, 1), 0.5))
    writer.close()
    (tmp_path / "logs" / "run" / "probe").mkdir()
    os.symlink(secret / "probe.json", tmp_path / "logs" / "run" / "probe" / "probe.json")
    os.symlink(secret, tmp_path / "logs" / "linked")
    client = in_process_app(tmp_path / "logs")

    tag = urllib.parse.quote("inspect/step_00000000")
    assert client.get(f"{ROUTE}/weights?run=run&tag={tag}").status_code == 200
    for run in ("../secret", str(secret), "run/../../secret", "linked"):
        for route in ("weights", "attention"):
            response = client.get(f"{ROUTE}/{route}?run={urllib.parse.quote(run)}&tag={tag}")
            assert response.status_code == 404, (route, run)
    for path in ("../../secret/probe.json", "%2e%2e/%2e%2e/secret/probe.json", "index.js/.."):
        assert client.get(f"{ROUTE}/{path}").status_code == 404, path
    # a probe.json is never opened; the run folder linked out is listed as skipped, not served
    assert client.get(f"{ROUTE}/probes").json == {"reports": [], "problems": [{
        "run": "linked", "tag": PROBE_TAG,
        "message": f"{PROBE_TAG}: its folder resolves outside the logdir: not served"}]}


# ------------------------------------------------------------------------------- the browser


def tensorboard_get(base):
    """get(route): the plugin's JSON answer to a route of a running TensorBoard."""
    def get(route):
        with urllib.request.urlopen(f"{base}{ROUTE}/{route}", timeout=10) as response:
            return json.loads(response.read())
    return get


def wait_for(condition, timeout, what):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


LESSON = "Lily had a dog. It was happy. Tom saw her. She"  # a thing, a name of each gender


@pytest.fixture(scope="module")
def logdir(corpus, tmp_path_factory, char_capture):
    """A trained tiny run with a probe report (with activation patching) and an inspected text,
    a 128-token and a 512-token text, and a text of a model whose query heads share key/value
    heads in pairs."""
    root = tmp_path_factory.mktemp("tensorboard")
    train_dir = root / "train"
    train(run_config(corpus, train_dir, "model.block_size=64", "train.max_steps=20",
                     "train.probe_prompt='Lily and Tom went to the park. She'"))
    probes = root / "probes.jsonl"
    shipped = os.path.join(os.path.dirname(__file__), "..", "data", "probes")
    with open(os.path.join(shipped, "pronouns.jsonl")) as f, \
            open(os.path.join(shipped, "agreement.jsonl")) as g:
        probes.write_text("".join(f.readlines()[:8] + g.readlines()[:24]))
    with open(os.devnull, "w") as devnull:
        run_probe(ProbeConfig(checkpoint=str(train_dir), probe_file=str(probes), patch=True,
                              logdir=str(train_dir / "probe"), device="cpu"), out=devnull)
    checkpoint = load_checkpoint(train_dir)
    inspect_texts(checkpoint.model, checkpoint.tokenizer, [LESSON],
                  train_dir / "inspect" / "lesson")
    text = (STORY * 8)[:600]
    # the default model's shape: 4 layers x 4 heads over 128 tokens
    write_text(root / "default_shape", "inspect", char_capture(text, 4, 4, 128))
    # 6 layers x 8 heads over 512 tokens, from a text longer than that
    write_text(root / "wide", "inspect", char_capture(text, 6, 8, 512))
    # 2 layers x 4 heads, heads 0-1 reading key/value head 0 and heads 2-3 key/value head 1
    write_text(root / "grouped", "inspect",
               dataclasses.replace(char_capture(STORY, 2, 4, 64), kv_heads=[2, 2]))
    return root


@pytest.fixture(scope="module")
def server(logdir, tmp_path_factory):
    """`tensorboard --logdir <logdir>` as a user starts it; yields its base URL."""
    log = tmp_path_factory.mktemp("server") / "tensorboard.log"
    with tensorboard_server(logdir, log) as (process, base):
        def texts_loaded():
            assert process.poll() is None, log.read_text(errors="replace")
            try:
                with urllib.request.urlopen(f"{base}{ROUTE}/texts", timeout=10) as response:
                    runs = {t["run"] for t in json.loads(response.read())["texts"]}
            except (urllib.error.URLError, ConnectionError):
                return False
            return runs == {"train/tensorboard", "train/probe", "train/inspect/lesson",
                            "default_shape", "wide", "grouped"}

        wait_for(texts_loaded, STARTUP_TIMEOUT_S, "tensorboard to load the runs")
        yield base


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    """Headless Debian chromium through chromedriver."""
    from selenium import webdriver

    assert shutil.which("chromium") and shutil.which("chromedriver"), \
        "the browser test needs Debian's chromium: apt-get install -y chromium chromium-driver"
    options = webdriver.ChromeOptions()
    options.binary_location = shutil.which("chromium")
    for flag in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                 "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--window-size=1400,1000",
                 f"--user-data-dir={tmp_path_factory.mktemp('chromium')}"):
        options.add_argument(flag)
    service = webdriver.ChromeService(executable_path=shutil.which("chromedriver"))
    driver = webdriver.Chrome(options=options, service=service)
    try:
        yield driver
    finally:
        driver.quit()


def open_tab(browser, base):
    """Open TensorBoard on the tinylm tab and switch into the tab's iframe; first draw done."""
    from selenium.webdriver.common.by import By

    browser.switch_to.default_content()
    browser.get("about:blank")  # the same address again would not load the tab afresh
    browser.get(f"{base}/#{PLUGIN_NAME}")
    frame = wait_for(lambda: browser.find_elements(By.CSS_SELECTOR, "iframe"), 60, "the iframe")
    browser.switch_to.frame(frame[0])
    wait_for(lambda: browser.execute_script("return document.body.dataset.ready"), 30,
             "the tab's first draw")


def choose(browser, select_id, value):
    """Pick an option as a user would; returns once the tab has redrawn."""
    from selenium.webdriver.support.ui import Select

    Select(browser.find_element("id", select_id)).select_by_value(str(value))


def choose_text(browser, run, step=None, kind=None, pair=None):
    """Pick a text of a run (of a kind: inspect, training, probe), a step of it or a pair of its
    patching report; returns the ms the tab took to fetch and draw it."""
    def picked(select_id, value):
        if browser.find_element("id", select_id).get_attribute("value") == str(value):
            return 0  # shown already: picking it again changes nothing
        browser.execute_script("window.tinylmTiming.textLoadMs = null")
        choose(browser, select_id, value)
        return wait_for(lambda: browser.execute_script("return window.tinylmTiming.textLoadMs"),
                        30, f"the text of {run}")

    options = browser.execute_script("return [...document.querySelectorAll('#text-select "
                                     "option')].map(o => [o.dataset.run, o.dataset.kind])")
    ms = picked("text-select", next(i for i, (r, k) in enumerate(options)
                                    if r == run and kind in (None, k)))
    if pair is not None:
        ms = picked("pair-select", pair)
    if step is not None and browser.find_element("id", "step-select").get_attribute(
            "value") != str(step):
        ms = picked("step-select", step)
    return ms


def hover(browser, token):
    from selenium.webdriver.common.action_chains import ActionChains

    span = browser.find_element("css selector", f"#tokens .token[data-i='{token}']")
    ActionChains(browser).move_to_element(span).perform()


def shading(browser):
    """{token index: the weight the tab shades it with}."""
    return {int(i): float(w) for i, w in browser.execute_script(
        "return [...document.querySelectorAll('#tokens .token[data-weight]')]"
        ".map(s => [s.dataset.i, s.dataset.weight])")}


@pytest.mark.slow
def test_the_tab_shades_where_a_pronoun_looks_and_lists_its_antecedents(
        logdir, server, browser, tmp_path, capsys):
    open_tab(browser, server)
    stored = stored_texts(logdir / "train" / "tensorboard")
    last = max(stored, key=lambda tag: stored[tag][0]["step"])
    content, weights = stored[last]
    assert sorted(c["step"] for c, _ in stored.values()) == [10, 20]  # every evaluation

    choose_text(browser, "train/tensorboard", content["step"])
    choose(browser, "layer-select", 1)
    choose(browser, "head-select", 1)
    she = content["tokens"].index(" She") if " She" in content["tokens"] else next(
        i for i, w in enumerate(content["token_words"]) if w == content["pronouns"][0])
    hover(browser, she)

    # word level (the default): every token of an earlier word shaded by the word's total weight
    words = word_level(weights.astype(np.float64), content["token_words"], len(content["words"]))
    p = content["token_words"][she]
    expected = {t: words[1, 1, p, w] for t, w in enumerate(content["token_words"])
                if 0 <= w <= p}
    shaded = shading(browser)
    assert shaded.keys() == expected.keys()
    np.testing.assert_allclose([shaded[t] for t in expected], list(expected.values()), atol=2e-4)

    # the antecedent lists are inspection.read_pronouns' for this head, from the pronoun
    # ("resolving") and from the token before it ("deciding")
    capture = AttentionCapture(content["text"], list(range(len(content["tokens"]))),
                               content["tokens"], [(0, 0)] * len(content["tokens"]),
                               weights.astype(np.float32), find_words(content["text"]),
                               content["token_words"])
    (reading,) = [r for r in read_pronouns(capture) if r.word == p]
    for position, head_reading in reading.positions.items():
        listed = browser.execute_script(
            f"return [...document.querySelectorAll('ol[data-position={position}] li')]"
            ".map(li => [Number(li.dataset.word), Number(li.dataset.weight)])")
        top = head_reading.top[1][1]
        assert [w for w, _ in listed] == [w for w, _ in top], position
        np.testing.assert_allclose([v for _, v in listed], [v for _, v in top], atol=2e-4)
    assert reading.positions.keys() == {"resolving", "deciding"}
    browser.save_screenshot(str(tmp_path / "tinylm_attention.png"))

    # token level, and the reverse: which later tokens look at this one
    choose(browser, "level-select", "token")
    shaded = shading(browser)
    assert sorted(shaded) == list(range(she + 1))
    np.testing.assert_allclose([shaded[k] for k in range(she + 1)], weights[1, 1, she, :she + 1],
                               atol=2e-4)
    # click keeps the query; hovering another token then gives its exact weight and rank
    browser.find_element("css selector", f"#tokens .token[data-i='{she}']").click()
    hover(browser, 0)
    row = weights[1, 1, she, :she + 1].astype(np.float32)
    rank = 1 + int((row > row[0]).sum())
    assert browser.find_element("id", "status").text.endswith(
        f"(token 0): weight {row[0]:.4f}, rank {rank} of {she + 1} tokens")
    browser.find_element("css selector", f"#tokens .token[data-i='{she}']").click()  # let go

    browser.find_element("id", "reverse").click()
    hover(browser, 3)
    shaded = shading(browser)
    t = len(content["tokens"])
    assert sorted(shaded) == list(range(3, t))
    np.testing.assert_allclose([shaded[q] for q in range(3, t)], weights[1, 1, 3:, 3], atol=2e-4)

    # the probe report's grid: clicking a cell selects that head
    cell = browser.find_element("css selector", ".probe-grid td[data-layer='0'][data-head='1']")
    assert cell.text  # an accuracy
    cell.click()
    assert browser.find_element("id", "layer-select").get_attribute("value") == "0"
    assert browser.find_element("id", "head-select").get_attribute("value") == "1"
    assert (tmp_path / "tinylm_attention.png").stat().st_size > 10_000


@pytest.mark.slow
def test_the_tab_loads_a_128_token_text_in_under_a_second_and_redraws_512_tokens_fast(
        server, browser, capsys):
    open_tab(browser, server)
    first_text = browser.execute_script(
        "return document.querySelector('#text-select option').dataset.run")
    assert first_text == "default_shape"  # the page opened on the 128-token text
    page_ms = browser.execute_script("return window.tinylmTiming.firstDrawMs")
    choose_text(browser, "wide")
    text_ms = choose_text(browser, "default_shape")

    wide_ms = choose_text(browser, "wide")
    note = browser.find_element("id", "note").text
    assert "more than fit in the context: these are its tokens 0..511" in note
    redraws = {"head switch": [], "hover": [], "all heads": []}
    pronouns = browser.execute_script(
        "return [...document.querySelectorAll('#tokens .pronoun')].map(s => s.dataset.i)")
    for i in range(10):
        browser.execute_script(f"""
            const s = document.getElementById('head-select');
            s.value = '{i % 8}'; s.dispatchEvent(new Event('change'));""")
        redraws["head switch"].append(
            browser.execute_script("return window.tinylmTiming.redrawMs"))
        hover(browser, pronouns[-1 - i] if i % 2 else 500 - 40 * i)
        redraws["hover"].append(browser.execute_script("return window.tinylmTiming.redrawMs"))
    heads_hidden = "return document.getElementById('heads').hidden"
    assert browser.execute_script(heads_hidden)
    choose(browser, "head-select", "all")  # small multiples: one strip per head of the layer
    assert not browser.execute_script(heads_hidden)
    assert len(browser.find_elements("css selector", "#heads canvas")) == 8
    for i in range(5):
        hover(browser, 100 + 80 * i)
        redraws["all heads"].append(browser.execute_script("return window.tinylmTiming.redrawMs"))
    with capsys.disabled():
        print(f"\ntinylm attention tab, measured in Chromium with performance.now(): "
              f"page to first draw of the 128-token 16-head text {page_ms:.0f} ms; switching to "
              f"it {text_ms:.0f} ms; to the 512-token 48-head text {wide_ms:.0f} ms")
        for what, ms in redraws.items():
            print(f"  512 tokens, 48 heads, redraw on {what}: median {np.median(ms):.1f} ms, "
                  f"max {max(ms):.1f} ms over {len(ms)}")
    assert page_ms < 1000 and text_ms < 1000
    assert all(np.median(ms) < 100 for ms in redraws.values()), redraws


@pytest.mark.slow
def test_the_tab_labels_each_head_with_the_key_value_head_it_shares(server, browser):
    open_tab(browser, server)
    labels = "return [...document.querySelectorAll('#head-select option')].map(o => o.text)"
    choose_text(browser, "grouped")
    assert browser.execute_script(labels) == [
        "head 0 (KV 0)", "head 1 (KV 0)", "head 2 (KV 1)", "head 3 (KV 1)", "all heads"]
    assert browser.find_element("id", "note").text.endswith(  # after the window's note
        "Grouped-query attention, in every layer: heads 0-1 share key/value head 0, heads 2-3 "
        "share key/value head 1.")
    choose(browser, "head-select", "all")
    assert [row.text for row in browser.find_elements(
        "css selector", "#heads .head-row[data-head]")] == [
        "H0 (KV 0)", "H1 (KV 0)", "H2 (KV 1)", "H3 (KV 1)"]
    choose(browser, "head-select", 3)
    hover(browser, STORY.index("She"))  # the pronoun's panel: its lists and layer x head table
    assert browser.find_element("css selector", "#pronoun b").text == (
        "L0 H3 (KV 1) from the pronoun")
    assert [th.text for th in browser.find_elements("css selector", ".best-per-head th")][1:5] \
        == ["H0 (KV 0)", "H1 (KV 0)", "H2 (KV 1)", "H3 (KV 1)"]

    choose_text(browser, "default_shape")  # each head its own: labelled as before, no such note
    assert browser.execute_script(labels) == [*(f"head {h}" for h in range(4)), "all heads"]
    assert "key/value" not in browser.find_element("id", "note").text


# ------------------------------------------------------------------------ what a class sees

PERSON_PRONOUNS = {"he", "him", "his", "she", "her", "they", "them", "their"}
SHOTS_BYTES = 150_000  # each screenshot kept for docs/ stays under this


@pytest.fixture(scope="module")
def views_server(request, tmp_path_factory):
    """The tab the class views are taken on: over $TINYLM_TAB_LOGDIR where it is set (a trained
    run after tinylm-probe patch=true and inspect=true: scripts/tab_screenshots.py sets it to
    take docs/'s pictures), else the tiny trained run's (`server`)."""
    logdir = os.environ.get("TINYLM_TAB_LOGDIR")
    if not logdir:
        yield request.getfixturevalue("server")
        return
    log = tmp_path_factory.mktemp("views") / "tensorboard.log"
    with tensorboard_server(logdir, log) as (process, base):
        def loaded():
            assert process.poll() is None, log.read_text(errors="replace")
            try:
                get = urllib.request.urlopen
                with get(f"{base}{ROUTE}/texts", timeout=10) as texts, \
                        get(f"{base}{ROUTE}/patching", timeout=10) as patching:
                    return json.loads(texts.read())["texts"] and json.loads(
                        patching.read())["reports"]
            except (urllib.error.URLError, ConnectionError):
                return False

        wait_for(loaded, STARTUP_TIMEOUT_S, "tensorboard to load the lesson's logdir")
        time.sleep(2)  # the runs load one after another: let the last ones arrive
        yield base


def screenshot(browser, path):
    """The browser's window as a PNG of 256 colours (the tab has few: an octree keeps each
    legend's hues), small enough for docs/; once the arithmetic panel shows the weight asked."""
    wait_for(lambda: not browser.find_elements("css selector", "#arithmetic.stale"), 20,
             "the arithmetic panel")
    time.sleep(0.2)  # the last frame painted
    image = Image.open(io.BytesIO(browser.get_screenshot_as_png())).convert("RGB")
    image.quantize(colors=256, method=Image.Quantize.FASTOCTREE,
                   dither=Image.Dither.NONE).save(path, optimize=True)
    assert path.stat().st_size < SHOTS_BYTES, (path, path.stat().st_size)


def js(browser, script):
    """The value of a JavaScript expression in the tab."""
    return browser.execute_script(f"return {script.strip()}")


def legends(browser) -> dict:
    """{table class: (its legend's baseline, caption)} of every layer x head grid drawn, and the
    text's shading: each grid must be followed by a legend whose baseline is marked."""
    return {name: (baseline, caption) for name, baseline, caption in js(browser, """
        [...document.querySelectorAll('table.best-per-head, table.probe-grid, table.patch-grid, '
                                      + '#shading')].map((t) => {
          const legend = t.id === 'shading' ? t.querySelector('.legend') : t.nextElementSibling;
          const ok = legend && legend.classList.contains('legend');
          return [t.id || t.className, ok ? legend.querySelector('.baseline').textContent : null,
                  ok ? legend.querySelector('.legend-caption').textContent : null];
        })""")}


def option_labels(browser):
    return js(browser, "[...document.querySelectorAll('#text-select option')]"
                       ".map(o => [o.dataset.run, o.dataset.kind, o.text])")


def pronoun_words(browser) -> list[tuple[int, str]]:
    """(first token, word) of each underlined pronoun; the underline is under its letters only
    (" She" gets none under its space)."""
    underlined = js(browser, "[...document.querySelectorAll('#tokens .token.pronoun')].map(s => "
                             "[Number(s.dataset.i), s.querySelector('.word-part')?.textContent "
                             "?? s.textContent, s.textContent])")
    words, last = [], None
    for i, letters, whole in underlined:
        assert letters == whole.lstrip(), (letters, whole)
        if last is None or i != last + 1:
            words.append((i, ""))
        words[-1], last = (words[-1][0], words[-1][1] + whole), i
    return [(i, w.strip()) for i, w in words]


def tokens_shown(browser):
    return js(browser, "[...document.querySelectorAll('#tokens .token')].map(s => s.textContent)")


@pytest.mark.slow
def test_a_class_sees_every_view_named_with_its_legends_and_one_pair_picker(
        views_server, browser, tmp_path):
    """Each view a teacher projects, as a student must see it, screenshot by screenshot: the
    landing on the head the evidence singles out, a pronoun selected, all heads, the patching grid
    with a pair (one picker moving the text and the strip), the arithmetic behind one weight."""
    shots = Path(os.environ.get("TINYLM_TAB_SCREENSHOTS") or tmp_path)
    get = tensorboard_get(views_server)
    texts, patching = get("texts")["texts"], get("patching")["reports"]
    browser.set_window_size(1400, 1100)
    try:
        open_tab(browser, views_server)
        # every text named by what it holds: its sentence and who wrote it, never a tag or "."
        sentences = {(t["run"], t["kind"]): t["sentence"] for t in texts}
        labels = option_labels(browser)
        for run, kind, label in labels:
            assert "patching/pair_" not in label and " · probe_prompt" not in label, label
            if kind == "probe":
                (report,) = [r for r in patching if r["run"] == run]
                assert label.startswith(f'"{report["pairs"][0]["text"]}" (probe pair 1 of '
                                        f'{len(report["pairs"])})'), label
            else:
                assert label.startswith(f'"{sentences[run, kind]}" ('), label
                assert "(training sample, step " in label if kind == "training" else \
                    "(inspected)" in label
        assert labels[0][1] == "inspect" and {kind for _, kind, _ in labels} == {
            "inspect", "training", "probe"}
        assert js(browser, "document.getElementById('step-select').selectedOptions[0].text") \
            == "inspected"

        # the landing: an inspected text, on the head the evidence singles out, saying why: the
        # largest patching effect where the text's model has a report, else the head that looks
        # most at a name from the first pronoun
        def opened_on():
            layer, head = (int(js(browser, f"document.getElementById('{s}').value"))
                           for s in ("layer-select", "head-select"))
            why = browser.find_element("id", "head-why").text
            assert why.startswith(f"Opened on layer {layer} head {head}: the head "), why
            return layer, head, why

        layer, head, why = opened_on()
        assert "patching carries the most" in why or "looks most at a name from" in why, why
        (report,) = [r for r in patching if r["run"] == labels[-1][0]]
        def model_root(run):  # as the tab reads it: the run directory
            return re.sub(r"(^|/)(tensorboard|inspect(/[^/]+)?|probe(/[^/]+)?)$", "", run)

        lesson = next(run for run, kind, _ in labels
                      if kind == "inspect" and model_root(run) == model_root(report["run"]))
        if lesson != labels[0][0]:  # the text of the probed model
            choose_text(browser, lesson, kind="inspect")
            layer, head, why = opened_on()
        effects = np.array(report["effect"], dtype=float)
        if np.nanmax(effects) > 0:  # a head carries some of the name's effect
            assert "the head whose patching carries the most of the name's effect" in why, why
            assert effects[layer, head] == np.nanmax(effects)
        else:
            assert "the head that looks most at a name from" in why, why
        query = js(browser, "[...document.querySelectorAll('#tokens .token.query')]"
                            ".map(s => s.textContent)")
        assert "".join(query).strip().lower() in PERSON_PRONOUNS
        # the pronouns read against names are underlined, under their letters only (" She"
        # gets no line under its space); "it" and "its" are not
        pronouns = pronoun_words(browser)
        assert pronouns and all(w.lower() in PERSON_PRONOUNS for _, w in pronouns), pronouns
        drawn = legends(browser)
        assert drawn.keys() == {"shading", "best-per-head", "probe-grid", "patch-grid"}, drawn
        assert drawn["probe-grid"][0] == "chance 0.50" and "Chance: 0.50" in drawn["probe-grid"][1]
        assert drawn["patch-grid"][0] == "0: none"
        for name in ("shading", "best-per-head"):
            assert drawn[name][0].startswith("uniform: 1/"), drawn[name]
        probe_note = browser.find_element("css selector", ".probe p").text
        assert "reads attention from the pronoun itself" in probe_note
        screenshot(browser, shots / "tab-landing.png")

        # the type size, for a projector: kept when the tab is opened again
        choose(browser, "zoom-select", "1.5")
        open_tab(browser, views_server)
        assert js(browser, "[document.body.style.zoom, document.getElementById('zoom-select')"
                           ".value]") == ["1.5", "1.5"]
        choose(browser, "zoom-select", "1")
        choose_text(browser, lesson, kind="inspect")

        # "it" is no pronoun of a name; "She" is, and its readings flag the other gender (on the
        # inspected text that has an "It", where there is one)
        with_it = [run for (run, kind), sentence in sentences.items()
                   if kind == "inspect" and " It " in sentence]
        if with_it and with_it[0] != lesson:
            choose_text(browser, with_it[0], kind="inspect")
        words = tokens_shown(browser)
        thing = browser.find_elements("css selector", "#tokens .token.thing-pronoun")
        if thing:  # "It": hovered, it is read against no name
            hover(browser, int(thing[0].get_attribute("data-i")))
            assert "stands for a thing or an animal" in browser.find_element("id", "pronoun").text
        she, she_word = next((i, w) for i, w in pronoun_words(browser)
                             if w.lower() in ("she", "he"))
        browser.find_element("css selector", f"#tokens .token[data-i='{she}']").click()
        hover(browser, 0)
        assert ": weight " in browser.find_element("id", "status").text
        flagged = js(browser, "[...document.querySelectorAll('#pronoun .other-gender')]"
                              ".map(e => e.textContent)")
        for word in flagged:  # only names of the other gender than the pronoun
            assert word.endswith(" ≠") and (word[:-2] in MALE_NAMES if she_word.lower() == "she"
                                            else word[:-2] in FEMALE_NAMES), word
        screenshot(browser, shots / "tab-pronoun.png")
        browser.find_element("css selector", f"#tokens .token[data-i='{she}']").click()

        # all heads: each head a strip in its colour, every token labelled above them
        choose(browser, "head-select", "all")
        strip_labels = js(browser, "[...document.querySelectorAll('#heads .head-labels span')]"
                                   ".map(s => s.textContent)")
        assert len(strip_labels) == len(words)
        assert all(label.rstrip("…") in word.replace("\n", "⏎") or label.startswith('"')
                   for label, word in zip(strip_labels, words, strict=True))
        n_head = len(browser.find_elements("css selector", "#heads canvas"))
        assert len(browser.find_elements("css selector", ".head-swatches .swatch")) == n_head
        screenshot(browser, shots / "tab-all-heads.png")

        # the patching grid with a pair: one picker moves the attention's text and the strip
        choose(browser, "head-select", head)
        choose_text(browser, report["run"], kind="probe", pair=1)
        pair = report["pairs"][1]
        assert js(browser, "document.getElementById('text-select').selectedOptions[0].text") \
            .startswith(f'"{pair["text"]}" (probe pair 2 of {len(report["pairs"])})')
        assert not browser.find_element("id", "step-select").is_displayed()

        def both_views():
            strip = "".join(js(browser, "[...document.querySelectorAll('#patch-strip "
                                        ".patch-token')].map(s => s.dataset.token)"))
            return "".join(tokens_shown(browser)), strip

        text, strip = both_views()
        assert strip and text.replace("⏎", "").startswith(strip), (text, strip)
        values = js(browser, "[...document.querySelectorAll('#patch-strip .patch-value')]"
                             ".map(s => s.textContent)")
        assert len(values) == js(browser, "document.querySelectorAll('#patch-strip "
                                          ".patch-token').length")  # written, not hovered
        assert legends(browser)["patch-grid"][0] == "0: none"
        # the deciding token (often "," or ".") in a box as wide as a short word's
        assert js(browser, "document.querySelector('#patch-strip .deciding').offsetWidth") >= 30
        screenshot(browser, shots / "tab-patching.png")
        # the accuracy grid around its chance, under the patching grid (the arithmetic folded)
        js(browser, "document.getElementById('arithmetic-panel').open = false")
        js(browser, "window.scrollTo(0, document.querySelector('.probe')"
                    ".getBoundingClientRect().top + window.scrollY - 560)")
        screenshot(browser, shots / "tab-chance.png")
        js(browser, "document.getElementById('arithmetic-panel').open = true")
        js(browser, "window.scrollTo(0, 0)")
        choose(browser, "pair-select", 0)
        wait_for(lambda: both_views() != (text, strip), 10, "pair 1 in both views")
        text0, strip0 = both_views()
        assert text0.replace("⏎", "").startswith(strip0)
        if len(report["pairs"]) > 8:  # tinylm-probe writes the attention of 8 pairs: the strip
            choose(browser, "pair-select", len(report["pairs"]) - 1)
            wait_for(lambda: not tokens_shown(browser), 10, "a pair without attention")
            assert "has its patching effects only" in browser.find_element("id", "note").text

        # the arithmetic behind one weight, below the attention: the model's own weight
        if js(browser, "window.tinylmArithmetic === undefined"):
            return
        choose_text(browser, lesson, kind="inspect")
        choose(browser, "head-select", head)
        choose(browser, "level-select", "token")
        query = next(i for i, w in pronoun_words(browser) if w.lower() in ("she", "he"))
        browser.find_element("css selector", f"#tokens .token[data-i='{query}']").click()
        wait_for(lambda: f"(token {query})" in js(
            browser, "document.querySelector('#arithmetic h4')?.textContent ?? ''"), 20,
            "the arithmetic of the pronoun")
        check = browser.find_elements("id", "arith-check")
        top = int(js(browser, "document.querySelector('#arithmetic tr.arith-top').dataset.j"))
        model_weight = float(check[0].get_attribute("data-model-weight"))
        assert abs(float(check[0].get_attribute("data-weight")) - model_weight) < 1e-5
        shaded = float(js(browser, f"document.querySelector('#tokens .token[data-i=\"{top}\"]')"
                                   ".dataset.weight"))
        assert abs(shaded - model_weight) < 2e-3  # the tab's float16 weight, the same one
        js(browser, "window.scrollTo(0, document.getElementById('arithmetic-panel')"
                    ".getBoundingClientRect().top + window.scrollY - 120)")
        screenshot(browser, shots / "tab-arithmetic.png")
    finally:
        browser.set_window_size(1400, 1000)
        browser.switch_to.default_content()
