"""Behaviour of tinylm.generate and tinylm-generate: sampling, the KV cache, prompts, streaming."""

import dataclasses
import json
import os
import re
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from helpers import compose, llama_texts, refusal, run_cli, save_run, to_dataclass
from omegaconf import OmegaConf
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, normalizers, pre_tokenizers, processors, trainers

import tinylm.cli.generate
import tinylm.cli.sizes
from tinylm.checkpoint import resolve_checkpoint_dir
from tinylm.cli.generate import GenerateConfig, main, run_generate
from tinylm.generate import StreamDecoder, encode_prompt, generate, sample_next
from tinylm.tokenizer import BPETokenizer, CharTokenizer


@pytest.fixture
def tiny_model(tiny_model):
    """conftest's tiny models made to this file's measure: block_size 16, which decoding runs
    past, and n_embd 32."""
    def build(vocab_size, seed=0, **overrides):
        return tiny_model(vocab_size, seed, **{"block_size": 16, "n_embd": 32, **overrides})
    return build


# ---- sampling -------------------------------------------------------------------------------

def test_temperature_zero_is_greedy():
    logits = torch.randn(4, 50)
    assert torch.equal(sample_next(logits, temperature=0.0), logits.argmax(dim=-1))


def test_top_k_samples_only_the_k_most_likely_tokens():
    logits = torch.randn(1, 50).expand(300, 50)  # 300 draws from one distribution
    allowed = set(torch.topk(logits[0], 5).indices.tolist())
    gen = torch.Generator().manual_seed(0)
    drawn = set(sample_next(logits, 2.0, top_k=5, generator=gen).tolist())
    assert drawn <= allowed
    assert len(drawn) > 1  # still sampling, not greedy


def test_top_p_samples_only_the_smallest_nucleus():
    probs = torch.tensor([0.05, 0.5, 0.15, 0.3])  # sorted: 0.5, 0.3 | 0.15, 0.05
    logits = probs.log().expand(400, 4)
    gen = torch.Generator().manual_seed(0)
    assert set(sample_next(logits, 1.0, top_p=0.7, generator=gen).tolist()) == {1, 3}
    assert set(sample_next(logits, 1.0, top_p=0.9, generator=gen).tolist()) == {1, 3, 2}
    # a tiny top_p still keeps the most likely token
    assert set(sample_next(logits, 1.0, top_p=0.01, generator=gen).tolist()) == {1}


@pytest.mark.parametrize("top_p", [1e-46, 5e-324, 1e-45])
def test_a_top_p_that_float32_rounds_to_0_keeps_the_most_likely_token(top_p):
    """1e-46 is 0 in float32: every token reached it, the most likely one too, and sampling from
    nothing was a RuntimeError; the most likely token stays, as for any small top_p."""
    probs = torch.tensor([0.05, 0.5, 0.15, 0.3])
    logits = probs.log().expand(50, 4)
    drawn = sample_next(logits, 0.8, top_k=3, top_p=top_p, generator=torch.Generator())
    assert set(drawn.tolist()) == {1}
    assert GenerateConfig(top_p=top_p).top_p == top_p  # the command takes it, as any top_p > 0


def test_same_seed_gives_the_same_samples():
    logits = torch.randn(8, 100)

    def draw(seed):
        gen = torch.Generator().manual_seed(seed)
        return torch.stack([sample_next(logits, 1.0, 20, 0.95, gen) for _ in range(5)])

    assert torch.equal(draw(1), draw(1))
    assert not torch.equal(draw(1), draw(2))


# ---- decoding -------------------------------------------------------------------------------

def test_greedy_decoding_with_and_without_cache_gives_the_same_tokens(tiny_model):
    model = tiny_model(60, seed=3)
    idx = torch.randint(0, 60, (2, 5))
    # 40 new tokens run well past block_size=16, through the sliding-window re-prefill
    cached = generate(model, idx, 40, temperature=0.0, use_cache=True)
    uncached = generate(model, idx, 40, temperature=0.0, use_cache=False)
    assert cached.shape == (2, 45)
    assert torch.equal(cached, uncached)
    assert torch.equal(cached[:, :5], idx)


def test_uncached_greedy_step_is_the_argmax_of_the_last_block(tiny_model):
    model = tiny_model(60, seed=4)
    idx = torch.randint(0, 60, (1, 20))  # longer than block_size: only the last 16 are read
    out = generate(model, idx, 1, temperature=0.0)
    expected = model(idx[:, -16:]).logits[0, -1].argmax()
    assert out[0, -1] == expected


def test_sampling_with_the_same_seed_repeats_itself(tiny_model):
    model = tiny_model(60, seed=5)
    idx = torch.zeros(1, 1, dtype=torch.long)

    def sample(seed):
        return generate(model, idx, 20, 1.0, top_k=10,
                        generator=torch.Generator().manual_seed(seed))

    assert torch.equal(sample(7), sample(7))
    assert not torch.equal(sample(7), sample(8))


def test_generation_stops_at_the_stop_token_and_pads_finished_rows(tiny_model):
    model = tiny_model(60, seed=6)
    idx = torch.randint(0, 60, (2, 4))
    free = generate(model, idx, 10, temperature=0.0)
    stop = int(free[0, 4])  # row 0's first new token
    streamed = []
    out = generate(model, idx, 10, temperature=0.0, stop_id=stop,
                   on_token=lambda ids: streamed.append(ids.tolist()))
    assert out[0, 4] == stop and (out[0, 4:] == stop).all()  # row 0 stopped, padded
    if stop not in free[1].tolist():
        assert out.size(1) == 14  # row 1 never stops: runs to max_new_tokens
    assert len(streamed) == out.size(1) - 4


def seen_while_decoding(model, idx, look, n, on_token=None):
    """look() at each new token of a greedy generate() of n tokens -> (the tokens, each look)."""
    seen = []

    def record(ids):
        seen.append(look())
        if on_token is not None:
            on_token(ids)

    return generate(model, idx, n, temperature=0.0, on_token=record), seen


def onednn_states_while_decoding(model, idx, n=4, on_token=None):
    """torch.backends.mkldnn.enabled as seen at each new token of a greedy generate()."""
    return seen_while_decoding(model, idx, lambda: torch.backends.mkldnn.enabled, n, on_token)


def test_float32_cpu_decoding_runs_without_onednn_and_gives_the_forwards_tokens(tiny_model):
    model = tiny_model(60, seed=7)
    idx = torch.randint(0, 60, (1, 4))
    out, seen = onednn_states_while_decoding(model, idx, 6)
    assert seen == [False] * 6
    assert torch.backends.mkldnn.enabled  # switched back afterwards
    # the same tokens as greedy steps of the plain forward, which runs oneDNN's GELU
    seq = idx
    with torch.no_grad():
        for _ in range(6):
            seq = torch.cat([seq, model(seq).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(out, seq)

    def interrupt(ids):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        onednn_states_while_decoding(model, idx, on_token=interrupt)
    assert torch.backends.mkldnn.enabled  # also when decoding is interrupted


def test_bf16_autocast_and_a_caller_switched_off_onednn_are_left_as_they_are(tiny_model):
    idx = torch.randint(0, 60, (1, 4))
    _, seen = onednn_states_while_decoding(tiny_model(60, seed=8).to(torch.bfloat16), idx)
    assert seen == [True] * 4  # bf16 matmuls run in oneDNN on a CPU
    with torch.autocast("cpu", dtype=torch.bfloat16):
        _, seen = onednn_states_while_decoding(tiny_model(60, seed=8), idx)
    assert seen == [True] * 4
    torch.backends.mkldnn.enabled = False
    try:
        _, seen = onednn_states_while_decoding(tiny_model(60, seed=8), idx)
        assert seen == [False] * 4 and not torch.backends.mkldnn.enabled  # not switched on
    finally:
        torch.backends.mkldnn.enabled = True


def matrix_layouts_while_decoding(model, idx, on_token=None):
    """The stride of every matrix of `model` at each of 3 new tokens of a greedy generate()."""
    def strides():
        return [p.stride() for p in model.parameters() if p.dim() == 2]
    return seen_while_decoding(model, idx, strides, 3, on_token)[1]


def test_float32_cpu_decoding_reads_the_matrices_by_column_and_puts_them_back(tiny_model):
    model = tiny_model(60, seed=9)
    idx = torch.randint(0, 60, (1, 4))
    matrices = [p for p in model.parameters() if p.dim() == 2]  # the tied head counted once
    before = [(p.stride(), p.data_ptr(), p.detach().clone()) for p in matrices]

    def as_before():
        return all(p.stride() == stride and p.data_ptr() == ptr and torch.equal(p, values)
                   for p, (stride, ptr, values) in zip(matrices, before, strict=True))

    by_column = [(1, p.size(0)) for p in matrices]  # (out, in) values, (in, out) in memory
    assert matrix_layouts_while_decoding(model, idx) == [by_column] * 3
    assert as_before()  # the same tensors again, which training and checkpoints use

    def interrupt(ids):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        matrix_layouts_while_decoding(model, idx, on_token=interrupt)
    assert as_before()
    bf16 = tiny_model(60, seed=9).to(torch.bfloat16)  # measured for float32 only: left alone
    assert matrix_layouts_while_decoding(bf16, idx) == [[p.stride() for p in matrices]] * 3


def test_long_prompt_keeps_its_last_block_size_tokens(bpe):
    text = "Lily and Tom went to the park. " * 10
    ids, dropped = encode_prompt(bpe, text, block_size=16)
    full = bpe.encode(text)
    assert dropped == len(full) - 16 and ids == full[-16:]


def test_empty_prompt_starts_from_endoftext(bpe):
    assert encode_prompt(bpe, "", 16) == ([bpe.eot_id], 0)


def test_stream_decoder_prints_multibyte_characters_whole(bpe):
    text = "Café 😀 ok"
    ids = bpe.encode(text)
    assert len(ids) > len(text.split())  # the emoji is split over several byte tokens
    stream = StreamDecoder(bpe)
    pieces = [stream.push(i) for i in ids] + [stream.flush()]
    assert "".join(pieces) == text
    assert not any("\ufffd" in piece for piece in pieces)


def stream_one_token_at_a_time(tokenizer, ids: list[int]) -> list[str]:
    """What StreamDecoder printed before it read a token after the ones before it: each token
    decoded alone, held back while its text ends in U+FFFD (up to 4 tokens)."""
    pieces, pending = [], []
    for token in ids:
        pending.append(token)
        text = tokenizer.decode(pending)
        if text.endswith("\ufffd") and len(pending) < 4:
            pieces.append("")
            continue
        pieces.append(text)
        pending = []
    return pieces + [tokenizer.decode(pending) if pending else ""]


def test_tinylm_tokenizers_stream_the_same_pieces_as_one_token_at_a_time(bpe):
    """Byte-level BPE and char tokens decode the same alone as after the others: tinylm's own
    runs print exactly what they printed, piece by piece, cuts through characters included."""
    chars = CharTokenizer.train(["Lily saw a cat. She smiled: Café! \u00e9\n"])
    g = torch.Generator().manual_seed(0)
    runs = [(bpe, bpe.encode("Café 😀 ok. Lily and Tom went to the park. She")),
            # random tokens: bytes of characters cut anywhere, runs of 4 that never complete
            *[(bpe, torch.randint(bpe.vocab_size, (60,), generator=g).tolist())
              for _ in range(20)],
            (chars, torch.randint(chars.vocab_size, (60,), generator=g).tolist())]
    for tokenizer, ids in runs:
        for prompt in ([], ids[:3], [tokenizer.eot_id]):
            stream = StreamDecoder(tokenizer, prompt)
            pieces = [stream.push(i) for i in ids] + [stream.flush()]
            assert pieces == stream_one_token_at_a_time(tokenizer, ids)


def sentencepiece_tokenizer(decoder: str) -> BPETokenizer:
    """A SentencePiece-style BPE ("▁cat", bytes as "<0xE2>") with a <s> post-processor, decoded
    as TinyLlama's tokenizer.json does (a "▁" prepended, spaces replaced; decoded, one leading
    space stripped off the whole text) or with a Metaspace decoder (which strips the first
    token's)."""
    hf = HFTokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    hf.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    hf.train_from_iterator(llama_texts()[:2000], trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False))
    data = json.loads(hf.to_str())
    for byte in range(256):  # the byte tokens a character outside the vocabulary falls back to
        data["model"]["vocab"].setdefault(f"<0x{byte:02X}>", len(data["model"]["vocab"]))
    hf = HFTokenizer.from_str(json.dumps(data))
    if decoder == "tinyllama":
        hf.pre_tokenizer = None
        hf.normalizer = normalizers.Sequence([normalizers.Prepend("▁"),
                                              normalizers.Replace(" ", "▁")])
        hf.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                        decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    else:
        hf.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Metaspace(
            replacement="▁", prepend_scheme="first")])
    hf.post_processor = processors.TemplateProcessing(single="<s> $A",
                                                      special_tokens=[("<s>", 1)])
    return BPETokenizer(hf, eot_id=2)


@pytest.mark.parametrize("decoder", ["tinyllama", "metaspace"])
def test_sentencepiece_tokens_stream_with_their_spaces(decoder):
    tokenizer = sentencepiece_tokenizer(decoder)
    text = "Lily saw a cat. She smiled, 😀 and said: “Café!”\nThe end."
    ids = tokenizer.encode(text)
    assert tokenizer.decode(ids) == text  # the <s> it starts with is left out
    # decoded alone, each token loses the space it starts with: "She" + "smiled"
    assert "Shesmiled" in "".join(tokenizer.decode([i]) for i in ids)
    for cut in (1, 4, 9):  # a prompt of <s> alone, a few words, up to "She"
        stream = StreamDecoder(tokenizer, ids[:cut])
        pieces = [stream.push(i) for i in ids[cut:]] + [stream.flush()]
        assert tokenizer.decode(ids[:cut]) + "".join(pieces) == text
        assert not any("\ufffd" in piece for piece in pieces)


# ---- the command ----------------------------------------------------------------------------

def test_generate_yaml_and_config_dataclass_have_the_same_keys():
    cfg = compose("generate", ["checkpoint=x", "temperature=0", "top_k=5"])
    built = to_dataclass(GenerateConfig, cfg, "generate")
    yaml_keys = set(OmegaConf.to_container(cfg))
    assert yaml_keys == {f.name for f in dataclasses.fields(GenerateConfig)}
    defaults = {k: v for k, v in dataclasses.asdict(GenerateConfig()).items()
                if k not in ("checkpoint", "temperature", "top_k")}
    assert {k: v for k, v in dataclasses.asdict(built).items() if k in defaults} == defaults
    assert built.temperature == 0 and built.top_k == 5


@pytest.mark.slow
def test_run_generate_streams_prompt_and_text_reproducibly(trained_run, capsys):
    run_dir, _ = trained_run
    cfg = GenerateConfig(checkpoint=str(run_dir), prompt="Lily and Tom", max_new_tokens=12,
                         num_samples=2, temperature=1.0, seed=11)
    texts = run_generate(cfg)
    out = capsys.readouterr().out
    assert len(texts) == 2 and out.count("Lily and Tom") == 2
    assert "--- sample 2/2 ---" in out and all(text in out for text in texts)
    assert run_generate(cfg) == texts  # same seed, same text
    capsys.readouterr()


def test_missing_checkpoint_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match=str(tmp_path / "nope")):
        run_generate(GenerateConfig(checkpoint=str(tmp_path / "nope")))


def _cli(*args, cwd):
    return run_cli("tinylm.cli.generate", *args, cwd=cwd, timeout=120)


@pytest.mark.slow
def test_cli_generates_and_inspects_into_the_run_directory(trained_run_copy, tmp_path):
    run_dir = trained_run_copy
    result = _cli(f"checkpoint={run_dir}", "prompt=Lily and Tom went to the park. She",
                  "max_new_tokens=8", "temperature=0", "inspect=true", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("Lily and Tom went to the park. She")
    assert "tensorboard --logdir " + str(run_dir / "inspect") in result.stdout
    logdir = next((run_dir / "inspect").iterdir())
    assert (logdir / "attention" / "layer_00" / "all_heads.png").is_file()
    assert list(tmp_path.iterdir()) == []  # Hydra wrote nothing into the working directory


@pytest.mark.slow
def test_cli_names_the_truncated_weights_file_without_a_traceback(trained_run, tmp_path):
    run_dir, _ = trained_run
    broken = tmp_path / "broken"
    checkpoint = resolve_checkpoint_dir(run_dir / "checkpoints" / "last")
    broken.mkdir()
    for file in checkpoint.iterdir():
        data = file.read_bytes()
        (broken / file.name).write_bytes(data[:100] if file.name == "model.safetensors" else data)
    result = _cli(f"checkpoint={broken}", cwd=tmp_path)
    assert result.returncode != 0
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and str(Path(broken) / "model.safetensors") in lines[0]


# ---- sizes and prompt files, refused or read before any work --------------------------------

@pytest.fixture
def saved(tmp_path, tiny_model, bpe):
    """A run directory holding this file's tiny model: 2 layers, block_size 16, n_embd 32."""
    return save_run(tmp_path / "run", tiny_model(bpe.vocab_size), bpe)


def with_memory(monkeypatch, available):
    """refuse_unless_held sees `available` bytes of free memory."""
    monkeypatch.setattr(tinylm.cli.sizes, "psutil", SimpleNamespace(
        virtual_memory=lambda: SimpleNamespace(available=available)))


@pytest.mark.parametrize("override, line", [
    ("max_new_tokens=1000000000000000000", r"max_new_tokens=1000000000000000000 is more than the "
     r"memory can hold: each token of a sample holds about 640 bytes \(with inspect=true, its "
     r"attention reading\), and [\d,]+ MiB are available now; give at most max_new_tokens=\d+"),
    ("num_samples=1000000000000000000", r"num_samples=1000000000000000000 is more than the "
     r"memory can hold: each sample of 1 \+ max_new_tokens=200 tokens holds about 25,856 bytes, "
     r"and [\d,]+ MiB are available now; give at most num_samples=\d+"),
    ("seed=100000000000000000000", r"seed=100000000000000000000 is not allowed: must be an "
     r"integer in \[-2\*\*63, 2\*\*64\): torch's generators take a 64-bit seed"),
])
def test_absurd_sizes_are_refused_in_one_line_before_any_work(saved, tmp_path, monkeypatch,
                                                               capsys, override, line):
    logdir = tmp_path / "inspect"
    said = refusal(main, f"checkpoint={saved}", override, "inspect=true", f"logdir={logdir}",
                   monkeypatch=monkeypatch)
    assert re.fullmatch("tinylm-generate: error: " + line, said), said
    assert capsys.readouterr() == ("", "")  # not a token, not the "loaded" line
    assert not logdir.exists()


def test_the_largest_max_new_tokens_allowed_is_generated_and_one_more_is_refused(saved, bpe,
                                                                                monkeypatch):
    with_memory(monkeypatch, 40_000)
    cfg = GenerateConfig(checkpoint=str(saved), prompt="Lily", max_new_tokens=10**6,
                         temperature=0)
    # the rule the line states: 128 bytes per token of the sample (its prompt too, and one
    # more), beside the KV cache: 2 layers x 16 positions x 32 numbers, keys and values, float32
    largest = (40_000 - 2 * 2 * 16 * 32 * 4) // 128 - len(bpe.encode("Lily")) - 1
    for n in (10**6, largest + 1):
        with pytest.raises(ValueError, match=f"give at most max_new_tokens={largest}$"):
            run_generate(dataclasses.replace(cfg, max_new_tokens=n))
    assert len(run_generate(dataclasses.replace(cfg, max_new_tokens=largest))) == 1


def test_an_empty_prompt_file_starts_a_fresh_story_and_says_so(saved, tmp_path, capsys):
    fresh = run_generate(GenerateConfig(checkpoint=str(saved), max_new_tokens=5, temperature=0))
    capsys.readouterr()
    for name, content in (("empty.txt", ""), ("newline.txt", "\n")):  # a line break is no text
        path = tmp_path / name
        path.write_text(content)
        texts = run_generate(GenerateConfig(checkpoint=str(saved), prompt_file=str(path),
                                            max_new_tokens=5, temperature=0))
        assert texts == fresh
        assert capsys.readouterr().err.startswith(
            f"note: prompt_file={path} is empty: starting from <|endoftext|>, a fresh story\n")


def test_a_prompt_files_last_line_break_is_dropped_so_the_text_goes_on_after_it(saved, bpe,
                                                                                 tmp_path,
                                                                                 capsys):
    """An editor ends the file's last line with a line break: the model continues after "She",
    not on a new line. One is dropped, not every one; Windows' line breaks read as \\n."""
    path = tmp_path / "prompt.txt"
    for content, prompt in (("Lily and\r\nTom went to the park. She\r\n",
                             "Lily and\nTom went to the park. She"),
                            ("She\n\n", "She\n"), ("She", "She")):
        path.write_bytes(content.encode())
        cfg = GenerateConfig(checkpoint=str(saved), prompt_file=str(path), max_new_tokens=4,
                             temperature=0)
        assert tinylm.cli.generate._read_prompt(cfg, bpe) == prompt
        capsys.readouterr()
        texts = run_generate(cfg)
        assert capsys.readouterr().out == prompt + texts[0] + "\n"
        assert texts == run_generate(GenerateConfig(checkpoint=str(saved), prompt=prompt,
                                                    max_new_tokens=4, temperature=0))


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="named pipes are POSIX")
@pytest.mark.parametrize("special", ["fifo", "/dev/zero", "/dev/null", "folder"])
def test_a_prompt_file_that_is_no_regular_file_is_refused_in_one_line_unread(saved, tmp_path,
                                                                            special, capsys):
    """A pipe no program writes to would wait forever, /dev/zero never ends: each is refused
    from its stat, at once, before the model is run."""
    path = {"fifo": tmp_path / "prompt", "/dev/zero": "/dev/zero", "/dev/null": "/dev/null",
            "folder": tmp_path}[special]
    if special == "fifo":
        os.mkfifo(path)
    kind = "a folder" if special == "folder" else "a pipe or device"
    started = time.monotonic()
    with pytest.raises(ValueError) as err:
        run_generate(GenerateConfig(checkpoint=str(saved), prompt_file=str(path)))
    assert str(err.value) == f"prompt_file {path} is {kind}, not a regular file; give a file"
    assert time.monotonic() - started < 30
    assert capsys.readouterr().out == ""


def test_a_prompt_file_larger_than_memory_holds_is_refused_before_it_is_read(saved, tmp_path,
                                                                              monkeypatch):
    with_memory(monkeypatch, 2**26)
    path = tmp_path / "prompt.txt"
    with open(path, "wb") as f:
        f.truncate(2**26 // 256 + 1)  # sparse: one byte more than the rule lets it hold
    with pytest.raises(ValueError) as err:
        run_generate(GenerateConfig(checkpoint=str(saved), prompt_file=str(path)))
    assert str(err.value) == (
        f"prompt_file={path} is more than the memory can hold: reading and tokenizing a prompt "
        "holds about 256 bytes per byte of it, and 64 MiB are available now; give prompt_file "
        "with at most 262,144 bytes")
