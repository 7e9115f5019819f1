"""Hugging Face GPT-2 and GPT-Neo in tinylm's own TinyLM (tinylm/pretrained.py), the attention
options they need (a band-shaped causal mask, no 1/√d), and tinylm runs exported as GPT-2.

The reference is transformers itself: random-weight models of a small shape, saved as a user's
download would be, must give tinylm the same logits, attention weights and greedy tokens."""

import json
import os
import pickle
import shutil
import sys
from importlib.util import module_from_spec, spec_from_file_location
from types import SimpleNamespace

import pytest
import torch
from helpers import run_cli, save_run
from safetensors.torch import save_file
from tokenizers import AddedToken, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as HFTokenizer

import tinylm.cli.explain
import tinylm.cli.generate
import tinylm.cli.probe
from tinylm.attention import MultiHeadAttention, causal_mask
from tinylm.checkpoint import load_checkpoint
from tinylm.fast import softmax_attention
from tinylm.files import project_root
from tinylm.hooks import caching
from tinylm.kv_cache import KVCache
from tinylm.model import ModelConfig, TinyLM
from tinylm.pretrained import build, export_gpt2, load_pretrained
from tinylm.pretrained.gpt2 import TanhGELUMLP
from tinylm.pretrained.gpt_neo import GPTNeoConfig, LocalAttention
from tinylm.tokenizer import EOT, BPETokenizer, CharTokenizer, load_tokenizer

WINDOW = 8  # GPT-Neo's local window here; the prompts below are longer
PROMPT = "Lily and Tom went to the park. She saw a big dog. It was happy. Tom said, Look"


def _tiny(vocab_size, **overrides):
    """A small untrained model in eval mode: TinyLM, or with GPT-2's and GPT-Neo's options a
    GPTNeoLM (conftest's tiny_model keys its cache by the overrides, and a list of
    attention_layers cannot be a key)."""
    torch.manual_seed(0)
    values = dict(vocab_size=vocab_size, block_size=64, n_layer=2, n_head=2, n_embd=16)
    shape = {key: overrides.pop(key) for key in list(overrides) if key in values}
    config = GPTNeoConfig if overrides else ModelConfig
    return build(config(**{**values, **shape}, **overrides)).eval()


def _attention(scale, window) -> MultiHeadAttention:
    """tinylm's attention with another scale and, given a window, a local layer's band."""
    mha = (MultiHeadAttention(32, 4) if window is None else
           LocalAttention(32, 4, 0.0, True, window)).eval()
    mha.scale = scale
    return mha


def _hidden(attn: MultiHeadAttention, t_q: int, t_k: int) -> torch.Tensor:
    """Every position a layer's queries do not see: the causal mask and the layer's own."""
    extra = attn.hidden(t_q, t_k, "cpu")
    causal = causal_mask(t_q, t_k)
    return causal if extra is None else causal | extra


# ------------------------------------------------------------- the attention options themselves


def test_a_local_layers_mask_is_the_causal_triangle_cut_to_a_band():
    assert _hidden(_attention(None, 2), 5, 5).logical_not().int().tolist() == [
        [1, 0, 0, 0, 0],
        [1, 1, 0, 0, 0],
        [0, 1, 1, 0, 0],
        [0, 0, 1, 1, 0],
        [0, 0, 0, 1, 1]]
    # 2 new queries after 4 cached keys sit at positions 4 and 5, and see 3 keys each
    assert _hidden(_attention(None, 3), 2, 6).logical_not().int().tolist() == [
        [0, 0, 1, 1, 1, 0],
        [0, 0, 0, 1, 1, 1]]
    assert _attention(None, 6).hidden(6, 6, "cpu") is None  # nothing is that far: the triangle
    assert MultiHeadAttention(32, 4).hidden(6, 6, "cpu") is None  # global: the triangle


@pytest.mark.parametrize("scale, window", [(1.0, None), (None, 3), (1.0, 3), (0.3, 1)])
def test_every_attention_path_agrees_with_a_band_and_another_scale(scale, window):
    """The explicit path (weights kept), PyTorch's fused kernel and softmax_attention (bf16 or
    dropout on a CPU) compute one thing: outputs and gradients, whole and through a KV cache
    whose positions go past the window."""
    torch.manual_seed(0)
    mha = _attention(scale, window)
    x = torch.randn(2, 10, 32)
    outputs = {}
    for need_weights in (False, True):
        x_path = x.clone().requires_grad_()
        with caching(mha, ["hook_pattern"] if need_weights else []):
            y = mha(x_path)
        y.square().sum().backward()
        outputs[need_weights] = y, x_path.grad
    (fused, g_fused), (explicit, g_explicit) = outputs[False], outputs[True]
    assert (fused - explicit).abs().max() <= 1e-5 and (g_fused - g_explicit).abs().max() <= 1e-5
    q, k, v = (t.detach().requires_grad_() for t in mha.project_heads(x))
    steps = mha.steps(q, k, v)
    assert torch.equal(steps.weights == 0, _hidden(mha, 10, 10).expand(2, 4, 10, 10))
    expected = torch.softmax(q @ k.transpose(-2, -1) * (scale or 8 ** -0.5)
                             + steps.masked.isinf() * -1e9, dim=-1)
    assert (steps.weights - expected).abs().max() <= 1e-6
    fast = softmax_attention(q, k, v, 0.0, scale, _hidden(mha, 10, 10))
    assert (fast - steps.output).abs().max() <= 1e-5
    for need_weights in (False, True):
        cache = KVCache(1, 2, 4, max_len=16, head_size=8)
        pieces = []
        for piece in (x[:, :4], x[:, 4:7], x[:, 7:8], x[:, 8:9], x[:, 9:10]):
            with caching(mha, ["hook_pattern"] if need_weights else []):
                pieces.append(mha(piece, kv_cache=cache.layer(0)))
            cache.advance(piece.size(1))
        assert (torch.cat(pieces, dim=1) - explicit).abs().max() <= 1e-5


def test_the_options_reach_every_layer_and_a_checkpoint_records_them(bpe, tmp_path):
    model = _tiny(bpe.vocab_size, n_layer=3, activation="gelu_tanh", attention_scale=False,
                       attention_layers=["global", "local", "local"], window_size=4)
    assert [(b.attn.scale, getattr(b.attn, "window", None)) for b in model.blocks] == [
        (1.0, None), (1.0, 4), (1.0, 4)]
    assert isinstance(model.blocks[0].mlp, TanhGELUMLP)
    idx = torch.tensor([bpe.encode(PROMPT)[:20]])
    loaded = load_checkpoint(save_run(tmp_path / "run", model, bpe))
    assert loaded.config == model.config
    assert torch.equal(loaded.model(idx).logits, model(idx).logits)
    # a model_config.json edited to another window fits the same weights, but is not the model
    config_file = loaded.directory / "model_config.json"
    config_file.write_text(json.dumps({**model.config.to_dict(), "window_size": 5}))
    with pytest.raises(ValueError, match=r"says window_size=5 but .* window_size=4"):
        load_checkpoint(tmp_path / "run")


def test_a_checkpoint_saved_with_the_options_in_its_config_loads_as_the_model_it_was(
        tiny_model, bpe, tmp_path):
    """model_config.json held GPT-2's and GPT-Neo's four options until they moved to
    tinylm/pretrained/: with tinylm's values, such a checkpoint is tinylm's own model."""
    model = tiny_model(bpe.vocab_size)
    directory = load_checkpoint(save_run(tmp_path / "run", model, bpe)).directory
    config_file = directory / "model_config.json"
    old = {**json.loads(config_file.read_text()), "activation": "gelu",
           "attention_scale": True, "attention_layers": None, "window_size": None}
    config_file.write_text(json.dumps(old))
    loaded = load_checkpoint(directory)
    idx = torch.tensor([bpe.encode(PROMPT)[:20]])
    assert type(loaded.model) is TinyLM and loaded.config == model.config
    assert torch.equal(loaded.model(idx).logits, model(idx).logits)


@pytest.mark.parametrize("values, message", [
    ({"attention_layers": ["global"]}, "model.attention_layers=['global'] is not allowed: must "
     "list global or local for each of the 2 layers"),
    ({"attention_layers": ["global", "local"]}, "model.window_size=None is not allowed"),
    ({"activation": "relu"}, "model.activation='relu' is not allowed; allowed: gelu, gelu_tanh"),
    ({"attention_scale": "no"}, "model.attention_scale='no' is not allowed"),
])
def test_impossible_attention_options_are_named(values, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("(", r"\(")):
        GPTNeoConfig(vocab_size=50, n_layer=2, **values)


# ----------------------------------------------------------- transformers' models, loaded here


def _reference(kind, vocab_size, eot_id):
    """A random-weight transformers model of `kind` (fp32, eager attention so that it returns
    its weights), with weights drawn wider than at init so that mistakes show in the logits."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    common = dict(vocab_size=vocab_size, bos_token_id=eot_id, eos_token_id=eot_id,
                  attn_implementation="eager")
    if kind == "gpt2":
        model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
            n_positions=64, n_embd=32, n_layer=3, n_head=4, **common))
    else:
        model = transformers.GPTNeoForCausalLM(transformers.GPTNeoConfig(
            max_position_embeddings=64, hidden_size=32, num_layers=4, num_heads=4,
            attention_types=[[["global", "local"], 2]], window_size=WINDOW, **common))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".ln_" not in name:
                p.normal_(0.0, 0.2)
    return model.eval()


@pytest.fixture(scope="session", params=["gpt2", "gpt_neo"])
def hf_model(request, bpe, tmp_path_factory):
    """(folder, transformers model) of a random GPT-2 or GPT-Neo saved as `save_pretrained`
    saves one, with a byte-level BPE tokenizer.json beside it."""
    reference = _reference(request.param, bpe.vocab_size, bpe.eot_id)
    folder = tmp_path_factory.mktemp(request.param)
    reference.save_pretrained(folder, safe_serialization=True)
    bpe.save(folder / "tokenizer.json")
    return folder, reference


def test_transformers_models_load_with_the_same_logits_and_attention_weights(hf_model, bpe):
    folder, reference = hf_model
    idx = torch.tensor([bpe.encode(PROMPT)])
    assert idx.size(1) > 2 * WINDOW
    model, tokenizer, where = load_pretrained(folder)
    assert where == folder and tokenizer.encode(PROMPT) == idx[0].tolist()
    with torch.no_grad():
        theirs = reference(idx, output_attentions=True)
        ours = model(idx, return_attention=True)
        fused = model(idx).logits
    assert (ours.logits - theirs.logits).abs().max() <= 1e-4
    assert (fused - theirs.logits).abs().max() <= 1e-4
    assert len(ours.attentions) == len(theirs.attentions)
    for mine, reference_weights in zip(ours.attentions, theirs.attentions, strict=True):
        assert (mine - reference_weights).abs().max() <= 1e-5
    if reference.config.model_type == "gpt_neo":  # a local layer's weights: a band
        assert ours.attentions[1][0, :, -1, :-WINDOW].abs().max() == 0
        assert ours.attentions[0][0, :, -1, :-WINDOW].abs().min() > 0


def test_kv_cached_greedy_decoding_gives_transformers_tokens_and_logits(hf_model, bpe):
    from tinylm.generate import generate
    folder, reference = hf_model
    model, tokenizer, _ = load_pretrained(folder)
    idx = torch.tensor([bpe.encode(PROMPT)])
    theirs = reference.generate(idx, max_new_tokens=24, do_sample=False, output_logits=True,
                                return_dict_in_generate=True)
    ours = generate(model, idx, 24, temperature=0, stop_id=tokenizer.eot_id)
    assert ours.tolist() == theirs.sequences.tolist()
    # the same steps by hand, one token at a time through the KV cache
    cache = model.new_kv_cache(1)
    with torch.no_grad():
        logits = [model(idx, kv_cache=cache).logits[:, -1]]
        for token in ours[:, idx.size(1):-1].T:
            logits.append(model(token[:, None], kv_cache=cache).logits[:, -1])
    assert cache.length > WINDOW * 4
    assert (torch.stack(logits) - torch.stack(theirs.logits)).abs().max() <= 1e-4


def _gpt2_shaped_tokenizer(bpe: BPETokenizer) -> HFTokenizer:
    """`bpe` laid out as GPT-2's tokenizer.json is: the merges' tokens first, <|endoftext|> the
    last id, a ByteLevel post-processor."""
    data = json.loads(bpe.hf.to_str())
    vocab = {token: i for token, i in data["model"]["vocab"].items() if token != EOT}
    vocab = {token: i for i, token in enumerate(sorted(vocab, key=vocab.get))}
    vocab[EOT] = len(vocab)
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m)
              for m in data["model"]["merges"]]
    gpt2 = HFTokenizer(models.BPE(vocab=vocab, merges=merges))
    gpt2.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    gpt2.post_processor = processors.ByteLevel(trim_offsets=False)
    gpt2.decoder = decoders.ByteLevel()
    gpt2.add_special_tokens([AddedToken(EOT, special=True)])
    return gpt2


def test_a_gpt2_tokenizer_json_loads_with_its_endoftext_as_the_last_id(bpe, tmp_path):
    transformers = pytest.importorskip("transformers")
    _gpt2_shaped_tokenizer(bpe).save(str(tmp_path / "tokenizer.json"))
    ours = load_tokenizer(tmp_path / "tokenizer.json")
    theirs = transformers.PreTrainedTokenizerFast(tokenizer_file=str(tmp_path / "tokenizer.json"))
    text = f"Lily saw Tom.{EOT}She laughed."
    assert ours.eot_id == ours.vocab_size - 1 == theirs.convert_tokens_to_ids(EOT)
    assert ours.encode(text) == theirs(text)["input_ids"]
    assert ours.eot_id in ours.encode(text) and ours.decode(ours.encode(text)) == text


# --------------------------------------------------------------------------- what is refused


def _saved_reference(kind, bpe, folder):
    """A random `kind` model saved as a Hugging Face folder with the tokenizer, for a test to
    change."""
    _reference(kind, bpe.vocab_size, bpe.eot_id).save_pretrained(folder, safe_serialization=True)
    bpe.save(folder / "tokenizer.json")
    return folder


@pytest.fixture
def gpt2_folder(bpe, tmp_path):
    """A copy of a random GPT-2's folder that the test may change."""
    return _saved_reference("gpt2", bpe, tmp_path / "gpt2")


@pytest.mark.parametrize("change, message", [
    ({"model_type": "bert"}, "model_type='bert' is not one tinylm loads: gpt2"),
    ({"n_inner": 96}, "n_inner=96 is not supported: tinylm's MLP is 4 x n_embd wide"),
    ({"activation_function": "relu"}, "activation_function='relu' is not supported"),
    ({"layer_norm_epsilon": 1e-6}, "layer_norm_epsilon=1e-06 is not supported"),
    ({"tie_word_embeddings": False}, "tie_word_embeddings=False is not supported"),
    ({"n_head": 5}, "model.n_embd=32 is not allowed: must be divisible by model.n_head=5"),
])
def test_what_tinylm_cannot_load_is_refused_in_one_line_naming_the_key(gpt2_folder, change,
                                                                        message):
    config_file = gpt2_folder / "config.json"
    config_file.write_text(json.dumps({**json.loads(config_file.read_text()), **change}))
    with pytest.raises(ValueError) as refused:
        load_checkpoint(gpt2_folder)
    assert str(refused.value).startswith(f"{config_file}: {message}")
    assert len(str(refused.value).splitlines()) == 1


def test_weights_of_another_shape_or_tokenizer_are_refused_naming_the_file(gpt2_folder, bpe):
    config_file = gpt2_folder / "config.json"
    config = json.loads(config_file.read_text())
    config_file.write_text(json.dumps({**config, "n_layer": 4}))
    with pytest.raises(ValueError, match="n_layer=4, but the model.safetensors beside it holds 3 "
                                         "layers: they are not one model"):
        load_pretrained(gpt2_folder)
    config_file.write_text(json.dumps({**config, "n_positions": 32}))
    with pytest.raises(ValueError, match="model.safetensors does not fit the model its "
                                         "config.json describes: size mismatch for wpe.weight"):
        load_pretrained(gpt2_folder)
    config_file.write_text(json.dumps(config))
    CharTokenizer(list("abc")).save(gpt2_folder / "tokenizer.json")
    with pytest.raises(ValueError, match=f"has 4 tokens but .* says vocab_size={bpe.vocab_size}"):
        load_pretrained(gpt2_folder)
    (gpt2_folder / "tokenizer.json").unlink()
    with pytest.raises(FileNotFoundError, match="has no tokenizer.json; GPT-2 and the TinyStories "
                                                "models share one: put hf:gpt2's in a folder"):
        load_pretrained(gpt2_folder)


class Trap:
    """Unpickling this runs code: it writes a file (what a malicious pytorch_model.bin does)."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_a_folder_with_only_a_pickle_is_refused_saying_why_and_never_unpickled(gpt2_folder,
                                                                              tmp_path):
    (gpt2_folder / "model.safetensors").unlink()
    marker = tmp_path / "code-ran"
    (gpt2_folder / "pytorch_model.bin").write_bytes(pickle.dumps(Trap(marker), protocol=2))
    with pytest.raises(FileNotFoundError) as refused:
        load_checkpoint(gpt2_folder)
    assert str(refused.value) == (
        f"{gpt2_folder} has no model.safetensors, only pytorch_model.bin: tinylm loads no "
        "pickle, since loading one can run any code it holds; convert it once, explicitly: "
        f"python scripts/convert_bin_to_safetensors.py {gpt2_folder} <folder>, then pass "
        "checkpoint=<folder>")
    assert not marker.exists()


def _convert_script():
    spec = spec_from_file_location(
        "convert_bin", project_root() / "scripts" / "convert_bin_to_safetensors.py")
    module = module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_conversion_the_user_runs_makes_a_pickle_loadable_and_refuses_code(bpe, tmp_path):
    reference = _reference("gpt_neo", bpe.vocab_size, bpe.eot_id)
    pickled = tmp_path / "pickled"
    reference.save_pretrained(pickled, safe_serialization=True)
    (pickled / "model.safetensors").unlink()
    torch.save(reference.state_dict(), pickled / "pytorch_model.bin")  # tied: wte is lm_head
    bpe.save(pickled / "tokenizer.json")
    convert = _convert_script().convert
    convert(str(pickled), tmp_path / "converted")
    model, _, _ = load_pretrained(tmp_path / "converted")
    idx = torch.tensor([bpe.encode(PROMPT)])
    with torch.no_grad():
        assert (model(idx).logits - reference(idx).logits).abs().max() <= 1e-4

    marker = tmp_path / "code-ran"
    (pickled / "pytorch_model.bin").write_bytes(pickle.dumps(Trap(marker), protocol=2))
    with pytest.raises(SystemExit, match="holds more than tensors, so it is not converted"):
        convert(str(pickled), tmp_path / "refused")
    assert not marker.exists() and not (tmp_path / "refused").exists()


# ---------------------------------------------------------------------------- hf:<id>, offline


def _hub_cache(cache, repo_id, files):
    """Hugging Face's cache layout holding `files` as the snapshot of `repo_id`'s main branch."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    commit = "0" * 40
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    for file in files:
        shutil.copy(file, snapshot / file.name)
    return snapshot


def test_an_hf_id_asks_the_hub_for_only_the_three_files_and_loads_them(gpt2_folder, tmp_path,
                                                                       monkeypatch):
    huggingface_hub = pytest.importorskip("huggingface_hub")
    asked = []
    snapshot = _hub_cache(tmp_path / "cache", "someone/tiny-gpt2", gpt2_folder.iterdir())

    def download(repo_id, allow_patterns=None, **kwargs):  # the hub, stubbed: a filled cache
        asked.append((repo_id, sorted(allow_patterns)))
        return str(snapshot)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", download)
    loaded = load_checkpoint("hf:someone/tiny-gpt2")
    assert asked == [("someone/tiny-gpt2", ["config.json", "model.safetensors",
                                            "tokenizer.json"])]
    assert loaded.directory == snapshot and loaded.config.n_layer == 3

    def not_found(repo_id, **kwargs):
        raise huggingface_hub.errors.RepositoryNotFoundError(
            "404 Client Error. Repository Not Found", response=SimpleNamespace(headers={},
                                                                               request=None))
    monkeypatch.setattr(huggingface_hub, "snapshot_download", not_found)
    with pytest.raises(ValueError) as refused:
        load_checkpoint("hf:someone/no-such-model")
    assert str(refused.value).startswith("hf:someone/no-such-model: the Hugging Face hub has no "
                                         "such model, or it is private or gated")


@pytest.mark.slow
def test_offline_an_hf_id_loads_from_the_cache_or_says_what_to_do_in_one_line(
        gpt2_folder, tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    _hub_cache(cache, "someone/tiny-gpt2", gpt2_folder.iterdir())
    _hub_cache(cache, "someone/pickled",
               [gpt2_folder / "config.json", gpt2_folder / "tokenizer.json"])
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    done = run_cli("tinylm.cli.export", "checkpoint=hf:someone/tiny-gpt2", "out=exported",
                   cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "exported" / "model.safetensors").is_file()

    done = run_cli("tinylm.cli.export", "checkpoint=hf:gpt2", "out=x", cwd=tmp_path)
    assert done.returncode == 1 and done.stderr.strip() == (
        f"tinylm-export: error: hf:gpt2 is not in the Hugging Face cache ({cache}) and "
        "HF_HUB_OFFLINE=1 is set: run once with a network to download it, or pass "
        "checkpoint=<a folder with its config.json, model.safetensors and tokenizer.json>")
    done = run_cli("tinylm.cli.export", "checkpoint=hf:someone/pickled", "out=x", cwd=tmp_path)
    assert done.returncode == 1 and done.stderr.strip().startswith(
        "tinylm-export: error: hf:someone/pickled has no model.safetensors: tinylm loads no "
        "pickle")
    assert len(done.stderr.strip().splitlines()) == 1 and not (tmp_path / "x").exists()


# ------------------------------------------------------------------------ tinylm runs, exported


@pytest.mark.slow
def test_an_exported_run_loads_in_transformers_with_its_logits_and_comes_back_exactly(
        trained_run, tmp_path):
    transformers = pytest.importorskip("transformers")
    from tinylm.cli.export import ExportConfig, run_export
    run = load_checkpoint(trained_run[0])
    assert run.config.bias is False  # GPT-2 gets zeros for the biases the run has not
    out = run_export(ExportConfig(checkpoint=str(trained_run[0]), out=str(tmp_path / "gpt2")))
    text = "Once upon a time, Lily found a ball. She"
    idx = torch.tensor([run.tokenizer.encode(text)])

    theirs = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    config = json.loads((out / "config.json").read_text())
    assert config["activation_function"] == "gelu"  # transformers' gelu is the exact (erf) one
    x = torch.linspace(-4, 4, 101)
    assert torch.equal(theirs.transformer.h[0].mlp.act(x), torch.nn.functional.gelu(x))
    assert theirs.transformer.h[0].attn.c_attn.bias.abs().max() == 0
    with torch.no_grad():
        assert (theirs(idx).logits - run.model(idx).logits).abs().max() <= 1e-4
        back = load_checkpoint(out)
        assert torch.equal(back.model(idx).logits, run.model(idx).logits)
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_file=str(out / "tokenizer.json"))
    assert tokenizer(text)["input_ids"] == idx[0].tolist()
    assert transformers.AutoTokenizer.from_pretrained(out).eos_token_id == run.tokenizer.eot_id


def test_exporting_a_char_tokenizer_run_says_what_works_and_what_does_not(
        tiny_model, tmp_path, capsys):
    from tinylm.cli.export import ExportConfig, run_export
    chars = CharTokenizer(list(" .LSaehilsty"))
    run = save_run(tmp_path / "run", tiny_model(chars.vocab_size), chars)
    out = run_export(ExportConfig(checkpoint=str(run), out=str(tmp_path / "gpt2")))
    note = capsys.readouterr().err.strip()
    assert note.startswith("note: the run's tokenizer is tinylm's char tokenizer, which "
                           "transformers has no class for: the exported model loads and takes "
                           "token ids, but no tokenizer.json was written")
    assert len(note.splitlines()) == 1
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]


def test_export_refuses_what_gpt2_cannot_hold_and_a_missing_argument(bpe, tmp_path):
    # (the command's one line for such errors: test_offline_an_hf_id_loads_from_the_cache...)
    from tinylm.cli.export import ExportConfig, run_export
    local = _tiny(bpe.vocab_size, attention_layers=["local", "global"], window_size=4)
    run = save_run(tmp_path / "run", local, bpe)
    with pytest.raises(ValueError) as refused:
        run_export(ExportConfig(checkpoint=str(run), out=str(tmp_path / "out")))
    assert str(refused.value) == (
        "the model has local attention layers, which GPT-2 has no place for: it cannot be "
        "exported as GPT-2")
    with pytest.raises(ValueError, match="checkpoint= and out= are required: tinylm-export "
                                         "checkpoint=<run dir> out=<folder to write>"):
        run_export(ExportConfig(checkpoint=str(run)))
    with pytest.raises(ValueError, match="out=.*gpt2 cannot hold the export: .*model_config.json "
                                         "is a file; name a folder with out=/path/to/folder"):
        run_export(ExportConfig(checkpoint=str(run), out=str(next(run.rglob("model_config.json"))
                                                             / "gpt2")))
    assert not (tmp_path / "out").exists()


def test_an_export_the_disk_cannot_hold_leaves_nothing_and_says_so(tiny_model, bpe, tmp_path,
                                                                    small_disk):
    from tinylm.cli.export import ExportConfig, run_export
    from tinylm.files import NotWritten
    run = save_run(tmp_path / "run", tiny_model(bpe.vocab_size), bpe)
    disk = small_disk(32)  # KiB; the model's weights alone take more
    with pytest.raises(NotWritten, match=r"gpt2 could not be written: .*No space left on "
                                         r"device .*\(0\.0 MiB free"):
        run_export(ExportConfig(checkpoint=str(run), out=str(disk / "gpt2")))
    assert list(disk.iterdir()) == []


def test_export_without_scaling_keeps_it_off_in_transformers(tiny_model, bpe, tmp_path):
    transformers = pytest.importorskip("transformers")
    model = _tiny(bpe.vocab_size, attention_scale=False, activation="gelu_tanh")
    export_gpt2(model, bpe, tmp_path)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    idx = torch.tensor([bpe.encode(PROMPT)])
    with torch.no_grad():
        assert (theirs(idx).logits - model(idx).logits).abs().max() <= 1e-4


@pytest.mark.slow
def test_importing_the_loader_loads_neither_transformers_nor_the_hub_client():
    import subprocess
    loaded = subprocess.run(
        [sys.executable, "-c", "import sys, tinylm.checkpoint, tinylm.pretrained; "
         "print(sorted(m for m in ('transformers', 'huggingface_hub') if m in sys.modules))"],
        capture_output=True, text=True, check=True, env={**os.environ}).stdout.strip()
    assert loaded == "[]"


def test_weights_file_with_fp16_tensors_loads_in_float32(gpt2_folder):
    weights = gpt2_folder / "model.safetensors"
    from safetensors.torch import load_file
    half = {k: v.half() for k, v in load_file(weights).items()}
    save_file(half, str(weights), metadata={"format": "pt"})
    model, _, _ = load_pretrained(gpt2_folder)
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    assert all(p.is_contiguous() for p in model.parameters())
    assert torch.equal(model.wte.weight, half["transformer.wte.weight"].float())


# ------------------------------------------------------------------- every tool on 12 x 12 heads


@pytest.mark.slow
def test_every_tool_runs_on_a_loaded_model_of_12_x_12_heads(bpe, tmp_path, monkeypatch,
                                                           capsys):
    # GPT-Neo: every option at once (no scaling, local layers); GPT-2's loading is tested above
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    reference = transformers.GPTNeoForCausalLM(transformers.GPTNeoConfig(
        vocab_size=bpe.vocab_size, bos_token_id=bpe.eot_id, eos_token_id=bpe.eot_id,
        max_position_embeddings=256, hidden_size=24, num_layers=12, num_heads=12,
        attention_types=[[["global", "local"], 6]], window_size=WINDOW))
    kind = "gpt_neo"
    folder = tmp_path / kind
    reference.save_pretrained(folder, safe_serialization=True)
    bpe.save(folder / "tokenizer.json")

    monkeypatch.chdir(tmp_path)

    def command(module, *args) -> str:  # the command in this process; what it printed
        monkeypatch.setattr(sys, "argv", [module.__name__, *args])
        module.main()
        return capsys.readouterr().out

    said = command(tinylm.cli.generate, f"checkpoint={folder}", "max_new_tokens=3",
                  'prompt="Lily saw Tom. She"', "inspect=true", "temperature=0")
    assert "heatmap labels: every token on the all-heads maps; pronouns always" in said
    (logdir,) = (tmp_path / "runs" / "pretrained" / kind / "inspect").iterdir()
    assert (logdir / "inspect.json").is_file() and not (folder / "inspect").exists()
    layer_images = sorted(p.name for p in (logdir / "attention").iterdir())
    assert len(layer_images) == 12 and not list((logdir / "attention").rglob("head_*.png"))

    items = tmp_path / "items.jsonl"  # one of each kind: the ablation passes over 144 heads
    # a name of the other gender with as many tokens as Tom's, for the patching pair
    partner = next(name for name in ("Amy", "Sue", "Mia", "Zoe", "Ann")
                   if len(bpe.encode(f"{name} ran.")) == len(bpe.encode("Tom ran.")))
    items.write_text(json.dumps({"text": "Lily saw Tom. She ran.", "pronoun_char": 14,
                                 "antecedent_chars": [0], "distractor_chars": [9]}) + "\n"
                     + json.dumps({"text": "Tom ran. He sat.", "pronoun_char": 9,
                                   "antecedent_chars": [0], "wrong_pronoun": "she",
                                   "counterfactual": f"{partner} ran. She sat."}) + "\n")
    command(tinylm.cli.probe, f"checkpoint={folder}", f"probe_file={items}", "ablate=mean",
            "patch=true")
    (report,) = (tmp_path / "runs" / "pretrained" / kind / "probe").glob("*/probe.json")
    probe = json.loads(report.read_text())
    assert len(probe["heads"]) == len(probe["ablation"]) == len(probe["mean_ablation"]) == 144
    assert probe["evidence"] and len(probe["patching"]["heads"]) == 144

    said = command(tinylm.cli.explain, f"checkpoint={folder}", "layer=11", "head=11",
                  'text="Lily saw Tom. She laughed and he ran to the big red ball"')
    assert "Check: the model's own forward pass gives this head the same weights" in said
    assert "local: each token sees only the last 8 positions" in said


def test_a_folder_whose_weights_hold_nan_is_refused_naming_the_tensor(gpt2_folder):
    from safetensors import safe_open
    weights = gpt2_folder / "model.safetensors"
    with safe_open(str(weights), "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    name = next(k for k in tensors if k.endswith("h.1.ln_2.weight"))
    tensors[name][0] = float("nan")
    save_file(tensors, str(weights), metadata={"format": "pt"})
    with pytest.raises(ValueError) as refused:
        load_checkpoint(gpt2_folder)
    assert str(refused.value).startswith(f"{weights} holds NaN or inf in blocks.1.ln_2.weight: ")
    assert len(str(refused.value).splitlines()) == 1


# ------------------------------------------------------- crafted folders: one line, fast, no hang


@pytest.fixture
def neo_folder(bpe, tmp_path):
    """A copy of a random GPT-Neo's folder (4 layers) that the test may change."""
    return _saved_reference("gpt_neo", bpe, tmp_path / "neo")


def _refused(folder, change):
    """The one line load_checkpoint refuses `folder` with once its config.json has `change`."""
    config_file = folder / "config.json"
    config_file.write_text(json.dumps({**json.loads(config_file.read_text()), **change}))
    with pytest.raises(ValueError) as refused:
        load_checkpoint(folder)
    assert len(str(refused.value).splitlines()) == 1
    return str(refused.value).removeprefix(f"{config_file}: ")


@pytest.mark.parametrize("n_layer", [10**6, 10**9, 0, -1])
def test_a_layer_count_the_weights_do_not_hold_is_refused_before_anything_is_built(
        gpt2_folder, n_layer):
    assert _refused(gpt2_folder, {"n_layer": n_layer}) == (
        f"n_layer={n_layer}, but the model.safetensors beside it holds 3 layers: they are not "
        "one model")


@pytest.mark.parametrize("types", [
    [[["global", "local"], 10**9]],
    [[["global"], 10**9], [["local"], 4 - 10**9]],  # sums to 4, expands to a billion
    [[["global", "local"], 2.0]], {"global": 4}, [["global", 4]], None,
])
def test_gpt_neos_attention_types_are_counted_against_the_weights_before_expanding(
        neo_folder, types):
    # transformers saves the expanded attention_layers too: without them, the types are read
    assert _refused(neo_folder, {"attention_types": types, "attention_layers": None}) == (
        f'attention_types={types!r} is not supported: it must be [[["global", "local"], repeat],'
        " ...] making the 4 layers its model.safetensors holds")


@pytest.mark.parametrize("change, message", [
    ({"n_embd": None}, "n_embd=None is not supported: it must be a whole number"),
    ({"n_embd": {}}, "n_embd={} is not supported: it must be a whole number"),
    ({"n_head": "4"}, "n_head='4' is not supported: it must be a whole number"),
    ({"activation_function": []}, "activation_function=[] is not supported: tinylm has gelu"),
    ({"model_type": ["gpt2"]}, "model_type=['gpt2'] is not one tinylm loads"),
    ({"n_embd": list(range(1000))}, "n_embd=[0, 1, 2, 3, "),
])
def test_crafted_config_values_are_refused_in_one_line_naming_the_key(gpt2_folder, change,
                                                                      message):
    line = _refused(gpt2_folder, change)
    assert line.startswith(message) and len(line) < 200


def test_a_deeply_nested_config_json_is_refused_in_one_line(gpt2_folder):
    config_file = gpt2_folder / "config.json"
    config_file.write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(ValueError) as refused:
        load_checkpoint(gpt2_folder)
    assert str(refused.value) == f"{config_file} is not a JSON config: it is nested too deeply"


@pytest.mark.parametrize("kind, tensor", [("gpt2", "h.0.ln_1.weight"),
                                          ("gpt2", "h.2.attn.c_attn.weight"),
                                          ("gpt_neo", "h.1.attn.attention.q_proj.weight")])
def test_a_weight_of_another_rank_or_shape_is_refused_naming_the_tensor(bpe, tmp_path, kind,
                                                                        tensor):
    from safetensors import safe_open
    folder = tmp_path / kind
    _reference(kind, bpe.vocab_size, bpe.eot_id).save_pretrained(folder, safe_serialization=True)
    bpe.save(folder / "tokenizer.json")
    weights = folder / "model.safetensors"
    with safe_open(str(weights), "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    name = next(k for k in tensors if k.endswith(tensor))
    tensors[name] = tensors[name].reshape(-1) if tensors[name].dim() == 2 else (
        tensors[name].reshape(4, -1))
    save_file(tensors, str(weights), metadata={"format": "pt"})
    with pytest.raises(ValueError) as refused:
        load_checkpoint(folder)
    assert str(refused.value).startswith(
        f"{weights} does not fit the model its config.json describes: size mismatch for "
        f"{tensor}: {list(tensors[name].shape)} in the file, the model needs ")
    assert len(str(refused.value).splitlines()) == 1


@pytest.mark.parametrize("name", ["config.json", "model.safetensors", "tokenizer.json"])
def test_a_fifo_in_a_hugging_face_folder_is_named_and_never_opened(gpt2_folder, name):
    import signal

    def hung(*_):
        raise AssertionError(f"load_checkpoint opened the FIFO {name}")
    (gpt2_folder / name).unlink()
    os.mkfifo(gpt2_folder / name)
    previous = signal.signal(signal.SIGALRM, hung)
    signal.alarm(20)
    try:
        with pytest.raises(ValueError) as refused:
            load_checkpoint(gpt2_folder)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    assert str(refused.value) == (
        f"{gpt2_folder / name} is not a regular file (a FIFO, device or folder): put the model's "
        f"{name} there as a file")
