"""Sizes a command cannot hold: refused in one line before any work, naming the largest that fits.

Each rule counts the bytes the work would hold from what the command is asked for (tokens to
generate, numbers to print, sequences per batch, bytes of a file to read), with the per-item
costs below measured by hand and rounded up, and compares them with the memory available now.
"""

from __future__ import annotations

from collections.abc import Callable

import psutil

from tinylm.model import ModelConfig

# What a sample holds per token until it is printed and returned: the id in the output buffer
# (8 bytes), the token's text piece (a str in a list) and its characters in the sample's text.
# Measured under 40 bytes with a byte-level BPE; counted 128, as a longer piece takes more.
TOKEN_BYTES = 128
# What inspecting one text holds, counted before it starts: per layer, head, query and key of the
# window, the weights as float32 twice (the model's, the capture's) and as float64 four times
# (the word-level readings): 40 bytes, counted 48. Per token of the whole text, its id,
# character span, word and characters: about 310 bytes measured, counted 512.
ATTENTION_BYTES, TEXT_TOKEN_BYTES = 48, 512
# Reading and tokenizing a prompt holds about 120 bytes per byte of it (measured: the text, its
# ids and character spans); counted 256, for the tokenizer's own copy.
PROMPT_BYTES = 256
# What the walkthrough holds per number it prints: the number in each step and its text in a table
# (a str in a list, its share of a line); counted 256 bytes. Reading a JSON or YAML file holds
# about 200 bytes per byte of it (the parser's nodes, then the lists of numbers); counted 512.
NUMBER_BYTES, QKV_FILE_BYTES = 256, 512


def refuse_unless_held(key: str, value: object, n: int, held: Callable[[int], float], rule: str,
                       unit: str | None = None) -> None:
    """Refuse `key=value` in one line, before any work, when the work would hold `held(n)` bytes
    (n: the count the value sets; held grows with it) and they do not fit in the memory available
    now. The line says `rule`, what the work holds, and the largest count that fits: as key=N,
    or as N `unit`s when given."""
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


def refuse_samples(c: ModelConfig, n_prompt: int, max_new_tokens: int, num_samples: int,
                   inspect: bool) -> None:
    """Refuse max_new_tokens or num_samples when the samples of a prompt of n_prompt tokens, and
    with inspect=true one text's inspection, cannot be held (key/value heads shared by query
    heads are counted as n_embd wide: an upper bound)."""
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


def refuse_prompt_file(shown: str, n_bytes: int) -> None:
    """Refuse a prompt_file of n_bytes (so far) when reading and tokenizing it cannot be held."""
    refuse_unless_held("prompt_file", shown, n_bytes, lambda n: n * PROMPT_BYTES,
                       "reading and tokenizing a prompt holds about "
                       f"{PROMPT_BYTES} bytes per byte of it", unit="bytes")


def refuse_qkv_file(path: str, n_bytes: int) -> None:
    """Refuse a qkv_file of n_bytes when parsing it cannot be held."""
    refuse_unless_held("qkv_file", path, n_bytes, lambda n: n * QKV_FILE_BYTES,
                       f"reading it holds about {QKV_FILE_BYTES} bytes per byte", unit="bytes")


def refuse_unprintable(key: str, n: int, unit: str | None, numbers: Callable[[int], int]) -> None:
    """Refuse a walkthrough that prints numbers(n) numbers (n: the `unit`s of `key`, e.g. q's
    rows) when their tables cannot be held."""
    refuse_unless_held(key, n if unit is None else f"[{n:,} {unit}]", n,
                       lambda m: numbers(m) * NUMBER_BYTES,
                       f"the walkthrough would print {numbers(n):,} numbers, about "
                       f"{NUMBER_BYTES} bytes each", unit)


def refuse_batch(c: ModelConfig, batch_size: int, passes: list[list[list[int]]]) -> None:
    """Refuse batch_size when a forward pass over a batch of the longest sequences of `passes`
    (each pass's sequences, as ids) cannot be held: per token its logits (float32) and
    activations (about 16 numbers of width n_embd), and per pair of tokens every head's
    attention, kept twice (the model's, stacked)."""
    longest = max((len(s) for sequences in passes for s in sequences), default=0)
    each = 4 * longest * (c.vocab_size + 16 * c.n_embd + 2 * c.n_layer * c.n_head * longest)
    largest_pass = max(len(sequences) for sequences in passes)
    refuse_unless_held("batch_size", batch_size, batch_size,
                       lambda n: min(n, largest_pass) * each,
                       f"a forward pass holds about {each:,} bytes per sequence of up to "
                       f"{longest} tokens (its logits and every head's attention)")
