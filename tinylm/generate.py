"""Sampling text from a trained tinylm, with a KV cache, one token at a time.

`generate` runs the decoding loop and hands each new token to a callback, `sample_next` picks
one token from logits, `StreamDecoder` turns tokens into printable text and `encode_prompt`
crops a prompt to the context. The command is tinylm-generate (tinylm/cli/generate.py):

    tinylm-generate checkpoint=runs/2025-01-01/12-00-00 prompt="Lily and Tom went to the park."
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from tinylm import fast
from tinylm.model import TinyLM

# The smallest temperature above 0: sampling divides the logits by it, and far smaller ones
# overflow float32 (NaN) while sampling is already greedy here; temperature=0 says greedy plainly.
MIN_TEMPERATURE = 1e-3


def sample_next(logits: torch.Tensor, temperature: float = 1.0, top_k: int | None = None,
                top_p: float | None = None, generator: torch.Generator | None = None
                ) -> torch.Tensor:
    """Pick the next token from logits (B, V) -> ids (B,). temperature 0 = greedy (argmax)."""
    if temperature == 0:
        return logits.argmax(dim=-1)
    logits = logits.float() / temperature  # < 1 sharpens the distribution, > 1 flattens it
    if top_k is not None and top_k < logits.size(-1):
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]  # (B, 1) the k-th largest
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        # Drop a token when the more likely ones before it already reach top_p. The most likely
        # token always stays, so the distribution is never empty: said outright, since a top_p
        # below float32's smallest number (1e-46) compares as 0, and 0 >= 0 would drop it too.
        drop_sorted = (cumulative - sorted_logits.softmax(dim=-1)) >= top_p
        drop_sorted[:, 0] = False
        drop = drop_sorted.scatter(-1, order, drop_sorted)  # back to vocabulary order
        logits = logits.masked_fill(drop, float("-inf"))
    probs = F.softmax(logits, dim=-1)
    return torch.multinomial(probs, num_samples=1, generator=generator).squeeze(-1)


@torch.inference_mode()
def generate(model: TinyLM, idx: torch.Tensor, max_new_tokens: int, temperature: float = 1.0,
             top_k: int | None = None, top_p: float | None = None,
             generator: torch.Generator | None = None, use_cache: bool = True,
             stop_id: int | None = None, on_token: Callable[[torch.Tensor], None] | None = None
             ) -> torch.Tensor:
    """Continue idx (B, T) by up to max_new_tokens tokens; returns (B, T + n_new).

    A prompt longer than block_size is read through its last block_size tokens. Once a row emits
    `stop_id` it is padded with stop_id, and decoding ends when every row has stopped.
    `on_token(ids (B,))` is called with each new token, e.g. to stream text.
    """
    B, T = idx.size()
    if T == 0:
        raise ValueError("generate needs at least one token to start from (e.g. <|endoftext|>)")
    block_size = model.config.block_size
    # One buffer for the whole sequence: each step writes one column, nothing is re-allocated.
    out = torch.empty(B, T + max_new_tokens, dtype=torch.long, device=idx.device)
    out[:, :T] = idx
    finished = torch.zeros(B, dtype=torch.bool, device=idx.device)
    # room for this text, not the whole context: a pretrained context can be long (Llama 3.2:
    # 131,072 positions), and a cache that size would take gigabytes before the first token
    kv_cache = model.new_kv_cache(B, min(block_size, T + max_new_tokens)) if use_cache else None
    with fast.cpu_decoding(model):  # a float32 CPU model's steps set up to run fastest
        for end in range(T, T + max_new_tokens):
            if end > T and kv_cache is not None and kv_cache.length < block_size:
                # the cache holds everything before the last token: feed just that one
                logits = model(out[:, end - 1:end], kv_cache=kv_cache).logits[:, -1, :]
            else:
                # The first step, without a cache, or once the window is full: run the last
                # block_size tokens again from position 0 (a sliding window), so that both paths
                # keep giving the same tokens however long the text gets.
                if kv_cache is not None:
                    kv_cache.reset()  # the buffers are reused
                window = out[:, max(0, end - block_size):end]
                logits = model(window, kv_cache=kv_cache).logits[:, -1, :]
            next_id = sample_next(logits, temperature, top_k, top_p, generator)  # (B,)
            if stop_id is not None:
                next_id = next_id.masked_fill(finished, stop_id)
                finished |= next_id == stop_id
            out[:, end] = next_id
            if on_token is not None:
                on_token(next_id)
            # .all() waits for the device; it is only paid for when there is a stop token
            if stop_id is not None and bool(finished.all()):
                return out[:, :end + 1]
        return out


class StreamDecoder:
    """Turns token ids into printable text one token at a time.

    A token's text can depend on the tokens before it: a SentencePiece-style decoder (Llama 2's,
    TinyLlama's: "▁cat" for " cat") strips the space that starts a text, so each token decoded
    alone would lose its space. Each step therefore decodes the pending tokens after the ones
    printed last (at first, the prompt's `context`) and returns what they add.

    A byte-level token can end in the middle of a multi-byte character (é, emoji); its text then
    ends in U+FFFD. Such tokens are held back until the character is complete.
    """

    def __init__(self, tokenizer, context: list[int] | None = None):
        self.tokenizer = tokenizer
        self.context = list(context or [])  # the tokens the pending ones follow
        self.pending: list[int] = []

    def _added(self) -> str:
        """The text the pending tokens add after the context."""
        before = self.tokenizer.decode(self.context)
        text = self.tokenizer.decode(self.context + self.pending)
        if text.startswith(before):
            return text[len(before):]
        # the seam decodes otherwise (a run of byte tokens that the pending ones cut differently):
        # the pending tokens on their own
        return self.tokenizer.decode(self.pending)

    def push(self, token_id: int) -> str:
        """Add one token; return the text that is now complete (possibly empty)."""
        self.pending.append(token_id)
        text = self._added()
        if text.endswith("\ufffd") and len(self.pending) < 4:  # a UTF-8 char is at most 4 bytes
            return ""
        # the next tokens follow these; an incomplete character given up on starts nothing
        self.context = [] if text.endswith("\ufffd") else self.pending
        self.pending = []
        return text

    def flush(self) -> str:
        """Whatever is still held back (an incomplete character at the very end)."""
        text = self._added() if self.pending else ""
        self.pending = []
        return text


def encode_prompt(tokenizer, text: str, block_size: int) -> tuple[list[int], int]:
    """Prompt ids, cropped to the last block_size tokens; returns (ids, n_dropped).

    An empty prompt becomes [<|endoftext|>] (the tokenizer's end-of-text token), or the BOS token a
    pretrained model's tokenizer starts every text with: the model starts a new document.
    """
    ids = tokenizer.encode(text) if text else []
    if not ids:
        return [tokenizer.eot_id], 0
    dropped = max(0, len(ids) - block_size)
    return ids[dropped:], dropped
