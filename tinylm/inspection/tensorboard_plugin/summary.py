"""What the attention tab reads: per inspected text and step, a summary tagged `tinylm_attention`
holding the weights as float16 (n_layer, n_head, T, T) and JSON content (text, tokens, the token ->
word map, pronouns, names, a note when the text was cut, each layer's key/value heads where query
heads share them), under its own tag `<name>/step_<step>` since TensorBoard samples only 10
tensors per tag by default; and per tinylm-probe report, one tagged `tinylm_probe` holding its
layer x head accuracy as float32, its item count, the accuracy of chance and what the accuracy
reads (a picker and a grid a class can read need both); and per activation-patching report, two more
tagged `tinylm_probe`: the layer x head effects with their intervals, float32 (L, nh, 3),
described by the pairs, and the effects per pair and position, float32 (P, L, nh, T_max).

    write_attention(writer, "probe_prompt", capture, step)  # writer: torch SummaryWriter
    write_probe(writer, report["n"], accuracy)               # accuracy: (n_layer, n_head)
    write_probe(writer, n, accuracy, chance=1 / 3, reads="...")  # another probe's
    write_patching(writer, effects, intervals, pair_effects, pairs, n_skipped, interval_level)
"""

from __future__ import annotations

import json

import numpy as np
from tensorboard.compat.proto import summary_pb2, tensor_pb2, tensor_shape_pb2, types_pb2

from tinylm.inspection.capture import PRONOUNS, AttentionCapture, is_name
from tinylm.inspection.tensorboard_plugin import PLUGIN_NAME, PROBE_PLUGIN_NAME

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


def attention_content(name: str, capture: AttentionCapture, step: int) -> dict:
    """The JSON the tab needs besides the weights: tokens, words, pronouns, names, the window."""
    words = capture.words
    return {
        "version": FORMAT_VERSION,
        "name": name,
        "step": step,
        "text": capture.text,
        "tokens": capture.tokens,
        "token_words": capture.token_words,
        "words": words,
        "pronouns": [i for i, w in enumerate(words) if w in PRONOUNS],
        "names": [i for i in range(len(words)) if is_name(capture.text, capture.word_spans, i)],
        "shape": list(capture.weights.shape),
        "window_note": capture.window_note() if capture.n_text_tokens > len(capture.ids) else "",
        # each layer's key/value heads, where query heads share them (grouped-query attention);
        # absent: every head has its own, as in the data written before it was recorded
        **({"kv_heads": capture.shared_kv_heads} if capture.shared_kv_heads else {}),
    }


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
    """One text's attention as a Summary proto: float16 (L, nh, T, T) plus its JSON content."""
    return tensor_summary(PLUGIN_NAME, step_tag(name, step),
                          attention_content(name, capture, step), capture.weights.astype("<f2"))


def probe_summary(n: int, accuracy: np.ndarray, chance: float = 0.5,
                  reads: str = PROBE_READS) -> summary_pb2.Summary:
    """A tinylm-probe report as the tab draws it: float32 (L, nh) accuracy, its item count, the
    accuracy of chance (a head choosing at random among the items' characters) and what it
    reads."""
    return tensor_summary(PROBE_PLUGIN_NAME, PROBE_TAG, {"version": FORMAT_VERSION, "n": n,
                                                         "chance": chance, "reads": reads},
                          accuracy.astype("<f4"))


def pair_content(pair: dict) -> dict:
    """One counterfactual pair as JSON, in plain Python values (numpy numbers are no JSON)."""
    return {"source": str(pair["source"]), "tokens": [str(t) for t in pair["tokens"]],
            "position": int(pair["position"]), "m_clean": float(pair["m_clean"]),
            "m_counterfactual": float(pair["m_counterfactual"]),
            "pronoun": str(pair["pronoun"]), "wrong_pronoun": str(pair["wrong_pronoun"])}


def patching_content(pairs: list[dict], n_skipped: int, shape: tuple[int, ...],
                     interval_level: float | None) -> dict:
    """The JSON beside the patching grid: each pair's clean tokens, deciding position, pronouns
    and margins, how many pairs were skipped, the shape (P, L, nh, T_max) of the effects per
    position, the intervals' level (0.9: 90%; None: not said)."""
    return {"version": FORMAT_VERSION, "shape": list(shape), "n_skipped": int(n_skipped),
            "interval_level": None if interval_level is None else float(interval_level),
            "pairs": [pair_content(pair) for pair in pairs]}


def patching_summary(effects: np.ndarray, intervals: np.ndarray, pair_effects: np.ndarray,
                     pairs: list[dict], n_skipped: int,
                     interval_level: float | None = None) -> summary_pb2.Summary:
    """An activation-patching report as the tab draws it: (L, nh) effects (NaN: undefined) with
    their (L, nh, 2) intervals, and (P, L, nh, T_max) effects per pair and position, NaN-padded
    after each pair's clean tokens."""
    effects, intervals, pair_effects = (np.asarray(a, "<f4")
                                        for a in (effects, intervals, pair_effects))
    if effects.ndim != 2 or intervals.shape != (*effects.shape, 2) or (
            pair_effects.shape[:3] != (len(pairs), *effects.shape) or pair_effects.ndim != 4):
        raise ValueError(f"patching shapes do not fit: effects {effects.shape}, intervals "
                         f"{intervals.shape}, pair_effects {pair_effects.shape} for "
                         f"{len(pairs)} pairs; expected (L, nh), (L, nh, 2), (P, L, nh, T_max)")
    grid = np.concatenate([effects[..., None], intervals], axis=-1)  # (L, nh, 3)
    summary = tensor_summary(PROBE_PLUGIN_NAME, PATCHING_TAG,
                             patching_content(pairs, n_skipped, pair_effects.shape,
                                              interval_level), grid)
    summary.value.extend(tensor_summary(PROBE_PLUGIN_NAME, PATCHING_POSITIONS_TAG,
                                        {"version": FORMAT_VERSION}, pair_effects).value)
    return summary


def write_attention(writer, name: str, capture: AttentionCapture, step: int) -> None:
    """Add one text's attention to a torch SummaryWriter's event file, for the attention tab,
    and the q, k and v behind it where the capture recorded them (the arithmetic panel's)."""
    from tinylm.inspection.tensorboard_plugin.arithmetic import write_arithmetic

    writer.file_writer.add_summary(attention_summary(name, capture, step), step)
    write_arithmetic(writer, name, capture, step)


def write_probe(writer, n: int, accuracy: np.ndarray, chance: float = 0.5,
                reads: str = PROBE_READS) -> None:
    """Add a tinylm-probe report's (L, nh) accuracy over n items, its chance level and what it
    reads, to a torch SummaryWriter."""
    writer.file_writer.add_summary(probe_summary(n, accuracy, chance, reads), 0)


def write_patching(writer, effects: np.ndarray, intervals: np.ndarray, pair_effects: np.ndarray,
                   pairs: list[dict], n_skipped: int, interval_level: float | None = None) -> None:
    """Add an activation-patching report (see patching_summary) to a torch SummaryWriter."""
    writer.file_writer.add_summary(patching_summary(
        effects, intervals, pair_effects, pairs, n_skipped, interval_level), 0)
