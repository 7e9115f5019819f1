"""What the attention tab reads: per inspected text and step, a summary tagged `tinylm_attention`
holding the weights as float16 (n_layer, n_head, T, T) and JSON content (text, tokens, the token ->
word map, pronouns, names, a note when the text was cut), under its own tag `<name>/step_<step>`
since TensorBoard samples only 10 tensors per tag by default; and per tinylm-probe report, one
tagged `tinylm_probe` holding its layer x head accuracy as float32 and its item count.

    write_attention(writer, "probe_prompt", capture, step)  # writer: torch SummaryWriter
    write_probe(writer, report["n"], accuracy)               # accuracy: (n_layer, n_head)
"""

from __future__ import annotations

import json

import numpy as np
from tensorboard.compat.proto import summary_pb2, tensor_pb2, tensor_shape_pb2, types_pb2

from tinylm.inspection.capture import PRONOUNS, AttentionCapture, is_name
from tinylm.inspection.tensorboard_plugin import PLUGIN_NAME, PROBE_PLUGIN_NAME

FORMAT_VERSION = 1  # bumped when the content's meaning changes; the tab names older data
PROBE_TAG = "probe/accuracy_grid"
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


def probe_summary(n: int, accuracy: np.ndarray) -> summary_pb2.Summary:
    """A tinylm-probe report as the tab draws it: float32 (L, nh) accuracy, its item count."""
    return tensor_summary(PROBE_PLUGIN_NAME, PROBE_TAG, {"version": FORMAT_VERSION, "n": n},
                          accuracy.astype("<f4"))


def write_attention(writer, name: str, capture: AttentionCapture, step: int) -> None:
    """Add one text's attention to a torch SummaryWriter's event file, for the attention tab."""
    writer.file_writer.add_summary(attention_summary(name, capture, step), step)


def write_probe(writer, n: int, accuracy: np.ndarray) -> None:
    """Add a tinylm-probe report's (L, nh) accuracy over n items to a torch SummaryWriter."""
    writer.file_writer.add_summary(probe_summary(n, accuracy), 0)
