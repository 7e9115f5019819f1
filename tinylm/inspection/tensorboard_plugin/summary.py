"""What the attention tab reads: per inspected text and step, a summary tagged `tinylm_attention`
holding the weights as float16 (n_layer, n_head, T, T) and JSON content (text, tokens, the token ->
word map, pronouns, names, a note when the text was cut), under its own tag `<name>/step_<step>`
since TensorBoard samples only 10 tensors per tag by default.

    write_attention(writer, "probe_prompt", capture, step)  # writer: torch SummaryWriter
"""

from __future__ import annotations

import json

from tensorboard.compat.proto import summary_pb2, tensor_pb2, tensor_shape_pb2, types_pb2

from tinylm.inspection.capture import PRONOUNS, AttentionCapture, is_name
from tinylm.inspection.tensorboard_plugin import PLUGIN_NAME

FORMAT_VERSION = 1  # bumped when the content's meaning changes; the tab names older data


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


def attention_summary(name: str, capture: AttentionCapture, step: int) -> summary_pb2.Summary:
    """One text's attention as a Summary proto: float16 (L, nh, T, T) plus its JSON content."""
    metadata = summary_pb2.SummaryMetadata(data_class=summary_pb2.DATA_CLASS_TENSOR)
    metadata.plugin_data.plugin_name = PLUGIN_NAME
    metadata.plugin_data.content = json.dumps(attention_content(name, capture, step)).encode()
    # raw bytes, not make_tensor_proto: that stores float16 one varint at a time, in Python
    tensor = tensor_pb2.TensorProto(
        dtype=types_pb2.DT_HALF, tensor_content=capture.weights.astype("<f2").tobytes(),
        tensor_shape=tensor_shape_pb2.TensorShapeProto(
            dim=[tensor_shape_pb2.TensorShapeProto.Dim(size=n) for n in capture.weights.shape]))
    summary = summary_pb2.Summary()
    summary.value.add(tag=step_tag(name, step), metadata=metadata, tensor=tensor)
    return summary


def write_attention(writer, name: str, capture: AttentionCapture, step: int) -> None:
    """Add one text's attention to a torch SummaryWriter's event file, for the attention tab."""
    writer.file_writer.add_summary(attention_summary(name, capture, step), step)
