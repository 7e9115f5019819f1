"""The arithmetic behind one attention weight, in the tab: for a head and a query token, the
explainer's steps (../shared/docs/attention-explainer.md) on the model's own numbers, each earlier
key's q·k, ÷√d, the mask, minus the row max, exp, the sum and the weight, and the value terms
they mix, checked against the weight the model's forward pass gave.

Three parts:

    numbers = capture_arithmetic(model, ids)          # q, k, v and float32 weights, via hooks
    write_arithmetic(writer, name, capture, step)      # as its own summary, beside the text's
    serve(plugin, request)                             # the tab's /arithmetic route

write_arithmetic writes the numbers capture_attention recorded (capture.arithmetic), or those of
a forward pass of the model it is given, under the tag qkv_tag(step_tag(name, step)) =
"qkv/<name>/step_<step>" and the plugin name ARITHMETIC_PLUGIN_NAME (not the tab's: the tab lists
each of its own tags as a text).

What is stored, per text: for each layer kept, every head's q (nh, T, hs), k and v (nkv, T, hs:
the key/value heads, fewer under grouped-query attention) as the hook points blocks.{i}.attn.
hook_q/_k/_v held them (rotated by position where the model rotates them), and the forward pass's
own weights at hook_pattern, float32, their lower triangle (nh, T(T+1)/2): the float16 weights of
the tab's summary carry ~3 digits, too few to show that the recomputation gives the model's weight
to ~1e-7. Also each layer's scale (None: 1/√d), the band its mask keeps (GPT-Neo's local layers)
and its key/value heads.

How much: at most MAX_STORED numbers (16 MiB of float32) per text, whole layers from layer 0 while
they fit. That keeps every layer of tinylm's models at their whole context (the default, 4 layers x
4 heads of 32 over 128 tokens, is 0.46M numbers, 1.8 MB) and of GPT-2 small at 128 tokens the
first 10 of its 12 layers (0.39M numbers each); writing costs ~0.15 s per MB (TensorBoard's writer
checksums each record in Python), so a budget this size keeps an evaluation's or an inspection's
writing under ~2.5 s at worst. A caller may name the layers instead (`layers=`); a layer left out
is named in the summary, and the route says why for it.

The route recomputes the one query row with tinylm.attention.attention_steps from the stored q, k
and v (float32, the model's own arithmetic, so a float32 model's weight comes back to ~1e-7) and
answers strict JSON, every number finite or null.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from tinylm.attention import attention_steps, weighted_values
from tinylm.inspection.head_numbers import (
    MAX_STORED,
    ArithmeticCapture,
    capture_arithmetic,
    layer_numbers,
)
from tinylm.inspection.tensorboard_plugin import PLUGIN_NAME

# Imported where used: capture.py, summary.py and plugin.py may each import this module at their
# top, and capture, walkthrough, summary and plugin import one another's modules.

ROUTE = "/arithmetic"  # /data/plugin/tinylm_attention/arithmetic?run=&tag=&layer=&head=&query=
STATIC = "arithmetic.js"  # window.tinylmArithmetic.render(container, {run, tag, layer, ...})
# Its own plugin name: the tab lists every tinylm_attention tag as a text, and this is not one.
ARITHMETIC_PLUGIN_NAME = "tinylm_arithmetic"
MAX_HEAD_SIZE = 1024  # of the data served; Llama 3 405B's heads are 128 wide
MAX_VALUE_DIMS = 8  # value dimensions shown per key: their terms weight_j · v_j
# a model's class -> its name in the panel's notes ("scale 1.0 (GPT-Neo: unscaled)")
def qkv_tag(text_tag: str) -> str:
    """The tag of a text's q, k, v, from the tag of its attention (summary.step_tag): a prefix,
    not a suffix, so that no filter of a text's tags by their start ("patching/pair_") takes it
    for one."""
    return f"qkv/{text_tag}"


def arithmetic_content(name: str, step: int, numbers: ArithmeticCapture) -> dict:
    from tinylm.inspection.tensorboard_plugin.summary import FORMAT_VERSION

    return {"version": FORMAT_VERSION, "name": name, "step": step, "tokens": numbers.tokens,
            "n_layer": numbers.n_layer, "n_head": numbers.n_head,
            "head_size": numbers.head_size, "architecture": numbers.architecture,
            "dtype": numbers.dtype, "layers": [layer.meta() for layer in numbers.layers],
            "not_stored": numbers.not_stored}


def arithmetic_summary(name: str, step: int, numbers: ArithmeticCapture):
    """The numbers as a Summary proto tagged qkv_tag(step_tag(name, step)): one float32 vector,
    the kept layers one after another, described by its JSON content."""
    from tinylm.inspection.tensorboard_plugin.summary import step_tag, tensor_summary

    flat = (np.concatenate([layer.flat for layer in numbers.layers]) if numbers.layers
            else np.zeros(0, "<f4"))
    return tensor_summary(ARITHMETIC_PLUGIN_NAME, qkv_tag(step_tag(name, step)),
                          arithmetic_content(name, step, numbers), flat.astype("<f4"))


def write_arithmetic(writer, name: str, capture, step: int, model=None) -> None:
    """Add a text's q, k, v (see the module docstring) to a torch SummaryWriter, beside its
    attention (summary.write_attention): those capture_attention recorded (capture.arithmetic),
    or, given the model, those of a forward pass over capture.ids; nothing without either."""
    numbers = getattr(capture, "arithmetic", None)
    if numbers is None and model is not None:
        numbers = capture_arithmetic(model, capture.ids)
    if numbers is not None:
        writer.file_writer.add_summary(arithmetic_summary(name, step, numbers), step)


# ------------------------------------------------------------------------------- the route


def _digits(value: str | None, width: int = 6) -> int | None:
    """A request's whole number (only ASCII digits, at most `width`), else None."""
    if value is None or not (value.isascii() and value.isdigit() and len(value) <= width):
        return None
    return int(value)


def _finite(x) -> float | None:
    """A number for strict JSON: None where it is not finite (an overflow of crafted data)."""
    x = float(x)
    return x if math.isfinite(x) else None


def read_arithmetic(raw, shape: list[int]) -> dict:
    """The description of a text's q, k, v, checked against the text's (L, nh, T, T): its head
    size, its kept layers (each once, in order: key/value heads that divide nh, a finite scale or
    None, a band or None, rotary or not), and the numbers they take, at most MAX_STORED."""
    from tinylm.inspection.tensorboard_plugin.plugin import (
        _is_int,
        _is_number,
        _is_text,
        _require,
        read_description,
    )

    content = read_description(raw, "a tinylm arithmetic summary")
    n_layer, n_head, t = shape[0], shape[1], shape[2]
    _require(content.get("n_layer") == n_layer and content.get("n_head") == n_head
             and content.get("tokens") == t,
             f"its q, k and v are not of the text's {n_layer} layers x {n_head} heads over "
             f"{t} tokens")
    hs = content.get("head_size")
    _require(_is_int(hs, 1, MAX_HEAD_SIZE + 1), f"its head size is not 1..{MAX_HEAD_SIZE}")
    layers, offset, seen = content.get("layers"), 0, -1
    _require(isinstance(layers, list) and len(layers) <= n_layer,
             f"its layers are not a list of at most {n_layer}")
    kept = {}
    for meta in layers:
        _require(isinstance(meta, dict) and _is_int(meta.get("layer"), seen + 1, n_layer),
                 "its layers are not layer numbers, each once, in order")
        seen, nkv, scale, window = meta["layer"], meta.get("n_kv_head"), meta.get("scale"), \
            meta.get("window")
        _require(_is_int(nkv, 1, n_head + 1) and n_head % nkv == 0,
                 f"layer {seen}'s key/value heads do not divide its {n_head} heads")
        _require(scale is None or (_is_number(scale) and scale != 0),
                 f"layer {seen}'s scale is not a finite number")
        _require(window is None or _is_int(window, 1, 2**31),
                 f"layer {seen}'s window is not a number of positions")
        _require(isinstance(meta.get("rotary"), bool), f"layer {seen}'s rotary is not true/false")
        size = layer_numbers(n_head, nkv, hs, t)
        kept[seen] = {"n_kv_head": nkv, "scale": scale, "window": window,
                      "rotary": meta["rotary"], "offset": offset, "size": size}
        offset += size
        _require(offset <= MAX_STORED, f"its q, k and v are over {MAX_STORED} numbers")
    for key in ("architecture", "dtype"):
        _require(_is_text(content.get(key)), f"its {key} is not a short text")
    _require(isinstance(content.get("not_stored"), str) and len(content["not_stored"]) <= 4096,
             "its note on the layers not kept is not a text of at most 4096 characters")
    return {"head_size": hs, "layers": kept, "size": offset,
            **{key: content[key] for key in ("architecture", "dtype", "not_stored")}}


def scale_said(scale: float | None, head_size: int, architecture: str
               ) -> tuple[float, str, str]:
    """The factor q·k is multiplied by; the step in words ("divided by √d (...)"); a note where
    the layer departs from the explainer's ÷√d ("" where it does not)."""
    textbook = 1 / math.sqrt(head_size)
    if scale is None or math.isclose(scale, textbook, rel_tol=1e-9):
        return textbook, (f"divided by √d (d = {head_size}, √d = "
                          f"{math.sqrt(head_size):.4f})"), ""
    if scale == 1.0:
        return 1.0, f"multiplied by 1.0 ({architecture}: unscaled)", (
            f"scale 1.0 ({architecture}: unscaled): q·k is not divided by √d")
    return scale, f"multiplied by {scale:g} ({architecture})", (
        f"scale {scale:g} ({architecture}): q·k is multiplied by {scale:g}, not divided by √d")


def one_weight(flat: np.ndarray, described: dict, layer: int, head: int, query: int,
               n_head: int, t: int, tokens: list[str]) -> dict:
    """The steps of query row `query` of one head from the stored numbers, as the route answers
    them; every number finite or None."""
    from tinylm.inspection.capture import kv_head

    meta, hs = described["layers"][layer], described["head_size"]
    nkv = meta["n_kv_head"]
    block = flat[meta["offset"]:meta["offset"] + meta["size"]]
    sizes = [n_head * t * hs, nkv * t * hs, nkv * t * hs]
    q, k, v, tri = np.split(block, np.cumsum(sizes))
    q, k, v = q.reshape(n_head, t, hs), k.reshape(nkv, t, hs), v.reshape(nkv, t, hs)
    kv, i, window = kv_head(head, n_head, nkv), query, meta["window"]
    keys = torch.arange(i + 1)
    hidden = None if window is None else (keys <= i - window)[None, :]  # the band's outside
    scale, step_said, said = scale_said(meta["scale"], hs, described["architecture"])
    # the query is the last of the i + 1 positions it may see: the causal mask hides none of them
    steps = attention_steps(torch.from_numpy(q[head, i:i + 1].copy()),
                            torch.from_numpy(k[kv, :i + 1].copy()),
                            torch.from_numpy(v[kv, :i + 1].copy()), mask=hidden,
                            is_causal=True, scale=meta["scale"])
    start = i * (i + 1) // 2
    forward = tri.reshape(n_head, t * (t + 1) // 2)[head, start:start + i + 1].astype(np.float64)
    weights = steps.weights[0].double().numpy()
    dims = min(hs, MAX_VALUE_DIMS)
    terms = weighted_values(steps.weights, torch.from_numpy(v[kv, :i + 1, :dims].copy()))[0]
    rows = []
    for j in range(i + 1):
        masked = bool(hidden[0, j]) if hidden is not None else False
        rows.append({
            "j": j, "token": tokens[j],
            "qk": _finite(steps.scores[0, j]), "scaled": _finite(steps.scaled[0, j]),
            "masked": "masked" if masked else _finite(steps.masked[0, j]),
            "shifted": None if masked else _finite(steps.shifted[0, j]),
            "exp": _finite(steps.exps[0, j]), "weight": _finite(weights[j]),
            "model_weight": _finite(forward[j]),
            "value": [_finite(x) for x in v[kv, j, :dims]],
            "term": [_finite(x) for x in terms[j]]})
    difference = np.abs(forward - weights)
    group = n_head // nkv
    return {
        "layer": layer, "head": head, "query": i, "query_token": tokens[i], "n_tokens": t,
        "head_size": hs, "architecture": described["architecture"],
        "dtype": described["dtype"], "scale": meta["scale"], "scale_used": _finite(scale),
        "scale_step": step_said, "scale_said": said, "rotary": meta["rotary"], "window": window,
        "n_head": n_head, "n_kv_head": nkv, "kv_head": kv,
        "kv_shared_by": [kv * group, (kv + 1) * group - 1] if group > 1 else None,
        "keys": rows, "later_hidden": t - 1 - i,
        "masked_keys": 0 if hidden is None else int(hidden.sum()),
        "row_max": _finite(steps.row_max[0, 0]), "exp_sum": _finite(steps.exp_sum[0, 0]),
        "weight_sum": _finite(weights.sum()), "model_weight_sum": _finite(forward.sum()),
        "max_difference": _finite(difference.max()),
        "value_dims": dims, "output": [_finite(x) for x in steps.output[0, :dims]],
    }


def serve(plugin, request):
    """/arithmetic?run=&tag=&layer=&head=&query= (or text=&step= for tag): the steps of one
    weight, recomputed from the text's stored q, k, v; 404 when the logdir has no such text, 400
    for a malformed request, the reason (200, {"problem": ...}) when its numbers are skipped."""
    from tinylm.inspection.tensorboard_plugin.plugin import (
        Skipped,
        _json,
        _require,
        read_content,
        read_floats,
        read_numbers,
    )
    from tinylm.inspection.tensorboard_plugin.summary import step_tag

    args = request.args
    run, tag = args.get("run"), args.get("tag")
    if tag is None and args.get("text") is not None:
        step = _digits(args.get("step"), 18)
        tag = step_tag(args["text"], step) if step is not None else None
    layer, head, query = (_digits(args.get(key)) for key in ("layer", "head", "query"))
    if None in (layer, head, query):
        return _json(request, {"error": "layer, head and query must be whole numbers (query: a "
                                        "token's index)"}, 400)
    text = plugin._series(request, PLUGIN_NAME, [run], [tag]).get(run, {}).get(tag) if (
        run and tag) else None
    if text is None:
        return _json(request, {"error": "no such run and tag"}, 404)
    try:
        plugin._require_inside(run)
        content = read_content(text.plugin_content)
        n_layer, n_head, t = content["shape"][:3]
        if not (layer < n_layer and head < n_head and query < t):
            return _json(request, {"error": f"no layer {layer}, head {head}, query {query}: the "
                                            f"text has {n_layer} layers x {n_head} heads over "
                                            f"{t} tokens"}, 400)
        stored = plugin._series(request, ARITHMETIC_PLUGIN_NAME, [run], [qkv_tag(tag)]).get(
            run, {}).get(qkv_tag(tag))
        _require(stored is not None, "no q, k and v were written beside its attention (data "
                 "written before the arithmetic panel, or by a writer without it): write it "
                 "again to see the arithmetic")
        described = read_arithmetic(stored.plugin_content, content["shape"])
        _require(layer in described["layers"], f"layer {layer}'s q, k and v were not kept: "
                 f"{described['not_stored'] or 'not written'}")
        flat = plugin._tensor(request, ARITHMETIC_PLUGIN_NAME, run, qkv_tag(tag),
                              "its q, k and v")
        size = described["size"]
        read_floats(flat, "its q, k and v", lambda s: s == (size,), f"{size}")
        _require(bool(np.isfinite(flat).all()), "its q, k and v hold NaN or infinite numbers")
        meta = described["layers"][layer]
        weights = flat[meta["offset"] + meta["size"] - n_head * t * (t + 1) // 2:
                       meta["offset"] + meta["size"]]
        read_numbers(weights, "its weights", lambda s: True, "float")
        answer = one_weight(flat, described, layer, head, query, n_head, t, content["tokens"])
        return _json(request, {"run": run, "tag": tag, **answer})
    except Skipped as why:
        return _json(request, {"problem": {"run": run, "tag": tag, "message": f"{tag}: {why}"}})


def app(plugin):
    """serve() as the WSGI app of the route: plugin.get_plugin_apps()[ROUTE] = app(self)."""
    from werkzeug import wrappers

    return wrappers.Request.application(lambda request: serve(plugin, request))
