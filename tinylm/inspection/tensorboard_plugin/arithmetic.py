"""The arithmetic behind one attention weight, for the tab's panel: for a head and a query token,
the explainer's steps (../shared/docs/attention-explainer.md) on the model's own numbers (each
earlier key's q·k, ÷√d, the mask, minus the row max, exp, the sum and the weight, and the value
terms they mix), recomputed with tinylm.attention.attention_steps from the q, k and v that
summary.write_attention stored and checked against the weight the model's forward pass gave.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from tinylm.attention import attention_steps, weighted_values
from tinylm.files import json_number, json_numbers
from tinylm.inspection.capture import kv_head

MAX_VALUE_DIMS = 8  # value dimensions shown per key: their terms weight_j · v_j


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
    """The steps of query row `query` of one head, from the stored numbers `flat` as
    reading.read_arithmetic `described` them; every number finite or None (null)."""
    meta, hs = described["layers"][layer], described["head_size"]
    nkv = meta["n_kv_head"]
    block = flat[meta["offset"]:meta["offset"] + meta["size"]]
    q, k, v, tri = np.split(block, np.cumsum([n_head * t * hs, nkv * t * hs, nkv * t * hs]))
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
        masked = hidden is not None and bool(hidden[0, j])
        rows.append({
            "j": j, "token": tokens[j],
            "qk": json_number(steps.scores[0, j]), "scaled": json_number(steps.scaled[0, j]),
            "masked": "masked" if masked else json_number(steps.masked[0, j]),
            "shifted": None if masked else json_number(steps.shifted[0, j]),
            "exp": json_number(steps.exps[0, j]), "weight": json_number(weights[j]),
            "model_weight": json_number(forward[j]),
            "value": json_numbers(v[kv, j, :dims]), "term": json_numbers(terms[j])})
    group = n_head // nkv
    return {
        "layer": layer, "head": head, "query": i, "query_token": tokens[i], "n_tokens": t,
        "head_size": hs, "architecture": described["architecture"],
        "dtype": described["dtype"], "scale": meta["scale"], "scale_used": json_number(scale),
        "scale_step": step_said, "scale_said": said, "rotary": meta["rotary"], "window": window,
        "n_head": n_head, "n_kv_head": nkv, "kv_head": kv,
        "kv_shared_by": [kv * group, (kv + 1) * group - 1] if group > 1 else None,
        "keys": rows, "later_hidden": t - 1 - i,
        "masked_keys": 0 if hidden is None else int(hidden.sum()),
        "row_max": json_number(steps.row_max[0, 0]), "exp_sum": json_number(steps.exp_sum[0, 0]),
        "weight_sum": json_number(weights.sum()), "model_weight_sum": json_number(forward.sum()),
        "max_difference": json_number(np.abs(forward - weights).max()),
        "value_dims": dims, "output": json_numbers(steps.output[0, :dims]),
    }
