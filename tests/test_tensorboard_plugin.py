"""The "tinylm attention" TensorBoard tab: the data training and inspection write, the backend
that serves it (and nothing else), and the tab itself in headless Chromium against a real
tensorboard server.
"""

import json
import os
import shutil
import time
import urllib.error
import urllib.parse
import urllib.request

import numpy as np
import pytest
from helpers import STARTUP_TIMEOUT_S, run_config, tensorboard_server
from tensorboard.backend import application
from tensorboard.backend.event_processing import data_provider as tb_data_provider
from tensorboard.backend.event_processing import plugin_event_multiplexer
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.plugins import base_plugin
from tensorboard.util import tensor_util
from torch.utils.tensorboard import SummaryWriter
from werkzeug.test import Client

from tinylm.cli.probe import ProbeConfig, run_probe
from tinylm.inspection.capture import (
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
    PROBE_TAG,
    attention_summary,
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
    write_attention(writer, "inspect", capture, 0)
    write_attention(writer, "inspect", capture, 1)
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
    assert in_process_app(tmp_path).get(f"{ROUTE}/probes").json == {
        "reports": [{"run": "run/probe", "n": 72, "accuracy": accuracy.tolist()}],
        "problems": []}


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


def wait_for(condition, timeout, what):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.fixture(scope="module")
def logdir(corpus, tmp_path_factory, char_capture):
    """A trained tiny run with a probe report, a 128-token and a 512-token text."""
    root = tmp_path_factory.mktemp("tensorboard")
    train_dir = root / "train"
    train(run_config(corpus, train_dir, "model.block_size=64", "train.max_steps=20",
                     "train.probe_prompt='Lily and Tom went to the park. She'"))
    probes = root / "probes.jsonl"
    with open(os.path.join(os.path.dirname(__file__), "..", "data", "probes",
                           "pronouns.jsonl")) as f:
        probes.write_text("".join(f.readlines()[:8]))
    run_probe(ProbeConfig(checkpoint=str(train_dir), probe_file=str(probes),
                          logdir=str(train_dir / "probe"), device="cpu"), out=open(os.devnull, "w"))
    text = (STORY * 8)[:600]
    # the default model's shape: 4 layers x 4 heads over 128 tokens
    write_text(root / "default_shape", "inspect", char_capture(text, 4, 4, 128))
    # 6 layers x 8 heads over 512 tokens, from a text longer than that
    write_text(root / "wide", "inspect", char_capture(text, 6, 8, 512))
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
            return runs == {"train/tensorboard", "default_shape", "wide"}

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
    browser.get(f"{base}/#{PLUGIN_NAME}")
    frame = wait_for(lambda: browser.find_elements(By.CSS_SELECTOR, "iframe"), 60, "the iframe")
    browser.switch_to.frame(frame[0])
    wait_for(lambda: browser.execute_script("return document.body.dataset.ready"), 30,
             "the tab's first draw")


def choose(browser, select_id, value):
    """Pick an option as a user would; returns once the tab has redrawn."""
    from selenium.webdriver.support.ui import Select

    Select(browser.find_element("id", select_id)).select_by_value(str(value))


def choose_text(browser, run, step=None):
    """Pick a text (and a step of it); returns the ms the tab took to fetch and draw it."""
    def picked(select_id, value):
        browser.execute_script("window.tinylmTiming.textLoadMs = null")
        choose(browser, select_id, value)
        return wait_for(lambda: browser.execute_script("return window.tinylmTiming.textLoadMs"),
                        30, f"the text of {run}")

    options = browser.execute_script(
        "return [...document.querySelectorAll('#text-select option')].map(o => o.text)")
    ms = picked("text-select", next(i for i, label in enumerate(options)
                                    if label.startswith(f"{run} ·")))
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
        "return document.querySelector('#text-select option').text")
    assert first_text == "default_shape · inspect"  # the page opened on the 128-token text
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
