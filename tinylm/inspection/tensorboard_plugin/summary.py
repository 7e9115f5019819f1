"""What the attention tab reads, written as TensorBoard summaries through a torch SummaryWriter:

    write_attention(writer, "probe_prompt", capture, step)   # one text, and its q, k and v
    write_probe(writer, n, accuracy, chance=1 / 3, reads="...")  # accuracy: (n_layer, n_head)
    write_patching(writer, effects, intervals, pair_effects, pairs, n_skipped, interval_level)

Each text goes under its own tag, `<name>/step_<step>`: TensorBoard samples only 10 tensors per
tag by default.
"""

from __future__ import annotations

import json

import numpy as np
from tensorboard.compat.proto import summary_pb2, tensor_pb2, tensor_shape_pb2, types_pb2

from tinylm.inspection.capture import PRONOUNS, AttentionCapture, is_name
from tinylm.inspection.head_numbers import ArithmeticCapture
from tinylm.inspection.tensorboard_plugin import (
    ARITHMETIC_PLUGIN_NAME,
    PLUGIN_NAME,
    PROBE_PLUGIN_NAME,
)

FORMAT_VERSION = 1  # bumped when the content's meaning changes; the tab names older data
PROBE_TAG = "probe/accuracy_grid"
PATCHING_TAG = "probe/patching"  # (L, nh, 3): effect, interval low, interval high
PATCHING_POSITIONS_TAG = "probe/patching_by_position"  # (P, L, nh, T_max)
# What tinylm-probe's accuracy grid reads (its Resolving probe); chance is 0.5 on its items, which
# hold two characters: a head that picks one at random is right on half of them.
PROBE_READS = ("attention from the pronoun itself (resolving): the share of two-character items "
               "on which the head looks more at the pronoun's character than at the other one")
DTYPES = {np.dtype("<f2"): types_pb2.DT_HALF, np.dtype("<f4"): types_pb2.DT_FLOAT}


def step_tag(name: str, step: int) -> str:
    """The tag one text's attention at one step is written under."""
    return f"{name}/step_{step:08d}"


def qkv_tag(text_tag: str) -> str:
    """The tag of a text's q, k and v: a prefix, so that no filter of a text's tags by their
    start ("patching/pair_") takes it for a text."""
    return f"qkv/{text_tag}"


def tensor_summary(plugin_name: str, tag: str, content: dict,
                   array: np.ndarray) -> summary_pb2.Summary:
    """A Summary proto of one float16 or float32 array with the plugin's JSON content."""
    metadata = summary_pb2.SummaryMetadata(data_class=summary_pb2.DATA_CLASS_TENSOR)
    metadata.plugin_data.plugin_name = plugin_name
    metadata.plugin_data.content = json.dumps(content).encode()
    # raw bytes, not make_tensor_proto: that stores float16 one varint at a time, in Python
    tensor = tensor_pb2.TensorProto(
        dtype=DTYPES[array.dtype], tensor_content=array.tobytes(),
        tensor_shape=tensor_shape_pb2.TensorShapeProto(
            dim=[tensor_shape_pb2.TensorShapeProto.Dim(size=n) for n in array.shape]))
    summary = summary_pb2.Summary()
    summary.value.add(tag=tag, metadata=metadata, tensor=tensor)
    return summary


def attention_summary(name: str, capture: AttentionCapture, step: int) -> summary_pb2.Summary:
    """One text's attention: float16 (L, nh, T, T) weights and what the tab needs besides."""
    words = capture.words
    content = {
        "version": FORMAT_VERSION, "name": name, "step": step, "text": capture.text,
        "tokens": capture.tokens, "token_words": capture.token_words, "words": words,
        "pronouns": [i for i, w in enumerate(words) if w in PRONOUNS],
        "names": [i for i in range(len(words)) if is_name(capture.text, capture.word_spans, i)],
        "shape": list(capture.weights.shape),
        "window_note": capture.window_note() if capture.n_text_tokens > len(capture.ids) else "",
        # absent: every head has its own key/value head, as in the data written before this
        **({"kv_heads": capture.shared_kv_heads} if capture.shared_kv_heads else {}),
    }
    return tensor_summary(PLUGIN_NAME, step_tag(name, step), content,
                          capture.weights.astype("<f2"))


def arithmetic_summary(name: str, step: int, numbers: ArithmeticCapture) -> summary_pb2.Summary:
    """A text's q, k, v and weights for the arithmetic panel, the kept layers one after another
    in one float32 vector (the float16 weights of the tab carry ~3 digits, too few to show that
    recomputing a weight gives the model's to ~1e-7), described by its JSON content."""
    content = {"version": FORMAT_VERSION, "name": name, "step": step, "tokens": numbers.tokens,
               "n_layer": numbers.n_layer, "n_head": numbers.n_head,
               "head_size": numbers.head_size, "architecture": numbers.architecture,
               "dtype": numbers.dtype, "layers": [layer.meta() for layer in numbers.layers],
               "not_stored": numbers.not_stored}
    flat = (np.concatenate([layer.flat for layer in numbers.layers]) if numbers.layers
            else np.zeros(0, "<f4"))
    return tensor_summary(ARITHMETIC_PLUGIN_NAME, qkv_tag(step_tag(name, step)), content,
                          flat.astype("<f4"))


def probe_summary(n: int, accuracy: np.ndarray, chance: float = 0.5,
                  reads: str = PROBE_READS) -> summary_pb2.Summary:
    """A tinylm-probe report: float32 (L, nh) accuracy over n items, the accuracy of chance (a
    head choosing at random among the items' characters) and what it reads."""
    content = {"version": FORMAT_VERSION, "n": n, "chance": chance, "reads": reads}
    return tensor_summary(PROBE_PLUGIN_NAME, PROBE_TAG, content, accuracy.astype("<f4"))


def pair_content(pair: dict) -> dict:
    """One counterfactual pair as JSON, in plain Python values (numpy numbers are no JSON)."""
    return {"source": str(pair["source"]), "tokens": [str(t) for t in pair["tokens"]],
            "position": int(pair["position"]), "m_clean": float(pair["m_clean"]),
            "m_counterfactual": float(pair["m_counterfactual"]),
            "pronoun": str(pair["pronoun"]), "wrong_pronoun": str(pair["wrong_pronoun"])}


def patching_summary(effects: np.ndarray, intervals: np.ndarray, pair_effects: np.ndarray,
                     pairs: list[dict], n_skipped: int,
                     interval_level: float | None = None) -> summary_pb2.Summary:
    """An activation-patching report: (L, nh) effects (NaN: undefined) with their (L, nh, 2)
    intervals at interval_level (0.9: 90%; None: not said), and (P, L, nh, T_max) effects per
    pair and position, NaN-padded after each pair's clean tokens."""
    effects, intervals, pair_effects = (np.asarray(a, "<f4")
                                        for a in (effects, intervals, pair_effects))
    if effects.ndim != 2 or intervals.shape != (*effects.shape, 2) or (
            pair_effects.shape[:3] != (len(pairs), *effects.shape) or pair_effects.ndim != 4):
        raise ValueError(f"patching shapes do not fit: effects {effects.shape}, intervals "
                         f"{intervals.shape}, pair_effects {pair_effects.shape} for "
                         f"{len(pairs)} pairs; expected (L, nh), (L, nh, 2), (P, L, nh, T_max)")
    content = {"version": FORMAT_VERSION, "shape": list(pair_effects.shape),
               "n_skipped": int(n_skipped),
               "interval_level": None if interval_level is None else float(interval_level),
               "pairs": [pair_content(pair) for pair in pairs]}
    grid = np.concatenate([effects[..., None], intervals], axis=-1)  # (L, nh, 3)
    summary = tensor_summary(PROBE_PLUGIN_NAME, PATCHING_TAG, content, grid)
    summary.value.extend(tensor_summary(PROBE_PLUGIN_NAME, PATCHING_POSITIONS_TAG,
                                        {"version": FORMAT_VERSION}, pair_effects).value)
    return summary


def write_attention(writer, name: str, capture: AttentionCapture, step: int) -> None:
    """Add one text's attention to a torch SummaryWriter's event file, and the q, k and v behind
    it where the capture recorded them (at most head_numbers.MAX_STORED numbers, 16 MiB: the
    writer checksums each record in Python, ~0.15 s per MB)."""
    writer.file_writer.add_summary(attention_summary(name, capture, step), step)
    if capture.arithmetic is not None:
        writer.file_writer.add_summary(arithmetic_summary(name, step, capture.arithmetic), step)


def write_probe(writer, n: int, accuracy: np.ndarray, chance: float = 0.5,
                reads: str = PROBE_READS) -> None:
    """Add a tinylm-probe report (see probe_summary) to a torch SummaryWriter."""
    writer.file_writer.add_summary(probe_summary(n, accuracy, chance, reads), 0)


def write_patching(writer, effects: np.ndarray, intervals: np.ndarray, pair_effects: np.ndarray,
                   pairs: list[dict], n_skipped: int, interval_level: float | None = None) -> None:
    """Add an activation-patching report (see patching_summary) to a torch SummaryWriter."""
    writer.file_writer.add_summary(patching_summary(
        effects, intervals, pair_effects, pairs, n_skipped, interval_level), 0)
