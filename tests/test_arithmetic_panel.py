"""The arithmetic behind one weight, in the tab (tensorboard_plugin/arithmetic.py and
static/arithmetic.js): for a head and a query token, the explainer's steps on the model's own q, k
and v, the weight recomputed equal to the one its forward pass gave, on the trained default run,
on a random Llama (rotary positions, grouped-query heads) and on a GPT-Neo local layer (unscaled,
banded); the route serves only runs inside the logdir, bounded, in strict JSON; and the panel drawn
in headless Chromium, its screenshot saved as docs/arithmetic-panel.png.
"""

import json
import math
import os
import shutil
import threading
import urllib.parse
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import test_tensorboard_plugin as tab
import torch
from helpers import STARTUP_TIMEOUT_S, save_llama_folder, tensorboard_server
from tensorboard.backend import application
from tensorboard.backend.event_processing import data_provider as tb_data_provider
from tensorboard.backend.event_processing import plugin_event_multiplexer
from tensorboard.plugins import base_plugin
from torch.utils.tensorboard import SummaryWriter
from werkzeug import wrappers
from werkzeug.test import Client

from tinylm.checkpoint import load_checkpoint
from tinylm.files import project_root
from tinylm.inspection.capture import capture_attention
from tinylm.inspection.head_numbers import MAX_STORED, capture_arithmetic, layer_numbers
from tinylm.inspection.tensorboard_plugin import ARITHMETIC_PLUGIN_NAME, PLUGIN_NAME
from tinylm.inspection.tensorboard_plugin.plugin import AttentionPlugin
from tinylm.inspection.tensorboard_plugin.summary import (
    arithmetic_summary,
    attention_summary,
    qkv_tag,
    step_tag,
    write_attention,
)
from tinylm.inspection.walkthrough import model_head_steps
from tinylm.pretrained import build, load_pretrained
from tinylm.pretrained.gpt_neo import GPTNeoConfig

ROUTE = f"/data/plugin/{PLUGIN_NAME}"
DEFAULT_RUN = Path("/work/runs/default")  # the README's trained run, where this machine has one
PROMPT = "Lily and Tom went to the park. She"
NEO_TEXT = "Lily and Tom went to the park. She saw a big dog and it ran to her."
WINDOW = 4
TAG = step_tag("inspect", 0)
SCREENSHOT = project_root() / "docs" / "arithmetic-panel.png"
browser = tab.browser  # the headless Chromium of the tab's own tests


def strict(text: str):
    """JSON as the browser reads it: NaN and infinities refused."""
    def refuse(constant):
        raise ValueError(f"{constant} is not JSON")
    return json.loads(text, parse_constant=refuse)


def write_text(directory, capture, step=0):
    """A text's attention for the tab, and the q, k and v the capture holds for the panel."""
    writer = SummaryWriter(str(directory))
    write_attention(writer, "inspect", capture, step)
    writer.close()


class PanelPlugin(AttentionPlugin):
    """The tab's plugin with a bare page that loads the panel's script, for the browser."""

    def get_plugin_apps(self):
        return {**super().get_plugin_apps(), "/panel.html": page}


@wrappers.Request.application
def page(request):
    return wrappers.Response('<!doctype html><meta charset="utf-8"><body style="margin: 12px">'
                             '<div id="panel"></div><script src="arithmetic.js"></script>',
                             mimetype="text/html")


def panel_app(logdir):
    multiplexer = plugin_event_multiplexer.EventMultiplexer(
        tensor_size_guidance={PLUGIN_NAME: 0, ARITHMETIC_PLUGIN_NAME: 0})
    multiplexer.AddRunsFromDirectory(str(logdir))
    multiplexer.Reload()
    provider = tb_data_provider.MultiplexerDataProvider(multiplexer, str(logdir))
    plugin = PanelPlugin(base_plugin.TBContext(logdir=str(logdir), data_provider=provider))
    return application.TensorBoardWSGI([plugin], data_provider=provider)


def ask(client, run="default", tag=TAG, **args):
    """The route's answer (status, JSON read strictly) for one head and query."""
    response = client.get(f"{ROUTE}/arithmetic?" + urllib.parse.urlencode(
        {"run": run, "tag": tag, **args}))
    return response.status_code, strict(response.get_data(as_text=True))


# ------------------------------------------------------------------------------- the models


@pytest.fixture(scope="module")
def trained(tmp_path_factory, request):
    """(model, tokenizer) of the README's trained default run, read from a copy of its last
    checkpoint; where this machine has none, the session's tiny trained run."""
    last = DEFAULT_RUN / "checkpoints" / "last"
    if last.is_file():
        step = DEFAULT_RUN / "checkpoints" / last.read_text().strip()
        source = shutil.copytree(step, tmp_path_factory.mktemp("default") / step.name)
    else:
        source = request.getfixturevalue("trained_run")[0]
    checkpoint = load_checkpoint(source)
    return checkpoint.model.eval(), checkpoint.tokenizer


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """(model, tokenizer, transformers' model) of a random Llama: rotary positions with Llama 3's
    scaling, 4 query heads sharing 2 key/value heads."""
    folder = tmp_path_factory.mktemp("llama")
    reference = save_llama_folder(folder, "llama-gqa-llama3")
    model, tokenizer, _ = load_pretrained(folder)
    return model.eval(), tokenizer, reference


@pytest.fixture(scope="module")
def neo(bpe):
    """A random GPT-Neo (unscaled q·k, as GPT-Neo folders load) whose second layer is local: each
    token sees the last WINDOW positions."""
    torch.manual_seed(0)
    model = build(GPTNeoConfig(vocab_size=bpe.vocab_size, block_size=64, n_layer=2, n_head=2,
                               n_embd=16, attention_layers=["global", "local"],
                               window_size=WINDOW, attention_scale=False))
    with torch.no_grad():  # wider than at init, so that the weights differ from uniform
        for p in model.parameters():
            p.normal_(0.0, 0.5)
    return model.eval()


@pytest.fixture(scope="module")
def logdir(tmp_path_factory, trained, llama, neo, bpe):
    """default/: the trained run on the prompt; llama/ and neo/: their texts; budget/: the
    trained model's text with its q, k, v kept for its first 2 layers only."""
    root = tmp_path_factory.mktemp("arithmetic")
    model, tokenizer = trained
    write_text(root / "default", capture_attention(model, tokenizer, PROMPT))
    llama_model, llama_tokenizer, _ = llama
    write_text(root / "llama", capture_attention(llama_model, llama_tokenizer, PROMPT))
    write_text(root / "neo", capture_attention(neo, bpe, NEO_TEXT))
    capture = capture_attention(model, tokenizer, PROMPT)
    c = model.config
    per_layer = layer_numbers(c.n_head, c.n_head, c.n_embd // c.n_head, len(capture.ids))
    capture.arithmetic = capture_arithmetic(model, capture.ids, budget=2 * per_layer + 1)
    write_text(root / "budget", capture)
    return root


@pytest.fixture(scope="module")
def client(logdir):
    return Client(panel_app(logdir))


def picked(model) -> tuple[int, int]:
    """The head the panel is shown on: L2H2 of the default run, the one every causal reading of
    the issue picks (the last layer and head of a smaller model)."""
    return min(2, model.config.n_layer - 1), min(2, model.config.n_head - 1)


# ------------------------------------------------------------------------------- the numbers


def test_every_head_of_the_trained_run_gives_its_own_weights_back(client, trained):
    model, tokenizer = trained
    ids = tokenizer.encode(PROMPT)
    she = len(ids) - 1
    c = model.config
    for layer in range(c.n_layer):
        for head in range(c.n_head):
            # the console's arithmetic (tinylm-explain), from the same hook points
            explained = model_head_steps(model, torch.tensor(ids), layer, head)
            for query in range(len(ids)) if (layer, head) == picked(model) else [she]:
                status, a = ask(client, layer=layer, head=head, query=query)
                assert status == 200, a
                assert a["max_difference"] <= 1e-6, (layer, head, query, a["max_difference"])
                keys = a["keys"]
                assert [k["j"] for k in keys] == list(range(query + 1))
                assert a["later_hidden"] == len(ids) - 1 - query
                steps = explained.steps
                for step, column in (("scores", "qk"), ("scaled", "scaled"),
                                     ("shifted", "shifted"), ("exps", "exp"),
                                     ("weights", "weight")):
                    np.testing.assert_allclose([k[column] for k in keys],
                                               getattr(steps, step)[query, :query + 1],
                                               atol=2e-5, rtol=1e-5, err_msg=step)
                np.testing.assert_allclose([k["model_weight"] for k in keys],
                                           explained.weights[query, :query + 1], atol=1e-7)
                assert math.isclose(a["weight_sum"], 1.0, abs_tol=1e-6)
                # the value terms: weight_j · v_j, summed the head's output
                v = explained.v[:query + 1, :a["value_dims"]].numpy()
                np.testing.assert_allclose([k["value"] for k in keys], v, atol=1e-6)
                np.testing.assert_allclose([k["term"] for k in keys],
                                           v * np.array([k["weight"] for k in keys])[:, None],
                                           atol=1e-6)
                np.testing.assert_allclose(a["output"], steps.output[query, :a["value_dims"]],
                                           atol=1e-5)
    layer, head = picked(model)
    status, a = ask(client, layer=layer, head=head, query=she)
    assert a["query_token"] == " She" and a["keys"][0]["token"] == "Lily"
    assert (a["architecture"], a["scale"], a["rotary"], a["window"], a["kv_shared_by"]) == (
        "tinylm", None, False, None, None)
    hs = c.n_embd // c.n_head
    assert a["scale_step"] == f"divided by √d (d = {hs}, √d = {math.sqrt(hs):.4f})"
    assert a["scale_said"] == ""


def test_a_llama_head_uses_its_rotated_q_and_k_and_the_key_value_head_it_shares(client, llama):
    model, tokenizer, reference = llama
    ids = tokenizer.encode(PROMPT)
    with torch.no_grad():  # transformers' own forward pass: weights we did not compute
        theirs = reference(torch.tensor([ids]), output_attentions=True).attentions
    query = len(ids) - 1
    values = {}
    for layer in range(2):
        for head in range(4):
            status, a = ask(client, run="llama", layer=layer, head=head, query=query)
            assert status == 200, a
            assert a["max_difference"] <= 1e-6
            assert (a["rotary"], a["n_kv_head"], a["kv_head"]) == (True, 2, head // 2)
            assert a["kv_shared_by"] == [2 * (head // 2), 2 * (head // 2) + 1]
            np.testing.assert_allclose([k["weight"] for k in a["keys"]],
                                       theirs[layer][0, head, query, :query + 1], atol=1e-5)
            explained = model_head_steps(model, torch.tensor(ids), layer, head)
            np.testing.assert_allclose([k["qk"] for k in a["keys"]],
                                       explained.steps.scores[query, :query + 1], rtol=1e-5,
                                       atol=1e-5)
            values[layer, head] = [k["value"] for k in a["keys"]]
    # heads 0 and 1 read key/value head 0, heads 2 and 3 key/value head 1
    assert values[0, 0] == values[0, 1] and values[0, 2] == values[0, 3]
    assert values[0, 0] != values[0, 2]


def test_a_gpt_neo_local_layer_masks_the_keys_outside_its_window_and_is_unscaled(
        client, neo, bpe):
    ids = bpe.encode(NEO_TEXT)
    query = len(ids) - 1
    assert query + 1 > 2 * WINDOW
    status, local = ask(client, run="neo", layer=1, head=0, query=query)
    assert status == 200, local
    assert local["window"] == WINDOW and local["masked_keys"] == query + 1 - WINDOW
    assert local["scale"] == 1.0 and local["scale_said"] == (
        "scale 1.0 (GPT-Neo: unscaled): q·k is not divided by √d")
    for key in local["keys"]:
        hidden = key["j"] <= query - WINDOW
        assert (key["masked"] == "masked") == hidden, key
        if hidden:
            assert key["shifted"] is None and key["exp"] == key["weight"] == 0
            assert key["model_weight"] == 0
        else:
            assert key["scaled"] == pytest.approx(key["qk"], rel=1e-6)  # ×1.0
    assert local["max_difference"] <= 1e-6
    status, full = ask(client, run="neo", layer=0, head=1, query=query)
    assert full["window"] is None and full["masked_keys"] == 0
    assert full["max_difference"] <= 1e-6 and all(k["weight"] > 0 for k in full["keys"])


def test_the_layers_kept_fit_the_budget_and_the_others_are_named(client, trained):
    model, tokenizer = trained
    numbers = capture_arithmetic(model, tokenizer.encode(PROMPT))
    assert [layer.layer for layer in numbers.layers] == list(range(model.config.n_layer))
    assert numbers.not_stored == "" and numbers.size <= MAX_STORED
    summary = arithmetic_summary("inspect", 0, numbers).value[0]
    assert summary.tag == qkv_tag(TAG) == "qkv/inspect/step_00000000"
    assert summary.metadata.plugin_data.plugin_name == ARITHMETIC_PLUGIN_NAME != PLUGIN_NAME
    c = model.config
    full = capture_arithmetic(model, list(range(c.block_size)))  # the model's whole context
    assert len(full.layers) == c.n_layer and full.size == c.n_layer * layer_numbers(
        c.n_head, c.n_head, c.n_embd // c.n_head, c.block_size)

    # the budget run kept 2 layers of the text's
    status, a = ask(client, run="budget", layer=1, head=1, query=3)
    assert status == 200 and a["max_difference"] <= 1e-6
    if c.n_layer > 2:
        status, a = ask(client, run="budget", layer=2, head=0, query=3)
        assert status == 200 and a["problem"]["message"].startswith(
            f"{TAG}: layer 2's q, k and v were not kept: layer 2 and later do not fit in the ")


def test_inspect_true_writes_the_numbers_beside_the_attention_once_wired_in(tmp_path, trained):
    """capture_attention records the q, k, v and write_attention writes them: then training's
    evaluations, inspect=true and tinylm-probe's texts all carry them."""
    from tinylm.inspection.report import inspect_texts

    model, tokenizer = trained
    if getattr(capture_attention(model, tokenizer, PROMPT), "arithmetic", None) is None:
        pytest.skip("capture_attention does not record the q, k and v yet")
    inspect_texts(model, tokenizer, [PROMPT], tmp_path / "run")
    status, a = ask(Client(panel_app(tmp_path)), run="run", layer=0, head=0, query=3)
    assert status == 200 and a["max_difference"] <= 1e-6


# ------------------------------------------------------------------------------- the route


def test_the_route_serves_only_runs_inside_the_logdir(tmp_path, trained):
    model, tokenizer = trained
    capture = capture_attention(model, tokenizer, PROMPT)
    logs, secret = tmp_path / "logs", tmp_path / "secret"
    write_text(logs / "run", capture)
    write_text(secret, capture)
    os.symlink(secret, logs / "linked")  # a run folder inside that resolves outside
    client = Client(panel_app(logs))
    status, a = ask(client, run="run", layer=0, head=0, query=2)
    assert status == 200 and a["max_difference"] <= 1e-6
    for run in ("../secret", str(secret), "run/../../secret", "./../secret"):
        status, a = ask(client, run=run, layer=0, head=0, query=2)
        assert status == 404 and a == {"error": "no such run and tag"}, run
    status, a = ask(client, run="linked", layer=0, head=0, query=2)
    assert a == {"problem": {"run": "linked", "tag": TAG, "message":
                             f"{TAG}: its folder resolves outside the logdir: not served"}}
    for path in ("arithmetic/../../secret", "%2e%2e/secret/arithmetic"):
        assert client.get(f"{ROUTE}/{path}").status_code == 404, path


def test_a_malformed_request_or_a_missing_text_is_refused_in_words(client, trained):
    t = len(trained[1].encode(PROMPT))
    for args in ({"layer": "x", "head": 0, "query": 0}, {"layer": -1, "head": 0, "query": 0},
                 {"layer": "1e3", "head": 0, "query": 0}, {"layer": 0, "head": 0},
                 {"layer": 0, "head": 0, "query": "9" * 7}):
        status, a = ask(client, **args)
        assert status == 400 and "whole numbers" in a["error"], args
    c = trained[0].config
    status, a = ask(client, layer=0, head=0, query=t)
    assert status == 400 and a["error"] == (f"no layer 0, head 0, query {t}: the text has "
                                            f"{c.n_layer} layers x {c.n_head} heads over {t} "
                                            "tokens")
    status, a = ask(client, tag="inspect/step_00000001", layer=0, head=0, query=0)
    assert status == 404
    # text= and step= name the same text as its tag
    by_name = client.get(f"{ROUTE}/arithmetic?run=default&text=inspect&step=0&layer=1&head=1"
                         "&query=2")
    assert strict(by_name.get_data(as_text=True)) == ask(client, layer=1, head=1, query=2)[1]


def write_run(directory, summaries):
    writer = SummaryWriter(str(directory))
    for summary in summaries:
        writer.file_writer.add_summary(summary, 0)
    writer.close()


def crafted_run(root, name, capture, numbers, description=None, flat=None):
    """A run whose text is whole and whose q, k, v summary has its description (a function of
    the written one) or its numbers replaced."""
    summary = arithmetic_summary("inspect", 0, numbers)
    value = summary.value[0]
    if description is not None:
        value.metadata.plugin_data.content = json.dumps(
            description(json.loads(value.metadata.plugin_data.content))).encode()
    if flat is not None:
        value.tensor.tensor_content = flat.astype("<f4").tobytes()
        value.tensor.tensor_shape.dim[0].size = flat.size
    write_run(root / name, [attention_summary("inspect", capture, 0), summary])


def test_crafted_numbers_are_refused_saying_why_and_overflows_are_null(tmp_path, trained):
    model, tokenizer = trained
    capture = capture_attention(model, tokenizer, PROMPT)
    capture.arithmetic = None
    numbers = capture_arithmetic(model, capture.ids)
    flat = np.concatenate([layer.flat for layer in numbers.layers])
    with_nan, huge = flat.copy(), flat.copy()
    with_nan[5] = np.nan
    huge[: model.config.n_embd * len(capture.ids)] = 3e38  # layer 0's q: finite; q·k is not
    cases = {
        "old_format": ({"description": lambda c: {**c, "version": 0}},
                       "written in a tinylm arithmetic summary format 0"),
        "other_shape": ({"description": lambda c: {**c, "tokens": 3}},
                        "its q, k and v are not of the text's "),
        "far_head_size": ({"description": lambda c: {**c, "head_size": 10**9}},
                          "its head size is not 1..1024"),
        "twice": ({"description": lambda c: {**c, "layers": [c["layers"][0]] * 2}},
                  "its layers are not layer numbers, each once, in order"),
        "odd_kv": ({"description": lambda c: {**c, "layers": [{**c["layers"][0],
                                                               "n_kv_head": 3}]}},
                   "layer 0's key/value heads do not divide its "),
        "nan_scale": ({"description": lambda c: {**c, "layers": [{**c["layers"][0],
                                                                  "scale": "x" * 10**5}]}},
                      "layer 0's scale is not a finite number"),
        "short": ({"flat": flat[:-1]}, f"its q, k and v are not {flat.size} numbers"),
        "nan": ({"flat": with_nan}, "its q, k and v hold NaN or infinite numbers"),
    }
    for name, (change, _) in cases.items():
        crafted_run(tmp_path, name, capture, numbers, **change)
    crafted_run(tmp_path, "huge", capture, numbers, flat=huge)
    write_run(tmp_path / "without", [attention_summary("inspect", capture, 0)])  # no q, k, v
    client = Client(panel_app(tmp_path))
    for name, (_, why) in cases.items():
        status, a = ask(client, run=name, layer=0, head=0, query=2)
        assert status == 200 and a["problem"]["message"].startswith(f"{TAG}: {why}"), (name, a)
    status, a = ask(client, run="without", layer=0, head=0, query=2)
    assert a["problem"]["message"].startswith(f"{TAG}: no q, k and v were written")
    status, a = ask(client, run="huge", layer=0, head=0, query=2)  # strict JSON: nulls
    assert status == 200 and a["keys"][0]["qk"] is None and a["max_difference"] is None


# ------------------------------------------------------------------------------- the browser


@pytest.fixture(scope="module")
def panel_server(logdir):
    """The plugin's routes and a page loading arithmetic.js, over HTTP: the panel's base URL."""
    from werkzeug.serving import make_server

    server = make_server("127.0.0.1", 0, panel_app(logdir), threaded=True)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_port}{ROUTE}"
    server.shutdown()
    thread.join()


RENDER = """
const [options, done] = arguments;
const container = document.getElementById(options.container || "panel");
window.tinylmArithmetic.render(container, options).then(() => done(null), (e) => done(String(e)));
"""


def render(browser, **options):
    """Draw the panel for `options` and return what it shows: its rows' numbers and lines."""
    assert browser.execute_async_script(RENDER, options) is None
    return browser.execute_script("""
        const panel = document.getElementById(arguments[0]);
        return {rows: [...panel.querySelectorAll('table.arith-steps tr[data-j]')].map(
                  (tr) => ({j: Number(tr.dataset.j), weight: Number(tr.dataset.weight),
                            model: Number(tr.dataset.modelWeight),
                            cells: [...tr.cells].map((td) => td.textContent)})),
                text: panel.innerText,
                check: panel.querySelector('#arith-check')?.dataset};""",
        options.get("container", "panel"))


@pytest.mark.slow
def test_the_panel_draws_the_explainers_table_on_the_trained_model(
        panel_server, browser, client, trained, llama, tmp_path):
    browser.set_script_timeout(30)
    browser.get(f"{panel_server}/panel.html")
    she = len(trained[1].encode(PROMPT)) - 1
    layer, head = picked(trained[0])
    shown = render(browser, run="default", tag=TAG, layer=layer, head=head, query=she)
    _, a = ask(client, layer=layer, head=head, query=she)
    assert [row["j"] for row in shown["rows"]] == list(range(she + 1))
    np.testing.assert_allclose([row["weight"] for row in shown["rows"]],
                               [k["weight"] for k in a["keys"]], rtol=1e-12)
    np.testing.assert_allclose([row["weight"] for row in shown["rows"]],
                               [row["model"] for row in shown["rows"]], atol=1e-6)
    top = max(a["keys"], key=lambda k: k["weight"])
    label = f"{top['j']} (itself)" if top["j"] == she else str(top["j"])
    assert shown["rows"][top["j"]]["cells"][:3] == [label, top["token"], f"{top['qk']:.4f}"]
    text = shown["text"]
    assert f"The model's own weight for {json.dumps(top['token'])}: {top['model_weight']:.4f}; " \
           f"recomputed here: {top['weight']:.4f} (difference " in text
    assert float(shown["check"]["maxDifference"]) <= 1e-6
    for header in ("q·k", f"÷√{a['head_size']}", "masked", "−max", "exp", "weight",
                   "weight·v[0]"):
        assert header in text
    assert a["scale_step"] in text and "\nsum\t" in text
    browser.set_window_size(1400, 1600)  # the whole panel in view, for its screenshot
    try:
        browser.find_element("id", "panel").screenshot(str(tmp_path / "panel.png"))
    finally:
        browser.set_window_size(1400, 1000)
    # the docs' picture is the README's trained run; a machine without it keeps the docs' one
    shot = SCREENSHOT if (DEFAULT_RUN / "checkpoints" / "last").is_file() else tmp_path / "docs.png"
    shot.write_bytes(small_png(tmp_path / "panel.png"))
    assert 10_000 < shot.stat().st_size < 150_000

    # a Llama head: its rotary positions and the key/value head it shares, said
    llama_text = render(browser, run="llama", tag=TAG, layer=1, head=3,
                        query=len(llama[1].encode(PROMPT)) - 1)["text"]
    assert "q and k rotated by position (rotary)" in llama_text
    assert "key/value head 1, shared by heads 2-3" in llama_text
    browser.find_element("id", "panel").screenshot(str(tmp_path / "llama.png"))
    # a GPT-Neo local layer: unscaled, and its keys outside the window masked
    neo = render(browser, run="neo", tag=TAG, layer=1, head=0, query=WINDOW + 2)
    assert "scale 1.0 (GPT-Neo: unscaled)" in neo["text"] and "×1.0" in neo["text"]
    assert [row["cells"][4] for row in neo["rows"]][:3] == ["masked", "masked", "masked"]
    browser.find_element("id", "panel").screenshot(str(tmp_path / "neo.png"))
    # what cannot be shown is said in the panel
    last = trained[0].config.n_layer - 1
    problem = render(browser, run="budget", tag=TAG, layer=last, head=0, query=0)["text"]
    assert problem.startswith("The arithmetic of this weight cannot be shown: ")
    assert f"layer {last}'s q, k and v were not kept" in problem


def small_png(path) -> bytes:
    """A screenshot as a palette PNG: the panel's few colours, a fraction of the bytes."""
    import io

    from PIL import Image

    image = Image.open(path).convert("RGB").quantize(colors=64)
    out = io.BytesIO()
    image.save(out, format="PNG", optimize=True)
    return out.getvalue()


@pytest.mark.slow
def test_the_tab_draws_the_panel_once_it_is_wired_in(logdir, browser, tmp_path, trained):
    """In the tab itself, against a real tensorboard server, once index.js loads arithmetic.js."""
    with tensorboard_server(logdir, tmp_path / "tensorboard.log") as (process, base):
        def loaded():
            assert process.poll() is None, (tmp_path / "tensorboard.log").read_text()
            try:
                with urllib.request.urlopen(f"{base}{ROUTE}/texts", timeout=10) as response:
                    return len(json.loads(response.read())["texts"]) == 4
            except OSError:
                return False

        tab.wait_for(loaded, STARTUP_TIMEOUT_S, "tensorboard to load the runs")
        tab.open_tab(browser, base)
        if not browser.execute_script("return !!window.tinylmArithmetic"):
            pytest.skip("index.js does not load arithmetic.js yet")
        browser.execute_script("document.body.append(Object.assign(document.createElement("
                               "'div'), {id: 'arith-test'}))")
        she = len(trained[1].encode(PROMPT)) - 1
        layer, head = picked(trained[0])
        shown = render(browser, container="arith-test", run="default", tag=TAG, layer=layer,
                       head=head, query=she)
        assert len(shown["rows"]) == she + 1 and float(shown["check"]["maxDifference"]) <= 1e-6
