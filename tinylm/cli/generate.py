"""tinylm-generate: sample text from a checkpoint, streamed; inspect=true adds attention maps
(examples in conf/generate.yaml; the sampling itself is tinylm/generate.py)."""

from __future__ import annotations

import shlex
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch

from tinylm.cli import command
from tinylm.cli.loading import load_for_command, report_dir
from tinylm.cli.sizes import PROMPT_BYTES, read_if_held, refuse_samples
from tinylm.config import ConfigError, at_least, bad, check, choice, number, within
from tinylm.device import check_threads_setting
from tinylm.generate import MIN_TEMPERATURE, StreamDecoder, encode_prompt, generate


def temperature_rule(key: str, value: Any) -> None:
    """A temperature: 0 (greedy), or a finite number >= MIN_TEMPERATURE."""
    try:
        number(key, value, low=0 if value == 0 else MIN_TEMPERATURE)
    except ConfigError:
        raise bad(key, value, "must be 0 (greedy) or a finite number >= "
                  f"{MIN_TEMPERATURE:g}") from None


@dataclass
class GenerateConfig:
    """Options of tinylm-generate; the schema of conf/generate.yaml (defaults: here only)."""

    checkpoint: str | None = None  # a run directory, its checkpoints/, or one checkpoint directory
    prompt: str | None = ""  # empty: start from <|endoftext|> (or the model's BOS): a fresh story
    prompt_file: str | None = None  # read the prompt from this UTF-8 file instead (its last
    #                                   line break dropped: the text goes on after the last word)
    max_new_tokens: int = 200  # tokens to sample after the prompt
    temperature: float = 0.8  # 0 = greedy (always the most likely token)
    top_k: int | None = None  # sample only among the k most likely tokens
    top_p: float | None = None  # nucleus: the fewest tokens whose probabilities sum to >= top_p
    seed: int = 1337  # sampling seed: the same seed and options give the same text
    num_samples: int = 1  # texts to sample from the prompt
    device: str = "auto"  # auto (cuda where there is one, else cpu), cpu, cuda, cuda:N, mps
    use_cache: bool = True  # false: recompute the whole context at every step (slow, for checks)
    prefer: str = "best"  # which checkpoint of a run: best or last
    inspect: bool = False  # write every head's attention over the text to TensorBoard
    logdir: str | None = None  # where inspect writes; default <run dir>/inspect/<timestamp>;
    #                            one holding an earlier report: a new <timestamp> folder in it
    top_words: int = 3  # inspect: earlier words listed per head for each pronoun
    threads: int | str = "auto"  # torch intra-op threads; auto: the idle usable cores

    def __post_init__(self):
        check(self, max_new_tokens=at_least(0), temperature=temperature_rule,
              top_k=at_least(1, null="for no limit"),
              top_p=within(0, 1, low_open=True, null="for no limit"), num_samples=at_least(1),
              prefer=choice("best", "last"), top_words=at_least(1), threads=check_threads_setting)
        if not -2**63 <= self.seed < 2**64:
            raise bad("seed", self.seed, "must be an integer in [-2**63, 2**64): torch's "
                      "generators take a 64-bit seed")
        if self.prompt and self.prompt_file:
            raise ConfigError("give either prompt= or prompt_file=, not both")


def _read_prompt(cfg: GenerateConfig, tokenizer) -> str:
    """prompt=, or the UTF-8 text of prompt_file= without the line break that ends its last
    line (an editor adds one: the text goes on after "She", not on a new line)."""
    if not cfg.prompt_file:
        return cfg.prompt
    data = read_if_held("prompt_file", cfg.prompt_file, PROMPT_BYTES, "reading and tokenizing a "
                        f"prompt holds about {PROMPT_BYTES} bytes per byte of it")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise ValueError(f"prompt_file {cfg.prompt_file} is not UTF-8 text (byte {err.start}: "
                         f"{err.reason})") from None
    text = text.replace("\r\n", "\n").replace("\r", "\n").removesuffix("\n")
    if not text:
        start = "".join(tokenizer.token_strings(encode_prompt(tokenizer, "", 1)[0]))
        print(f"note: prompt_file={cfg.prompt_file} is empty: starting from {start}, a fresh "
              "story", file=sys.stderr)
    return text


def run_generate(cfg: GenerateConfig, out=None) -> list[str]:
    """Stream num_samples continuations of the prompt to `out` (stdout), with inspect=true the
    inspection's summary too; notes go to stderr. Returns the texts, without the prompt."""
    out = out or sys.stdout
    loaded = load_for_command(cfg.checkpoint, cfg.device, cfg.prefer, cfg.threads)
    ckpt, device = loaded.checkpoint, loaded.device
    model, tokenizer = ckpt.model, ckpt.tokenizer
    block_size = model.config.block_size
    prompt = _read_prompt(cfg, tokenizer) or ""  # prompt=null reads as empty
    prompt_ids, dropped = encode_prompt(tokenizer, prompt, block_size)
    refuse_samples(model.config, len(prompt_ids), cfg.max_new_tokens, cfg.num_samples,
                   cfg.inspect)
    if dropped:
        # the text the model actually reads, so the streamed output lines up with it
        prompt = tokenizer.decode(prompt_ids)
        print(f"note: the prompt has {len(prompt_ids) + dropped} tokens, more than "
              f"block_size={block_size}; keeping its last {block_size} tokens", file=sys.stderr)
    print(loaded.line(f"{model.num_params() / 1e6:.2f}M parameters, block_size={block_size}"),
          file=sys.stderr)

    end = tokenizer.token_strings([tokenizer.eot_id])[0]  # <|endoftext|>, Llama's </s>, ...
    generator = torch.Generator(device=device).manual_seed(cfg.seed)
    idx = torch.tensor([prompt_ids], dtype=torch.long, device=device)
    texts = []
    for i in range(cfg.num_samples):
        if cfg.num_samples > 1:
            print(f"--- sample {i + 1}/{cfg.num_samples} ---", file=out, flush=True)
        print(prompt, end="", file=out, flush=True)
        stream = StreamDecoder(tokenizer, prompt_ids)  # the text continues the prompt
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
              f"{f', stopped at {end}' if stopped else ''}]", file=sys.stderr)
        texts.append("".join(pieces))

    if cfg.inspect:
        # deliberately lazy: matplotlib and TensorBoard's writer cost a plain generate ~1 s
        from tinylm.inspection.report import inspect_texts

        logdir, note = report_dir(cfg.logdir, ckpt.directory, "inspect")
        if note:
            print(note, file=sys.stderr)
        # the prompt as the user wrote it (an empty prompt's <|endoftext|> is not text)
        inspect_texts(model, tokenizer, [prompt + text for text in texts], logdir,
                      prompt_chars=len(prompt), top_words=cfg.top_words,
                      meta={"checkpoint": str(ckpt.directory), **asdict(cfg)},
                      out=lambda line: print(line, file=out, flush=True))
        print(f"\nopen the attention maps with:\n  tensorboard --logdir "
              f"{shlex.quote(str(logdir))}", file=out)
    return texts


main = command("tinylm-generate", "generate", GenerateConfig, run_generate)


if __name__ == "__main__":
    main()
