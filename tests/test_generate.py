"""Behaviour of tinylm.generate and tinylm-generate: sampling, the KV cache, prompts, streaming."""

import dataclasses
from pathlib import Path

import pytest
import torch
from helpers import compose, run_cli, to_dataclass
from omegaconf import OmegaConf

from tinylm.cli.generate import GenerateConfig, run_generate
from tinylm.generate import StreamDecoder, encode_prompt, generate, sample_next


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
    checkpoint = (run_dir / "checkpoints" / "last").resolve()
    broken.mkdir()
    for file in checkpoint.iterdir():
        data = file.read_bytes()
        (broken / file.name).write_bytes(data[:100] if file.name == "model.safetensors" else data)
    result = _cli(f"checkpoint={broken}", cwd=tmp_path)
    assert result.returncode != 0
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and str(Path(broken) / "model.safetensors") in lines[0]
