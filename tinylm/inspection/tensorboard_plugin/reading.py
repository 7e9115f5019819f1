"""What the tab reads of a logdir, checked where it enters. A logdir may hold anything: a summary
that cannot be served (of another format version, crafted, beyond the bounds below) raises
Skipped, whose message the route lists among its problems; what passes is bounded by its checked
shape, and so is every answer made of it."""

from __future__ import annotations

import json
import math
import re
import sys

import numpy as np

from tinylm.inspection.capture import FEMALE_NAMES, MALE_NAMES, PERSON_PRONOUNS, PRONOUN_GENDER
from tinylm.inspection.head_numbers import MAX_STORED, layer_numbers
from tinylm.inspection.tensorboard_plugin.summary import FORMAT_VERSION, PROBE_READS

# The largest text served: far above any tinylm model (GPT-2 has 12 layers x 12 heads over 1024
# tokens), and weights of at most 2**26 float16 numbers (128 MiB), about what a tab can draw.
MAX_LAYERS, MAX_HEADS, MAX_TOKENS, MAX_WEIGHTS = 64, 64, 1024, 2**26
MAX_CHARS = 256  # of one token, word, text name or note; no tokenizer makes longer ones
MAX_CONTENT_BYTES = 2**24  # a text's description holds the whole text, as long as it may be
MAX_HEAD_SIZE = 1024  # of the q, k and v served; Llama 3 405B's heads are 128 wide
SENTENCE_CHARS = 80  # of a text or a pair, as the pickers name it
# A patching report: effects per pair, layer, head and position that decode in a blink (GPT-2's
# 144 heads over 1,024 pairs of 64 tokens are 9.4M); within that, as many pairs as its
# description holds (MAX_CONTENT_BYTES): the shipped agreement set has 108.
MAX_PATCHED = 2**24
# Who wrote a text, from its name: training (the probe prompt at each evaluation), tinylm-probe
# (the clean text of a patched pair) or inspect=true (any other name).
TRAINING_TEXT, PROBE_TEXT = "probe_prompt", re.compile(r"patching/pair_(\d+)")
# A folder a killed writer left: hidden (tinylm's writers build in `.<name>.tmp-<pid>-<hex>`, and
# move an old folder aside as `.<name>.old-<pid>-<hex>`), or named `*.tmp` as other writers do.
LEFTOVER_PART = re.compile(r"^\.(?!\.?$)|\.tmp$|\.tmp-")


class Skipped(ValueError):
    """Something in the logdir that is not served; the message says why, for the tab."""


def require(ok: bool, why: str) -> None:
    if not ok:
        raise Skipped(why)


def is_int(value, low: int, high: int) -> bool:
    """An int (not a bool) with low <= value < high."""
    return type(value) is int and low <= value < high


def is_ints(values, low: int, high: int, n: int | None = None) -> bool:
    """A list (of n, where n is given) of ints with low <= each < high."""
    return (isinstance(values, list) and (n is None or len(values) == n)
            and all(is_int(v, low, high) for v in values))


def is_number(value) -> bool:
    """An int or float (not a bool) that strict JSON can hold: compared, not converted, so that
    an int of 400 digits is out of range, never an OverflowError."""
    return type(value) in (int, float) and abs(value) <= sys.float_info.max  # NaN: False


def is_text(value, most: int = MAX_CHARS) -> bool:
    return isinstance(value, str) and len(value) <= most


def is_texts(values, low: int, high: int) -> bool:
    """A list of low..high texts of at most MAX_CHARS characters."""
    return isinstance(values, list) and low <= len(values) <= high and all(map(is_text, values))


def is_shape(shape, bounds: list[tuple[int, int]], most: float = math.inf) -> bool:
    """A list of ints, each within its (low, high) bound, that holds at most `most` numbers."""
    return (isinstance(shape, list) and len(shape) == len(bounds)
            and all(is_int(n, low, high + 1)
                    for n, (low, high) in zip(shape, bounds, strict=True))
            and math.prod(shape) <= most)


def is_leftover(run: str) -> bool:
    """Whether a run lies in a folder a killed writer left behind (LEFTOVER_PART): not a run."""
    return any(LEFTOVER_PART.search(part) for part in re.split(r"[\\/]", run))


def sentence(text: str, ends: bool = False) -> str:
    """A text as a picker names it, its whitespace made single spaces: its first SENTENCE_CHARS
    characters, "…" where it was cut; with `ends`, its start and its end around the "…"."""
    if len(text) > 4 * SENTENCE_CHARS:  # only its ends can show: fold no more than those
        head = text[:2 * SENTENCE_CHARS]
        text = head + " " + text[-2 * SENTENCE_CHARS:] if ends else head
    text = " ".join(text.split())
    if len(text) <= SENTENCE_CHARS:
        return text
    if not ends:
        return text[:SENTENCE_CHARS - 1].rstrip() + "…"
    half = SENTENCE_CHARS // 2
    return text[:half].rstrip() + " … " + text[3 - half:].lstrip()


def read_description(raw: bytes | str, kind: str) -> dict:
    """A summary's JSON description, of this tinylm's format version; Skipped if it is not JSON
    (cut off, not UTF-8, nested deeper than Python's recursion limit) or not `kind`'s."""
    require(len(raw) <= MAX_CONTENT_BYTES, f"its description is over {MAX_CONTENT_BYTES} bytes")
    try:
        content = json.loads(raw)
    except (ValueError, RecursionError):  # UnicodeDecodeError is a ValueError
        raise Skipped("its description is not readable JSON (truncated?)") from None
    require(isinstance(content, dict) and "version" in content, f"its description is not {kind}")
    version = content["version"]
    require(version == FORMAT_VERSION, (
        f"written in {kind} format {str(version)[:20]}; this tinylm reads format "
        f"{FORMAT_VERSION} (write it again with this version)"))
    return content


def read_content(raw: bytes | str | dict) -> dict:
    """One text's description (or read_description's reading of it) as the tab reads it: the
    tokens the model read, their words (renumbered in order), the pronouns and names among them,
    each layer's key/value heads; bounded by its checked shape (L, nh, T, T)."""
    content = raw if isinstance(raw, dict) else read_description(raw, "tinylm attention")
    shape = content.get("shape")
    bounds = [(1, MAX_LAYERS), (1, MAX_HEADS), (1, MAX_TOKENS), (1, MAX_TOKENS)]
    require(is_shape(shape, bounds, MAX_WEIGHTS) and shape[3] == shape[2],
            f"its shape is not (layers <= {MAX_LAYERS}, heads <= {MAX_HEADS}, T, T) with "
            f"T <= {MAX_TOKENS} and at most {MAX_WEIGHTS} weights")
    n_layer, n_head, t = shape[:3]
    words, token_words = content.get("words"), content.get("token_words")
    require(isinstance(words, list) and is_texts(content.get("tokens"), t, t)
            and is_ints(token_words, -1, len(words), t),
            f"its tokens and their words are not {t} tokens of at most {MAX_CHARS} characters "
            "each, with a word index each")
    kept = sorted({w for w in token_words if w >= 0})  # the words of the tokens the model read
    number = {w: i for i, w in enumerate(kept)}
    served = {"version": content["version"], "name": content.get("name"),
              "step": content.get("step"), "shape": shape, "tokens": content["tokens"],
              "words": [words[w] for w in kept],
              "token_words": [number.get(w, -1) for w in token_words],
              "window_note": content.get("window_note", ""),
              # absent: every head has its own key/value head (tinylm's models, older data)
              "kv_heads": content.get("kv_heads", [n_head] * n_layer)}
    require(is_ints(served["kv_heads"], 1, n_head + 1, n_layer)
            and all(n_head % n == 0 for n in served["kv_heads"]),
            f"its kv_heads are not {n_layer} counts of key/value heads that divide its "
            f"{n_head} heads")
    for key in ("pronouns", "names"):
        require(is_ints(content.get(key), 0, len(words)), f"its {key} are not word indices")
        served[key] = sorted({number[w] for w in content[key] if w in number})
    require(is_text(served["name"]) and served["name"] != "" and is_int(served["step"], 0, 2**63)
            and all(map(is_text, served["words"])) and is_text(served["window_note"]),
            f"its name, step, words or note are not texts of at most {MAX_CHARS} characters "
            "and a step number")
    # what the readings may mean, from capture.py's lists (data of any age gets them): the
    # pronouns read against names (not "it"), and the gender of pronouns and listed names, so
    # that a head pointing at a name of the other gender is flagged
    shown, names = served["words"], set(served["names"])
    served["person_pronouns"] = [w for w in served["pronouns"] if shown[w] in PERSON_PRONOUNS]
    for gender, listed in (("female", FEMALE_NAMES), ("male", MALE_NAMES)):
        served[f"{gender}_words"] = [
            w for w, word in enumerate(shown)
            if (w in names and word in listed) or (w in served["person_pronouns"]
                                                   and PRONOUN_GENDER.get(word) == gender)]
    return served


def read_listed(raw: bytes | str) -> dict:
    """One text as /texts lists it: its name, its step, who wrote it and the start of its text."""
    description = read_description(raw, "tinylm attention")
    content, text = read_content(description), description.get("text")
    if not isinstance(text, str):  # a description without its text: its words
        text = " ".join(content["words"])
    name = content["name"]
    kind = ("training" if name == TRAINING_TEXT
            else "probe" if PROBE_TEXT.fullmatch(name) else "inspect")
    return {"name": name, "step": content["step"], "kind": kind, "sentence": sentence(text)}


def read_probe(raw: bytes | str) -> dict:
    """A tinylm-probe report's description: its item count, the accuracy of chance (0.5 where it
    does not say: two characters) and what it reads."""
    content = read_description(raw, "a tinylm-probe report")
    n, chance = content.get("n"), content.get("chance", 0.5)
    reads = content.get("reads", PROBE_READS)
    require(is_int(n, 0, 2**63), "its item count is not a number")
    require(is_number(chance) and 0 < chance < 1, "its chance level is not between 0 and 1")
    require(is_text(reads, 4 * MAX_CHARS),
            f"what it reads is not a text of at most {4 * MAX_CHARS} characters")
    return {"n": n, "chance": chance, "reads": reads}


def read_pair(pair, i: int, t_max: int) -> dict:
    """Pair i of a patching report: 1..t_max clean tokens, the deciding position among them,
    finite margins, its pronouns; its source cut to MAX_CHARS."""
    require(isinstance(pair, dict), f"its pair {i} is not an object")
    tokens = pair.get("tokens")
    require(is_texts(tokens, 1, t_max),
            f"its pair {i} has not 1..{t_max} tokens of at most {MAX_CHARS} characters")
    require(is_int(pair.get("position"), 0, len(tokens)),
            f"its pair {i}'s position is not one of its {len(tokens)} tokens")
    require(is_number(pair.get("m_clean")) and is_number(pair.get("m_counterfactual")),
            f"its pair {i}'s margins are not finite numbers")
    require(is_text(pair.get("pronoun")) and is_text(pair.get("wrong_pronoun"))
            and isinstance(pair.get("source"), str),
            f"its pair {i}'s source and pronouns are not texts")
    return {"source": pair["source"][:MAX_CHARS], "tokens": tokens,
            # the pair named as a class reads it: its clean text, up to and with its pronoun
            "text": sentence("".join(tokens) + pair["pronoun"], ends=True),
            **{key: pair[key] for key in ("position", "m_clean", "m_counterfactual", "pronoun",
                                          "wrong_pronoun")}}


def read_patching(raw: bytes | str) -> dict:
    """A patching report's description: its shape (P, L, nh, T_max), the pairs skipped, the
    intervals' level, its P pairs."""
    content = read_description(raw, "a tinylm patching report")
    shape = content.get("shape")
    bounds = [(0, MAX_PATCHED), (1, MAX_LAYERS), (1, MAX_HEADS), (0, MAX_TOKENS)]
    require(is_shape(shape, bounds, MAX_PATCHED),
            f"its shape is not (pairs, layers <= {MAX_LAYERS}, heads <= {MAX_HEADS}, "
            f"T <= {MAX_TOKENS}) with at most {MAX_PATCHED} effects")
    require(is_int(content.get("n_skipped"), 0, 2**63),
            "its count of skipped pairs is not a number")
    level = content.get("interval_level")
    require(level is None or (is_number(level) and 0 < level < 1),
            "its interval level is not a number between 0 and 1")
    pairs = content.get("pairs")
    require(isinstance(pairs, list) and len(pairs) == shape[0],
            f"its pairs are not a list of {shape[0]}")
    return {"shape": shape, "n_skipped": content["n_skipped"], "interval_level": level,
            "pairs": [read_pair(pair, i, shape[3]) for i, pair in enumerate(pairs)]}


def read_arithmetic(raw: bytes | str, shape: list[int]) -> dict:
    """The description of a text's q, k and v, against the text's shape (L, nh, T, T): its head
    size, its kept layers (each once, in order: key/value heads that divide nh, a scale or None,
    a band or None, rotary or not) and where each lies in the at most MAX_STORED numbers."""
    content = read_description(raw, "a tinylm arithmetic summary")
    n_layer, n_head, t = shape[:3]
    require(content.get("n_layer") == n_layer and content.get("n_head") == n_head
            and content.get("tokens") == t,
            f"its q, k and v are not of the text's {n_layer} layers x {n_head} heads over "
            f"{t} tokens")
    hs, layers = content.get("head_size"), content.get("layers")
    require(is_int(hs, 1, MAX_HEAD_SIZE + 1), f"its head size is not 1..{MAX_HEAD_SIZE}")
    require(isinstance(layers, list) and len(layers) <= n_layer,
            f"its layers are not a list of at most {n_layer}")
    kept, offset, seen = {}, 0, -1
    for meta in layers:
        require(isinstance(meta, dict) and is_int(meta.get("layer"), seen + 1, n_layer),
                "its layers are not layer numbers, each once, in order")
        seen, nkv, scale, window = (meta["layer"], meta.get("n_kv_head"), meta.get("scale"),
                                    meta.get("window"))
        require(is_int(nkv, 1, n_head + 1) and n_head % nkv == 0,
                f"layer {seen}'s key/value heads do not divide its {n_head} heads")
        require(scale is None or (is_number(scale) and scale != 0),
                f"layer {seen}'s scale is not a finite number")
        require(window is None or is_int(window, 1, 2**31),
                f"layer {seen}'s window is not a number of positions")
        require(isinstance(meta.get("rotary"), bool), f"layer {seen}'s rotary is not true/false")
        size = layer_numbers(n_head, nkv, hs, t)
        kept[seen] = {"n_kv_head": nkv, "scale": scale, "window": window,
                      "rotary": meta["rotary"], "offset": offset, "size": size}
        offset += size
        require(offset <= MAX_STORED, f"its q, k and v are over {MAX_STORED} numbers")
    for key in ("architecture", "dtype"):
        require(is_text(content.get(key)), f"its {key} is not a short text")
    require(is_text(content.get("not_stored"), 4096),
            "its note on the layers not kept is not a text of at most 4096 characters")
    return {"head_size": hs, "layers": kept, "size": offset,
            **{key: content[key] for key in ("architecture", "dtype", "not_stored")}}


def read_floats(array, what: str, shape: tuple, weights: bool = False) -> np.ndarray:
    """`array` if it holds floats of `shape`, all within 0..1 where they are `weights` (attention
    weights and accuracies); Skipped, saying why, if not."""
    require(isinstance(array, np.ndarray) and array.dtype.kind == "f" and array.shape == shape,
            f"{what} are not {' x '.join(map(str, shape))} numbers")
    # the comparisons also refuse NaN and infinities: every comparison with NaN is False
    require(not weights or bool(np.all((array >= 0) & (array <= 1))),
            f"{what} hold numbers outside 0..1 (NaN, infinite or negative)")
    return array


def read_grid(accuracy) -> np.ndarray:
    """A probe report's accuracies: a layer x head grid within the bounds, each in 0..1."""
    require(is_shape(list(accuracy.shape), [(1, MAX_LAYERS), (1, MAX_HEADS)]),
            f"its accuracies are not (layers <= {MAX_LAYERS}) x (heads <= {MAX_HEADS}) numbers")
    return read_floats(accuracy, "its accuracies", accuracy.shape, weights=True)
