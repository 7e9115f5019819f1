"""Sizes a command cannot hold, refused in one line before any work, naming the largest that fits.
Each rule counts the bytes the work would hold from what it is asked for, with per-item costs
measured by hand and rounded up, against the memory available now."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import psutil

from tinylm.files import read_regular_file
from tinylm.model import ModelConfig

# A sample's token until printed: its id, its text piece (a str in a list) and its characters;
# measured under 40 bytes with a byte-level BPE, counted 128 (a longer piece takes more)
TOKEN_BYTES = 128
# Inspecting a text: per layer, head, query and key of the window, the weights as float32 twice
# and float64 four times (40 bytes); per token of the text, its id, span, word and characters
# (about 310 measured)
ATTENTION_BYTES, TEXT_TOKEN_BYTES = 48, 512
# Per byte of a prompt read and tokenized: about 120 measured (text, ids, spans), and the
# tokenizer's own copy
PROMPT_BYTES = 256
# Per number the walkthrough prints (in each step, and as text in a table); per byte of a JSON or
# YAML file parsed (about 200 measured: the parser's nodes, then the lists of numbers)
NUMBER_BYTES, QKV_FILE_BYTES = 256, 512


def refuse_unless_held(key: str, value: object, n: int, held: Callable[[int], float], rule: str,
                       unit: str | None = None) -> None:
    """Refuse `key=value` when the work would hold `held(n)` bytes (n: the count the value sets)
    and they do not fit in the memory available now; the line says `rule` and the largest count
    that fits, as key=N or, given `unit`, as N units."""
    available = psutil.virtual_memory().available
    if held(n) <= available:
        return
    fits, too_many = 0, n  # the largest count that fits lies in [fits, too_many)
    while too_many - fits > 1:
        middle = (fits + too_many) // 2
        fits, too_many = (middle, too_many) if held(middle) <= available else (fits, middle)
    allowed = f"at most {key}={fits}" if unit is None else f"{key} with at most {fits:,} {unit}"
    raise ValueError(f"{key}={value} is more than the memory can hold: {rule}, and "
                     f"{available / 2**20:,.0f} MiB are available now; give {allowed}")


def read_if_held(key: str, path: str, per_byte: int, rule: str) -> bytes:
    """The bytes of the regular file `key`=`path`, refused before a byte is read where holding
    `per_byte` bytes per byte of it (`rule` says why) does not fit in memory."""
    size = Path(path).stat().st_size if Path(path).is_file() else 0  # others: refused unread
    refuse_unless_held(key, path, size, lambda n: n * per_byte, rule, unit="bytes")
    return read_regular_file(path, size, key)  # one that grows meanwhile stops there


def refuse_samples(c: ModelConfig, n_prompt: int, max_new_tokens: int, num_samples: int,
                   inspect: bool) -> None:
    """Refuse max_new_tokens or num_samples when the samples of a prompt of n_prompt tokens, and
    with inspect=true one text's inspection, cannot be held (KV heads counted n_embd wide)."""
    def fixed(n: int) -> int:
        window = min(c.block_size, n_prompt + n + 1)  # the positions the KV cache is made for
        held = 2 * c.n_layer * window * c.n_embd * 4  # float32 keys and values
        if inspect:
            held += ATTENTION_BYTES * c.n_layer * c.n_head * window ** 2
        return held
    each = TOKEN_BYTES + (TEXT_TOKEN_BYTES if inspect else 0)
    rule = f"each token of a sample holds about {each} bytes" + (
        " (with inspect=true, its attention reading)" if inspect else "")
    refuse_unless_held("max_new_tokens", max_new_tokens, max_new_tokens,
                       lambda n: fixed(n) + (n_prompt + 1 + n) * each, rule)
    tokens = n_prompt + max_new_tokens + 1
    refuse_unless_held("num_samples", num_samples, num_samples,
                       lambda n: fixed(max_new_tokens) + tokens * each
                       + (n - 1) * tokens * TOKEN_BYTES,
                       f"each sample of {n_prompt} + max_new_tokens={max_new_tokens} tokens "
                       f"holds about {tokens * TOKEN_BYTES:,} bytes")


def refuse_unprintable(key: str, n: int, unit: str | None, numbers: Callable[[int], int]) -> None:
    """Refuse a walkthrough that prints numbers(n) numbers (n: the `unit`s of `key`, e.g. q's
    rows) when their tables cannot be held."""
    refuse_unless_held(key, n if unit is None else f"[{n:,} {unit}]", n,
                       lambda m: numbers(m) * NUMBER_BYTES,
                       f"the walkthrough would print {numbers(n):,} numbers, about "
                       f"{NUMBER_BYTES} bytes each", unit)


def refuse_batch(c: ModelConfig, batch_size: int, passes: list[list[list[int]]]) -> None:
    """Refuse batch_size when a forward pass over a batch of the longest sequences of `passes`
    cannot be held: per token its logits and activations (about 16 numbers of width n_embd),
    per pair of tokens every head's attention, kept twice (the model's, stacked)."""
    longest = max((len(s) for sequences in passes for s in sequences), default=0)
    each = 4 * longest * (c.vocab_size + 16 * c.n_embd + 2 * c.n_layer * c.n_head * longest)
    largest_pass = max(len(sequences) for sequences in passes)
    refuse_unless_held("batch_size", batch_size, batch_size,
                       lambda n: min(n, largest_pass) * each,
                       f"a forward pass holds about {each:,} bytes per sequence of up to "
                       f"{longest} tokens (its logits and every head's attention)")
