"""The Llama family (tinylm/pretrained/llama.py): Llama, Qwen2 and Mistral folders loaded into
tinylm's own attention, with grouped-query heads, rotary positions and RMSNorm.

The reference is transformers itself: random-weight models of a small shape, saved as a user's
download would be, must give tinylm the same logits, attention weights and greedy tokens; the
configs of four real models are read and their shapes compared with transformers' on the meta
device (their weights are not downloaded here)."""

import json

import pytest
import torch
from helpers import BOS, EOS, LLAMA_CASES, LLAMA_VOCAB, make_llama_tokenizer, save_llama_folder
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, normalizers, processors
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast

from tinylm.generate import generate
from tinylm.hooks import run_with_cache
from tinylm.pretrained import llama
from tinylm.pretrained.common import layers_in
from tinylm.tokenizer import BPETokenizer, load_tokenizer

PROMPT = "Lily and Tom went to the park. She"


def load(folder):
    """What tinylm's loader does with a Llama-family folder: config read and checked against the
    weights' header, model built on the meta device, weights assigned, tokenizer with the
    config's end-of-text token."""
    hf = json.loads((folder / "config.json").read_text())
    weights = folder / "model.safetensors"
    config = llama.read_config(hf, folder / "config.json", layers_in(weights, llama.BLOCK))
    with torch.device("meta"):
        model = llama.LlamaLM(config)
    llama.load(weights, model)
    return model.eval(), llama.read_tokenizer(folder / "tokenizer.json", hf)


@pytest.fixture(scope="module", params=list(LLAMA_CASES))
def pair(request, tmp_path_factory):
    """(transformers' model, tinylm's, tinylm's tokenizer, the folder) of one case."""
    folder = tmp_path_factory.mktemp(request.param)
    theirs = save_llama_folder(folder, request.param)
    ours, tokenizer = load(folder)
    return theirs, ours, tokenizer, folder


def test_logits_equal_transformers(pair):
    theirs, ours, _, _ = pair
    # one matrix where the config ties them, two where it does not
    assert (ours.lm_head.weight is ours.wte.weight) == ours.config.tie_word_embeddings
    idx = torch.randint(0, ours.config.vocab_size, (2, 40),
                        generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(ours(idx).logits, theirs(idx).logits, atol=1e-5, rtol=1e-5)


def test_attention_weights_equal_transformers_and_keys_have_kv_heads(pair):
    theirs, ours, _, _ = pair
    c = ours.config
    idx = torch.randint(0, c.vocab_size, (1, 12), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        out, cache = run_with_cache(ours, idx, ["hook_pattern", "hook_q", "hook_k", "hook_v"])
        expected = theirs(idx, output_attentions=True).attentions
        fast = ours(idx).logits  # no hook on hook_pattern: the fused path
    torch.testing.assert_close(out.logits, fast, atol=1e-5, rtol=1e-5)
    hs = c.n_embd // c.n_head
    for i in range(c.n_layer):
        pattern = cache[f"blocks.{i}.attn.hook_pattern"]
        assert pattern.shape == (1, c.n_head, 12, 12)
        torch.testing.assert_close(pattern.sum(-1), torch.ones(1, c.n_head, 12))
        torch.testing.assert_close(pattern, expected[i], atol=1e-5, rtol=1e-5)
        assert cache[f"blocks.{i}.attn.hook_q"].shape == (1, c.n_head, 12, hs)
        assert cache[f"blocks.{i}.attn.hook_k"].shape == (1, c.kv_heads, 12, hs)
        assert cache[f"blocks.{i}.attn.hook_v"].shape == (1, c.kv_heads, 12, hs)


def test_kv_cache_decoding_equals_full_forward_and_holds_kv_heads(pair):
    _, ours, _, _ = pair
    c = ours.config
    idx = torch.randint(0, c.vocab_size, (2, 16), generator=torch.Generator().manual_seed(3))
    cache = ours.new_kv_cache(2, max_len=16)
    assert cache._k.shape == (c.n_layer, 2, c.kv_heads, 16, c.n_embd // c.n_head)
    with torch.no_grad():
        full = ours(idx).logits
        steps = [ours(idx[:, :9], kv_cache=cache).logits]  # a prompt, then a token at a time
        steps += [ours(idx[:, t:t + 1], kv_cache=cache).logits for t in range(9, 16)]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=1e-5, rtol=1e-5)


def test_tokenizer_encodes_as_transformers_with_its_bos(pair):
    _, _, tokenizer, folder = pair
    theirs = PreTrainedTokenizerFast(tokenizer_file=str(folder / "tokenizer.json"))
    ids, offsets = tokenizer.encode_with_offsets(PROMPT)
    assert ids == theirs(PROMPT).input_ids
    has_bos = theirs.convert_tokens_to_ids(BOS) == ids[0]
    assert has_bos == (json.loads((folder / "config.json").read_text())["model_type"] != "qwen2")
    if has_bos:
        assert offsets[0] == (0, 0)
        assert tokenizer.token_strings(ids)[0] == BOS
    # the BOS the post-processor adds is left out again: decode(encode(text)) == text
    assert tokenizer.decode(ids) == tokenizer.decode(ids[1:] if has_bos else ids) == PROMPT


def test_greedy_continuation_equals_transformers_generate(pair):
    theirs, ours, tokenizer, _ = pair
    assert tokenizer.eot_id == theirs.config.eos_token_id  # generation stops at config's eos
    prompt = torch.tensor([tokenizer.encode(PROMPT)])
    expected = theirs.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False,
                               max_new_tokens=20, pad_token_id=tokenizer.eot_id)
    for use_cache in (True, False):
        got = generate(ours, prompt, 20, temperature=0, stop_id=tokenizer.eot_id,
                       use_cache=use_cache)
        assert got.tolist() == expected.tolist()


def test_generation_stops_where_transformers_stops(pair):
    theirs, ours, _, _ = pair
    prompt = torch.tensor([[5, 17, 42, 8]])
    free = generate(ours, prompt, 12, temperature=0)[0, 4:].tolist()
    stop = free[5]  # a token it emits: the end-of-text token of this run
    original = theirs.generation_config.eos_token_id
    theirs.generation_config.eos_token_id = stop
    try:
        expected = theirs.generate(prompt, attention_mask=torch.ones_like(prompt),
                                   do_sample=False, max_new_tokens=12, pad_token_id=stop)
    finally:
        theirs.generation_config.eos_token_id = original
    got = generate(ours, prompt, 12, temperature=0, stop_id=stop)
    assert got.tolist() == expected.tolist()
    assert got[0, -1] == stop and got.size(1) == 4 + free.index(stop) + 1


def test_generate_allocates_the_cache_for_the_text_not_the_context(pair, monkeypatch):
    _, ours, _, _ = pair
    asked = []
    new_kv_cache = ours.new_kv_cache
    monkeypatch.setattr(ours, "new_kv_cache",
                        lambda b, max_len=None: asked.append(max_len) or new_kv_cache(b, max_len))
    generate(ours, torch.tensor([[1, 2, 3]]), 5, temperature=0)
    generate(ours, torch.tensor([[1, 2, 3]]), 500, temperature=0)  # more than block_size=64
    assert asked == [8, 64]


# ---- refusals ---------------------------------------------------------------------------------

LLAMA = {"model_type": "llama", "vocab_size": 300, "hidden_size": 32, "intermediate_size": 64,
         "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
         "max_position_embeddings": 64}


@pytest.mark.parametrize("change, words", [
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, ["rope_scaling=", "'yarn'",
                                                              "default, linear, llama3"]),
    ({"rope_scaling": {"type": "dynamic", "factor": 2.0}}, ["'dynamic'", "linear, llama3"]),
    ({"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4}}, ["rope_parameters=",
                                                                          "'longrope'"]),
    ({"num_hidden_layers": 3}, ["num_hidden_layers=3", "holds 2 layers"]),
    ({"head_dim": 16}, ["head_dim=16", "8 wide"]),
    ({"hidden_act": "gelu"}, ["hidden_act='gelu'", "silu"]),
    ({"model_type": "mistral", "sliding_window": 16}, ["sliding_window=16"]),
    ({"model_type": "qwen2", "use_sliding_window": True, "sliding_window": 16},
     ["sliding_window=16"]),
    ({"num_key_value_heads": 3}, ["model.n_kv_head=3", "divide model.n_head=4"]),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, ["low_freq_factor=None"]),
    ({"partial_rotary_factor": 0.5}, ["partial_rotary_factor=0.5"]),
    ({"num_attention_heads": 32}, ["n_head must be even"]),
    ({"intermediate_size": 64.0}, ["intermediate_size=64.0", "whole number"]),
    ({"num_key_value_heads": "2"}, ["num_key_value_heads='2'", "whole number"]),
    ({"intermediate_size": [1] * 100_000}, ["intermediate_size=[1, 1,", "...", "whole number"]),
    ({"rms_norm_eps": {"e": "x" * 100_000}}, ["rms_norm_eps={'e': 'xxx", "..."]),
])
def test_what_tinylm_cannot_do_is_refused_in_one_line(tmp_path, change, words):
    where = tmp_path / "config.json"
    with pytest.raises(ValueError) as err:
        llama.read_config({**LLAMA, **change}, where, layers=2)
    message = str(err.value)
    assert "\n" not in message and message.startswith(str(where))
    assert len(message) < len(str(where)) + 200  # a crafted value is cut, not printed whole
    for word in words:
        assert word in message, message


def test_mistral_without_a_window_and_qwen2_with_its_window_off_load(tmp_path):
    llama.read_config({**LLAMA, "model_type": "mistral", "sliding_window": None}, tmp_path, 2)
    llama.read_config({**LLAMA, "model_type": "mistral", "sliding_window": 64}, tmp_path, 2)
    config = llama.read_config({**LLAMA, "model_type": "qwen2", "sliding_window": 16}, tmp_path, 2)
    # Qwen2's q, k, v have biases whatever its config says, its o_proj none
    assert config.attention_bias and not config.out_proj_bias


# ---- real models' configs (config.json as published; their weights are not run here) ----------

REAL = {
    "SmolLM2-135M": {
        "model_type": "llama", "attention_bias": False, "bos_token_id": 0, "eos_token_id": 0,
        "hidden_act": "silu", "hidden_size": 576, "intermediate_size": 1536,
        "max_position_embeddings": 8192, "num_attention_heads": 9, "num_hidden_layers": 30,
        "num_key_value_heads": 3, "pretraining_tp": 1, "rms_norm_eps": 1e-05,
        "rope_interleaved": False, "rope_scaling": None, "rope_theta": 100000,
        "tie_word_embeddings": True, "vocab_size": 49152},
    "Qwen2.5-0.5B": {
        "model_type": "qwen2", "bos_token_id": 151643, "eos_token_id": 151643,
        "hidden_act": "silu", "hidden_size": 896, "intermediate_size": 4864,
        "max_position_embeddings": 32768, "max_window_layers": 24, "num_attention_heads": 14,
        "num_hidden_layers": 24, "num_key_value_heads": 2, "rms_norm_eps": 1e-06,
        "rope_theta": 1000000.0, "sliding_window": 32768, "tie_word_embeddings": True,
        "use_sliding_window": False, "vocab_size": 151936},
    "TinyLlama-1.1B": {
        "model_type": "llama", "bos_token_id": 1, "eos_token_id": 2, "hidden_act": "silu",
        "hidden_size": 2048, "intermediate_size": 5632, "max_position_embeddings": 2048,
        "num_attention_heads": 32, "num_hidden_layers": 22, "num_key_value_heads": 4,
        "pretraining_tp": 1, "rms_norm_eps": 1e-05, "rope_scaling": None, "rope_theta": 10000.0,
        "tie_word_embeddings": False, "vocab_size": 32000},
    "Llama-3.2-1B": {
        "model_type": "llama", "attention_bias": False, "bos_token_id": 128000,
        "eos_token_id": 128001, "head_dim": 64, "hidden_act": "silu", "hidden_size": 2048,
        "intermediate_size": 8192, "max_position_embeddings": 131072, "mlp_bias": False,
        "num_attention_heads": 32, "num_hidden_layers": 16, "num_key_value_heads": 8,
        "pretraining_tp": 1, "rms_norm_eps": 1e-05,
        "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                         "original_max_position_embeddings": 8192, "rope_type": "llama3"},
        "rope_theta": 500000.0, "tie_word_embeddings": True, "vocab_size": 128256},
}


@pytest.mark.parametrize("name", list(REAL))
def test_real_configs_build_transformers_shapes(tmp_path, name):
    """Each real config reads, and the model it builds (on the meta device) has transformers'
    parameter count, a tensor of transformers' shape for every name it reads, and its rotary
    frequencies."""
    hf = REAL[name]
    config = llama.read_config(hf, tmp_path / "config.json", hf["num_hidden_layers"])
    assert llama.eos_id(hf) == hf["eos_token_id"]
    with torch.device("meta"):
        ours = llama.LlamaLM(config)
        theirs = AutoModelForCausalLM.from_config(
            AutoConfig.for_model(**{k: v for k, v in hf.items() if k != "rope_interleaved"}))
    assert ours.num_params() == sum(p.numel() for p in theirs.parameters())
    shapes = {name: t.shape for name, t in theirs.state_dict().items()}
    ours_shapes = {name: t.shape for name, t in ours.state_dict().items()}
    for mine, stored in llama.table(config.n_layer).items():
        if mine in ours_shapes:  # a bias this config has not is not read
            assert ours_shapes[mine] == shapes[stored], (mine, stored)
    rotary = type(theirs.model.rotary_emb)(theirs.config)  # again, off the meta device
    torch.testing.assert_close(ours.blocks[0].attn.rotary.freq, rotary.inv_freq)


# ---- tokenizers -------------------------------------------------------------------------------


def test_tinylm_tokenizers_have_no_post_processor_so_their_ids_are_unchanged(bpe):
    assert json.loads(bpe.hf.to_str())["post_processor"] is None
    texts = [PROMPT, "", "Café au lait. <|endoftext|>Once upon a time"]
    for text in texts:
        assert bpe.encode(text) == bpe.hf.encode(text, add_special_tokens=False).ids
    assert bpe.encode_batch(texts) == [
        e.ids for e in bpe.hf.encode_batch(texts, add_special_tokens=False)]


def test_end_of_text_comes_from_the_loader(tmp_path):
    path = tmp_path / "tokenizer.json"
    make_llama_tokenizer(bos=True, eos=EOS).save(str(path))
    with pytest.raises(ValueError, match="no <\\|endoftext\\|> token"):
        load_tokenizer(path)
    tokenizer = load_tokenizer(path, eot_id=2)
    assert tokenizer.eot_id == 2 and tokenizer.token_strings([2]) == [EOS]
    with pytest.raises(ValueError, match="outside"):
        load_tokenizer(path, eot_id=LLAMA_VOCAB + 5)
    assert llama.eos_id({"model_type": "llama", "eos_token_id": [7, 9]}) == 7
    assert llama.eos_id({"model_type": "llama"}) == 2  # transformers' default for Llama
    assert llama.eos_id({"model_type": "qwen2"}) is None


def test_sentencepiece_style_tokens_are_labelled_with_spaces_and_bytes():
    """Llama 2's and TinyLlama's tokenizer.json spell a space "▁" and a byte "<0x0A>"."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "<0x0A>": 3, "▁": 4, "▁c": 5, "a": 6, "t": 7,
             "▁ca": 8, "▁cat": 9, "c": 10}
    hf = HFTokenizer(models.BPE(vocab, [("▁", "c"), ("▁c", "a"), ("▁ca", "t")], unk_token="<unk>",
                                byte_fallback=True))
    hf.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    hf.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                    decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    hf.add_special_tokens(["<unk>", "<s>", "</s>"])
    hf.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    tokenizer = BPETokenizer(hf, eot_id=2)
    ids, offsets = tokenizer.encode_with_offsets("cat\ncat")
    assert tokenizer.token_strings(ids) == ["<s>", " cat", "\n", "c", "a", "t"]
    assert offsets[0] == (0, 0) and tokenizer.decode(ids) == "cat\ncat"
