"""Every command on the Llama family: random-weight folders saved by transformers (a Llama with
grouped-query heads, rope_theta 5000 and its own LM head, whose tokenizer starts every text with
<s>; a Qwen2 with q/k/v biases and a tied head, whose tokenizer adds nothing), read by
tinylm-generate, tinylm-probe and tinylm-explain as a user runs them; transformers is the
reference for the greedy text and the rotated q·k that tinylm-explain prints."""

import json
import re
import sys

import pytest
import torch
from helpers import refusal, run_cli, save_llama_folder
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

import tinylm.cli.explain
import tinylm.cli.export
import tinylm.cli.generate
import tinylm.cli.probe
from tinylm.inspection.tensorboard_plugin import PLUGIN_NAME

transformers = pytest.importorskip("transformers")

PROMPT = "Lily and Tom went to the park. She"
LLAMA, QWEN2 = "llama-gqa-llama3", "qwen2"
GROUPS = ("grouped-query attention, in every layer: heads 0-1 share key/value head 0, heads 2-3 "
          "share key/value head 1")


def their_greedy(reference, folder, n: int) -> tuple[list[int], list[int]]:
    """transformers' tokens for PROMPT and its greedy continuation of up to n tokens."""
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_file=str(folder / "tokenizer.json"))
    prompt = tokenizer(PROMPT, return_tensors="pt").input_ids
    eos = reference.generation_config.eos_token_id
    out = reference.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False,
                             max_new_tokens=n, pad_token_id=eos)
    return prompt[0].tolist(), out[0, prompt.size(1):].tolist()


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """case -> (transformers' model, its folder). The Llama's LM head gives </s> a token's row,
    scaled up, so that its greedy continuation of PROMPT stops there, as a real model's does."""
    made = {}
    for case in (LLAMA, QWEN2):
        folder = tmp_path_factory.mktemp(case)
        made[case] = save_llama_folder(folder, case), folder
    reference, folder = made[LLAMA]
    _, free = their_greedy(reference, folder, 20)
    with torch.no_grad():
        head = reference.lm_head.weight
        head[reference.config.eos_token_id] = 1.05 * head[free[8]]
    reference.save_pretrained(folder)
    return made


def command(monkeypatch, capsys, module, *args) -> tuple[str, str]:
    """A command run in this process as from a shell: (stdout, stderr)."""
    monkeypatch.setattr(sys, "argv", [module.__name__, *args])
    module.main()
    captured = capsys.readouterr()
    return captured.out, captured.err


@pytest.mark.parametrize("case", [LLAMA, QWEN2])
def test_greedy_generation_continues_the_prompt_as_transformers_generate(
        folders, case, monkeypatch, capsys, tmp_path):
    reference, folder = folders[case]
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_file=str(folder / "tokenizer.json"))
    prompt_ids, new = their_greedy(reference, folder, 20)
    stops = new[-1] == reference.config.eos_token_id
    assert stops == (case == LLAMA)
    assert (prompt_ids[0] == tokenizer.convert_tokens_to_ids("<s>")) == (case == LLAMA)
    monkeypatch.chdir(tmp_path)
    out, err = command(monkeypatch, capsys, tinylm.cli.generate, f"checkpoint={folder}",
                       f'prompt="{PROMPT}"', "temperature=0", "max_new_tokens=20")
    text = tokenizer.decode(new[:-1] if stops else new)  # the end token is not printed
    assert out == PROMPT + text + "\n"  # the prompt as written, without its <s>
    # the stop is named by the model's own end token
    said = re.search(r"\[(\d+) tokens in [\d.]+s, \d+ tokens/s(.*)\]", err)
    assert int(said[1]) == len(new) and said[2] == (", stopped at </s>" if stops else "")


def test_inspect_names_the_heads_and_the_key_value_heads_they_share(folders, monkeypatch, capsys,
                                                                    tmp_path):
    _, folder = folders[LLAMA]
    logdir = tmp_path / "inspect"
    # "She" followed by a word: what the random model writes next cannot join it to another
    out, _ = command(monkeypatch, capsys, tinylm.cli.generate, f"checkpoint={folder}",
                     f'prompt="{PROMPT} saw"', "temperature=0", "max_new_tokens=5",
                     "inspect=true", f"logdir={logdir}")
    assert f"  {GROUPS}\n" in out
    for position in ("deciding", "resolving"):
        assert re.search(rf"'She' at character 31, {position} .*: (\d+/8 heads point at a name"
                         r"( \(\d+ at a name of the other gender\))?: L\dH\d -> \w+ "
                         r"(\(other gender\) )?[\d.]+|no head's top word is a name)", out), out
    record = json.loads((logdir / "inspect.json").read_text())
    assert record["kv_heads"] == [2, 2]
    heads = record["pronouns"][0]["deciding"]["heads"]
    assert [(h["layer"], h["head"], h["kv_head"]) for h in heads] == [
        (layer, head, head // 2) for layer in range(2) for head in range(4)]
    # the tab's data: the KV heads of each layer, the tokens from <s>, the text as written
    events = EventAccumulator(str(logdir), size_guidance={"tensors": 0})
    events.Reload()
    (tag,) = [tag for tag in events.Tags()["tensors"]
              if events.SummaryMetadata(tag).plugin_data.plugin_name == PLUGIN_NAME]
    content = json.loads(events.SummaryMetadata(tag).plugin_data.content)
    assert content["kv_heads"] == [2, 2] and content["shape"][:2] == [2, 4]
    assert content["tokens"][0] == "<s>" and content["tokens"].count("<s>") == 1
    assert content["text"].startswith(PROMPT)


def test_probe_patches_and_ablates_and_names_the_heads(folders, monkeypatch, capsys, tmp_path):
    for case, options in ((LLAMA, ["ablate=mean", "patch=true"]),
                          (QWEN2, ["ablate=true", "patch=fast"])):
        _, folder = folders[case]
        logdir = tmp_path / case
        out, err = command(monkeypatch, capsys, tinylm.cli.probe, f"checkpoint={folder}",
                           *options, f"logdir={logdir}")
        assert "(2 layers x 4 heads)" in err
        assert out.startswith(f"{GROUPS}\n")  # both: 4 query heads, 2 key/value heads
        assert re.search(r"singled out by (zeroed|mean|patching): (no head|(L\dH\d ?)+)\n", out)
        method = "exact" if options[1] == "patch=true" else "attribution"
        assert f"patching ({method}): each head's output copied from the counterfactual" in out
        report = json.loads((logdir / "probe.json").read_text())
        assert len(report["heads"]) == len(report["patching"]["heads"]) == 8
        assert report["patching"]["n_pairs"] >= 90, report["patching"]["skipped"][:3]
        events = EventAccumulator(str(logdir), size_guidance={"tensors": 0})
        events.Reload()
        texts = [json.loads(events.SummaryMetadata(tag).plugin_data.content)
                 for tag in events.Tags()["tensors"] if tag.startswith("patching/pair_")]
        # the pairs' clean texts are shown as written, each read once from its <s>
        assert texts and all("<s>" not in t["text"] for t in texts)
        assert all(t["tokens"].count("<s>") == (case == LLAMA) for t in texts)


def test_explain_shows_the_dot_products_of_the_rotated_q_and_k(folders, monkeypatch, capsys):
    reference, folder = folders[LLAMA]
    text = "Lily saw a cat. She"
    out, _ = command(monkeypatch, capsys, tinylm.cli.explain, f"checkpoint={folder}",
                     f'text="{text}"', "layer=1", "head=3", "query=She")
    said = " ".join(out.split())  # its paragraphs are wrapped
    assert "Its K and V are those of key/value head 1, which query heads 2..3 share" in said
    check = re.search(r"Check: the model's own forward pass gives this head the same weights "
                      r"\(max difference ([\d.e+-]+)\)\.", out)
    assert float(check[1]) < 1e-6
    # q·k as transformers' Llama computes it: q_proj and k_proj of the layer's normed input,
    # turned by apply_rotary_pos_emb; query head 3 reads key/value head 1
    seen = {}
    attn = reference.model.layers[1].self_attn
    handle = attn.register_forward_pre_hook(
        lambda module, args, kwargs: seen.update(kwargs), with_kwargs=True)
    ids = transformers.PreTrainedTokenizerFast(
        tokenizer_file=str(folder / "tokenizer.json"))(text, return_tensors="pt").input_ids
    with torch.no_grad():
        reference(ids)
        handle.remove()
        x, (cos, sin) = seen["hidden_states"], seen["position_embeddings"]
        T, hs = ids.size(1), attn.head_dim
        q = attn.q_proj(x).view(1, T, -1, hs).transpose(1, 2)
        k = attn.k_proj(x).view(1, T, -1, hs).transpose(1, 2)
        llama = sys.modules[type(attn).__module__]
        q, k = llama.apply_rotary_pos_emb(q, k, cos, sin)
        expected = q[0, 3, -1] @ k[0, 1].T  # (T,): the query is the last token, "She"
    walk = out[out.index(f"Query {T - 1} ' She', key by key:"):]
    shown = {int(j): float(v) for j, v in re.findall(r"\n +(\d+) '[^']*' +(-?\d+\.\d+)", walk)}
    assert len(shown) >= T - 1  # every key, or all but the one with the least weight
    for j, v in shown.items():
        assert v == pytest.approx(float(expected[j]), abs=1e-4), j


def test_export_refuses_a_llama_in_one_line_and_writes_nothing(folders, monkeypatch, tmp_path):
    _, folder = folders[LLAMA]
    said = refusal(tinylm.cli.export.main, f"checkpoint={folder}", f"out={tmp_path / 'out'}",
                   monkeypatch=monkeypatch)
    assert said.endswith("error: the model's blocks.0.attn.k_proj.weight has no place in GPT-2 "
                         "(the model is a LlamaLM): it cannot be exported as GPT-2; a pretrained "
                         "model's own folder is already one that transformers loads"), said
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_the_generate_command_from_a_shell_inspects_a_qwen2_folder(folders, tmp_path):
    _, folder = folders[QWEN2]
    done = run_cli("tinylm.cli.generate", f"checkpoint={folder}", f'prompt="{PROMPT}"',
                   "temperature=0", "max_new_tokens=8", "inspect=true", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(PROMPT) and f"  {GROUPS}\n" in done.stdout
    assert f"loaded {folder} (" in done.stderr and "[8 tokens in" in done.stderr
    (logdir,) = (tmp_path / "runs" / "pretrained" / folder.name / "inspect").iterdir()
    assert json.loads((logdir / "inspect.json").read_text())["kv_heads"] == [2, 2]
