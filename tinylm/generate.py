"""Sampling text from a trained tinylm, with a KV cache, streamed to the console.

    tinylm-generate checkpoint=runs/2025-01-01/12-00-00 prompt="Lily and Tom went to the park."
    python scripts/generate.py checkpoint=<run> prompt="Once upon a time" temperature=0

In code: `sample_next` picks one token from logits; `generate` runs the decoding loop;
`run_generate(GenerateConfig(...))` is what the command line calls (load, encode, stream, inspect).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from tinylm.checkpoint import default_logdir
from tinylm.config import ConfigError, bad, flag, integer, number, one_of
from tinylm.model import TinyLM
from tinylm.threads import apply_threads, check_threads_setting, start_sample

# The smallest temperature above 0. Sampling divides the logits by it: at 1e-45 every logit
# overflows float32 to +-inf and softmax returns NaN. Far above that, below 1e-3, sampling is
# already greedy but for near-exact ties (a logit gap of 0.01 leaves the runner-up e^-10), so a
# smaller value only adds the risk of overflow: temperature=0 (argmax) says greedy plainly.
MIN_TEMPERATURE = 1e-3


@dataclass
class GenerateConfig:
    """Options of tinylm-generate; the schema of conf/generate.yaml (defaults: here only)."""

    checkpoint: str | None = None  # a run directory, its checkpoints/, or one checkpoint directory
    prompt: str | None = ""  # empty: start from <|endoftext|>, i.e. a fresh story
    prompt_file: str | None = None  # read the prompt from this file instead
    max_new_tokens: int = 200
    temperature: float = 0.8  # 0 = greedy (always the most likely token)
    top_k: int | None = None  # sample only among the k most likely tokens
    top_p: float | None = None  # nucleus: the fewest tokens whose probabilities sum to >= top_p
    seed: int = 1337
    num_samples: int = 1
    device: str = "auto"
    use_cache: bool = True  # false: recompute the whole context at every step (slow, for checks)
    prefer: str = "best"  # which checkpoint of a run: best or last
    inspect: bool = False  # write every head's attention over the text to TensorBoard
    logdir: str | None = None  # where inspect writes; default <run dir>/inspect/<timestamp>
    top_words: int = 3  # inspect: earlier words listed per head for each pronoun
    threads: int | str = "auto"  # torch intra-op threads; auto: the idle usable cores

    def __post_init__(self):
        integer("max_new_tokens", self.max_new_tokens, least=0)
        if self.temperature != 0:
            try:
                number("temperature", self.temperature, low=MIN_TEMPERATURE)
            except ConfigError:
                raise bad("temperature", self.temperature, "must be 0 (greedy) or a finite "
                          f"number >= {MIN_TEMPERATURE:g}") from None
        integer("top_k", self.top_k, least=1, null="for no limit")
        number("top_p", self.top_p, 0, 1, low_open=True, null="for no limit")
        integer("seed", self.seed)
        integer("num_samples", self.num_samples, least=1)
        integer("top_words", self.top_words, least=1)
        flag("use_cache", self.use_cache)
        flag("inspect", self.inspect)
        one_of("prefer", self.prefer, ("best", "last"))
        if self.prompt and self.prompt_file:
            raise ValueError("give either prompt= or prompt_file=, not both")
        check_threads_setting("threads", self.threads)


def sample_next(
    logits: torch.Tensor,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
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
        # Drop a token when the more likely ones before it already reach top_p; the most likely
        # token always stays, so the distribution is never empty.
        drop_sorted = (cumulative - sorted_logits.softmax(dim=-1)) >= top_p
        drop = drop_sorted.scatter(-1, order, drop_sorted)  # back to vocabulary order
        logits = logits.masked_fill(drop, float("-inf"))
    probs = F.softmax(logits, dim=-1)
    return torch.multinomial(probs, num_samples=1, generator=generator).squeeze(-1)


@torch.inference_mode()
def generate(
    model: TinyLM,
    idx: torch.Tensor,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
    use_cache: bool = True,
    stop_id: int | None = None,
    on_token: Callable[[torch.Tensor], None] | None = None,
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
    kv_cache = model.new_kv_cache(B) if use_cache else None

    def context_logits(end: int) -> torch.Tensor:
        """Logits for the token after out[:, :end], reading its last block_size tokens."""
        if kv_cache is not None:
            for layer_cache in kv_cache:  # start a fresh window; the buffers are reused
                layer_cache.length = 0
        return model(out[:, max(0, end - block_size):end], kv_cache=kv_cache).logits[:, -1, :]

    end = T
    logits = context_logits(end) if max_new_tokens > 0 else None
    for step in range(max_new_tokens):
        next_id = sample_next(logits, temperature, top_k, top_p, generator)  # (B,)
        if stop_id is not None:
            next_id = next_id.masked_fill(finished, stop_id)
            finished |= next_id == stop_id
        out[:, end] = next_id
        end += 1
        if on_token is not None:
            on_token(next_id)
        # .all() waits for the device; it is only paid for when there is a stop token
        if step == max_new_tokens - 1 or (stop_id is not None and bool(finished.all())):
            break
        if kv_cache is not None and kv_cache[0].length < block_size:
            # the cache holds everything before next_id: feed just the new token
            logits = model(next_id[:, None], kv_cache=kv_cache).logits[:, -1, :]
        else:
            # Without a cache, or once the window is full: run the last block_size tokens again
            # from position 0 (a sliding window). With the cache this re-prefill happens at every
            # step past block_size, which is exactly what the cache-free path computes, so both
            # paths keep giving the same tokens however long the text gets.
            logits = context_logits(end)
    return out[:, :end]


class StreamDecoder:
    """Turns token ids into printable text one token at a time.

    A byte-level token can end in the middle of a multi-byte character (é, emoji); its text then
    ends in U+FFFD. Such tokens are held back until the character is complete.
    """

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.pending: list[int] = []

    def push(self, token_id: int) -> str:
        """Add one token; return the text that is now complete (possibly empty)."""
        self.pending.append(token_id)
        text = self.tokenizer.decode(self.pending)
        if text.endswith("\ufffd") and len(self.pending) < 4:  # a UTF-8 char is at most 4 bytes
            return ""
        self.pending = []
        return text

    def flush(self) -> str:
        """Whatever is still held back (an incomplete character at the very end)."""
        text = self.tokenizer.decode(self.pending) if self.pending else ""
        self.pending = []
        return text


def encode_prompt(tokenizer, text: str, block_size: int) -> tuple[list[int], int]:
    """Prompt ids, cropped to the last block_size tokens; returns (ids, n_dropped).

    An empty prompt becomes [<|endoftext|>]: the model starts a new document.
    """
    ids = tokenizer.encode(text) if text else []
    if not ids:
        return [tokenizer.eot_id], 0
    dropped = max(0, len(ids) - block_size)
    return ids[dropped:], dropped


def _read_prompt(cfg: GenerateConfig) -> str:
    if not cfg.prompt_file:
        return cfg.prompt
    path = Path(cfg.prompt_file)
    if path.is_dir():
        raise ValueError(f"prompt_file={path} is a directory; name a UTF-8 text file")
    if not path.is_file():
        raise FileNotFoundError(f"prompt_file {path} does not exist")
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise ValueError(f"prompt_file {path} is not UTF-8 text (byte {err.start}: "
                         f"{err.reason})") from None


def run_generate(cfg: GenerateConfig, out=None) -> list[str]:
    """Load the checkpoint, stream num_samples continuations to `out`, optionally inspect them.

    Returns the generated texts (without the prompt). Notes go to stderr, text to `out` (stdout).
    """
    from tinylm.checkpoint import load_checkpoint
    from tinylm.device import resolve_device

    cpu_sample = start_sample()
    out = out or sys.stdout
    if not cfg.checkpoint:
        raise ValueError("checkpoint= is required: a run directory or a checkpoint directory")
    device = resolve_device(cfg.device)
    ckpt = load_checkpoint(cfg.checkpoint, device=device, prefer=cfg.prefer)
    threads = apply_threads(cfg.threads, cpu_sample)
    model, tokenizer = ckpt.model, ckpt.tokenizer
    block_size = model.config.block_size
    prompt = _read_prompt(cfg) or ""  # prompt=null reads as empty
    prompt_ids, dropped = encode_prompt(tokenizer, prompt, block_size)
    if dropped:
        # the text the model actually reads, so the streamed output lines up with it
        prompt = tokenizer.decode(prompt_ids)
        print(f"note: the prompt has {len(prompt_ids) + dropped} tokens, more than "
              f"block_size={block_size}; keeping its last {block_size} tokens", file=sys.stderr)
    print(f"loaded {ckpt.directory} ({model.num_params() / 1e6:.2f}M parameters, "
          f"block_size={block_size}) on {device}"
          f"{f', {threads.describe()}' if device.type == 'cpu' else ''}", file=sys.stderr)

    generator = torch.Generator(device=device).manual_seed(cfg.seed)
    idx = torch.tensor([prompt_ids], dtype=torch.long, device=device)
    texts = []
    for i in range(cfg.num_samples):
        if cfg.num_samples > 1:
            print(f"--- sample {i + 1}/{cfg.num_samples} ---", file=out, flush=True)
        print(prompt, end="", file=out, flush=True)
        stream = StreamDecoder(tokenizer)
        pieces: list[str] = []

        def show(next_id: torch.Tensor, stream=stream, pieces=pieces) -> None:
            token = int(next_id[0])
            if token != tokenizer.eot_id:
                pieces.append(stream.push(token))
                print(pieces[-1], end="", file=out, flush=True)

        start = time.perf_counter()
        seq = generate(model, idx, cfg.max_new_tokens, cfg.temperature, cfg.top_k, cfg.top_p,
                       generator, cfg.use_cache, stop_id=tokenizer.eot_id, on_token=show)
        seconds = time.perf_counter() - start
        pieces.append(stream.flush())
        print(pieces[-1], file=out, flush=True)
        n_new = seq.size(1) - idx.size(1)
        stopped = n_new > 0 and int(seq[0, -1]) == tokenizer.eot_id
        print(f"[{n_new} tokens in {seconds:.2f}s, {n_new / max(seconds, 1e-9):.0f} tokens/s"
              f"{', stopped at <|endoftext|>' if stopped else ''}]", file=sys.stderr)
        texts.append("".join(pieces))

    if cfg.inspect:
        from tinylm.inspection_output import inspect_texts

        logdir = Path(cfg.logdir) if cfg.logdir else default_logdir(ckpt.directory)
        # the prompt as the user wrote it (an empty prompt's <|endoftext|> is not text)
        inspect_texts(model, tokenizer, [prompt + text for text in texts], logdir,
                      prompt_chars=len(prompt), top_words=cfg.top_words,
                      meta={"checkpoint": str(ckpt.directory), **asdict(cfg)},
                      out=lambda line: print(line, flush=True))
        print(f"\nopen the attention maps with:\n  tensorboard --logdir {logdir}")
    return texts
