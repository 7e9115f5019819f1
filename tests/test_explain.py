"""tinylm-explain: the walkthrough's numbers, its modes, its errors and its command line."""

from __future__ import annotations

import math
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from helpers import attention_with_weights, compose, to_dataclass

import tinylm.cli.sizes
from tinylm.attention import MultiHeadAttention
from tinylm.checkpoint import save_checkpoint
from tinylm.cli.explain import ExplainConfig, explain
from tinylm.hooks import hooks
from tinylm.inspection.walkthrough import (
    example_attention,
    explain_given_qkv,
    explain_model_head,
    mask_and_scale,
    model_head_steps,
    multi_head_walk,
)
from tinylm.model import ModelConfig

ROOT = Path(__file__).resolve().parents[1]
STORY = "Lily saw a cat. She smiled at the cat. The cat ran to Lily. She laughed."


def table(text: str, title: str) -> list[list[str]]:
    """The cells of the table whose title starts with `title`, one list per row (label first).

    Tables set side by side are read by column position, so this only looks at the slice of
    each line under the title.
    """
    lines = text.splitlines()
    n = next((n for n, line in enumerate(lines) if title in line), None)
    assert n is not None, f"no table titled {title!r} in:\n{text}"
    line = lines[n]
    start = line.find(title)
    end = line.find("    ", start + len(title))  # the next table to the right, if any
    rows = []
    for row in lines[n + 2:]:
        cells = row[max(0, start - 2):end if end > 0 else None].replace(">", " ").split()
        if not cells:
            break
        rows.append(cells)
    return rows


def floats(cells: list[str]) -> list[float]:
    return [float(c) for c in cells]


def test_default_walkthrough_matches_the_explainers_numbers():
    text = explain(ExplainConfig())

    # docs/attention.md's first query [1, 0]: scaled scores, weights and output, to 3 decimals
    assert [round(x, 3) for x in floats(table(text, "2. Scaled")[0][1:])] == [0.707, 0.0, 0.707]
    assert [round(x, 3) for x in floats(table(text, "5. Weights")[0][1:])] == [0.401, 0.198, 0.401]
    assert [round(x, 3) for x in floats(table(text, "6. Output")[0][1:])] == [0.802, 0.797]
    # its exponentials without the max subtracted, and their sum
    raw = re.search(r"exponentials are ([\d.]+), ([\d.]+), ([\d.]+),\s+sum ([\d.]+)", text)
    assert [round(float(x), 3) for x in raw.groups()] == [2.028, 1.0, 2.028, 5.056]
    # the weighted sum spelled out as in docs/attention.md
    assert "output d0 = 0.4011·1 + 0.1978·0 + 0.4011·1 = 0.8022" in text
    assert "output d1 = 0.4011·0 + 0.1978·2 + 0.4011·1 = 0.7967" in text
    # every row's weights sum to 1
    for row in table(text, "5. Weights"):
        assert sum(floats(row[1:])) == pytest.approx(1.0, abs=2e-4)


def test_causal_variant_has_zero_weights_above_the_diagonal():
    torch.manual_seed(0)
    q = torch.randn(4, 3).round(decimals=2).tolist()
    text = explain(ExplainConfig(q=q, causal=True, query=2))

    mask = table(text, "Causal mask")
    weights = [floats(row[1:]) for row in table(text, "5. Weights")]
    masked = [row[1:] for row in table(text, "Masked scores")]
    for i in range(4):
        for j in range(4):
            assert (mask[i][1 + j] == "hide") == (j > i)
            if j > i:
                assert weights[i][j] == 0.0 and masked[i][j] == "-inf"
            else:
                assert masked[i][j] != "-inf"
    assert weights[0][0] == 1.0  # the first token can only look at itself
    # the comparison with the unmasked output: the last row sees every key, so it is unchanged
    change = table(text, "How the mask changes")
    assert change[-1][1:4] == change[-1][4:7]
    assert change[0][-1] == "k0"


def test_multi_head_walkthrough_equals_multi_head_attention():
    torch.manual_seed(0)
    attn = MultiHeadAttention(n_embd=8, n_head=2, bias=True).eval()
    x = torch.randn(5, 8)
    walk = multi_head_walk(attn, x)
    with torch.no_grad():
        y, weights = attention_with_weights(attn, x[None])
    torch.testing.assert_close(walk.output, y[0])
    torch.testing.assert_close(walk.steps.weights, weights[0])
    # the concatenation really is the heads' outputs side by side
    torch.testing.assert_close(walk.concat[:, 4:], walk.steps.output[1])


def test_multi_head_mode_prints_each_head_and_checks_itself():
    text = explain(ExplainConfig(n_head=2, x=[[1, 0, 0, 1], [0, 1, 1, 0], [1, 1, 0, 0]]))
    assert "--- head 0 ---" in text and "--- head 1 ---" in text
    assert "Concatenated heads" in text and "out_proj" in text
    assert re.search(r"same output \(max difference 0\.0e\+00\)", text)
    # each head's weights are causal too, as MultiHeadAttention's always are
    attn, _ = example_attention(4, 2, seed=0)
    walk = multi_head_walk(attn, torch.tensor([[1.0, 0, 0, 1], [0, 1, 1, 0], [1, 1, 0, 0]]))
    assert torch.all(walk.steps.weights.triu(diagonal=1) == 0)


def test_multi_head_mode_prints_w_o_so_that_the_last_step_can_be_redone_by_hand():
    """Y = concat · W_oᵀ from the printed tables alone: W_o is printed (out_proj.weight, its
    rows the output's columns d0.., its columns the concatenated heads' h0.0..)."""
    text = explain(ExplainConfig(n_head=2))
    assert text.index("W_o (out_proj.weight)") < text.index("Output Y = concat · W_oᵀ")
    lines = text.splitlines()
    start = next(n for n, line in enumerate(lines) if "W_o (out_proj.weight)" in line) + 2
    cells = [line.split() for line in lines[start:start + 4]]  # t0 ... d0 ..., ..., d3 ...
    concat = torch.tensor([floats(row[1:5]) for row in cells[:3]])
    w_o = torch.tensor([floats(row[-4:]) for row in cells])
    assert [row[-5] for row in cells] == ["d0", "d1", "d2", "d3"]
    y = torch.tensor([floats(r[1:]) for r in table(text, "Output Y = concat")])
    attn, _ = example_attention(4, 2, seed=0)
    assert torch.equal(w_o, attn.out_proj.weight.detach())  # rounded to 2 decimals: exact
    torch.testing.assert_close(concat @ w_o.T, y, atol=2e-4, rtol=0)


def test_rows_are_numbered_from_0_and_the_walkthrough_says_which_is_the_explainers_first():
    """q0 is the explainer's "query 1"; query= counts from 0, as before, and the output says
    so (as query's help does)."""
    text = explain(ExplainConfig())
    assert "numbered from 0 (q0 is the explainer's query 1)" in " ".join(text.split())
    assert "> q0" in text and "Query q0 = [1, 0], key by key:" in text
    assert "Query q2 = [1, 1], key by key:" in explain(ExplainConfig(query=2))


def test_the_heatmaps_label_the_masked_cells():
    from tinylm.inspection.figures import steps_figure

    def labels(causal):
        fig = steps_figure(explain_given_qkv(causal=causal).panels, "t")
        legend = [t.get_text() for lgd in fig.legends for t in lgd.get_texts()]
        cells = [t.get_text() for ax in fig.axes for t in ax.texts]
        return legend, cells.count("masked")

    assert labels(causal=True) == (
        ["masked: key after the query (score -inf, weight 0)"], 6)  # 3 cells, in 2 panels
    assert labels(causal=False) == ([], 0)  # nothing hidden: no legend


def test_checkpoint_head_equals_the_models_own_attention(model, bpe):
    idx = torch.tensor(bpe.encode(STORY))
    with torch.no_grad():
        attentions = model(idx[None], return_attention=True).attentions
    for layer in range(2):
        for head in range(2):
            found = model_head_steps(model, idx, layer, head)
            torch.testing.assert_close(found.steps.weights, attentions[layer][0, head])
            assert torch.equal(found.weights, attentions[layer][0, head])
            assert (found.kv_head, found.group) == (head, 1)


def test_checkpoint_mode_takes_q_k_v_from_the_hook_points(model, bpe):
    # q is no longer what qkv_proj gives (as a rotated one is not): recomputed from qkv_proj,
    # the steps would disagree with the weights the forward pass had
    idx = torch.tensor(bpe.encode(STORY))
    with hooks(model, {"blocks.1.attn.hook_q": lambda q: 3 * q.flip(-1)}):
        found = model_head_steps(model, idx, 1, 0)
    torch.testing.assert_close(found.steps.weights, found.weights)
    assert not torch.allclose(found.weights, model_head_steps(model, idx, 1, 0).weights)


class GroupedAttention(MultiHeadAttention):
    """Grouped-query attention as a Llama layer has it: n_head / 2 key/value heads, each shared
    by two consecutive query heads (here the even heads' keys and values of the plain layer)."""

    def project_heads(self, x, start=0):
        q, k, v = super().project_heads(x, start)
        return q, k[:, ::2], v[:, ::2]  # (B, nh, T, hs), (B, nh / 2, T, hs) each

    def attend(self, q, k, v):
        group = q.size(1) // k.size(1)
        return super().attend(q, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1))


class BandAttention(MultiHeadAttention):
    """A local layer as GPT-Neo has one: the last 3 positions visible, scores unscaled."""

    scale = 1.0

    def hidden(self, t_q, t_k, device):
        return torch.ones(t_q, t_k, dtype=torch.bool, device=device).tril(t_k - t_q - 3)


class SinkHiddenAttention(MultiHeadAttention):
    """A layer that never looks at position 0 (except from there): no band."""

    def hidden(self, t_q, t_k, device):
        hidden = torch.zeros(t_q, t_k, dtype=torch.bool, device=device)
        hidden[1:, 0] = True
        return hidden


def with_attention(model, cls):
    """`model` with each layer's attention made a `cls`, with the same weights."""
    for block in model.blocks:
        attn = cls(model.config.n_embd, model.config.n_head, 0.0, model.config.bias).eval()
        attn.load_state_dict(block.attn.state_dict())
        block.attn = attn
    return model


def test_each_query_head_reads_the_key_value_head_it_shares_with_its_group(tiny_model, bpe):
    model = with_attention(tiny_model(bpe.vocab_size, n_head=4, n_embd=32), GroupedAttention)
    idx = torch.tensor(bpe.encode(STORY))
    for head in range(4):
        found = model_head_steps(model, idx, 1, head)
        assert (found.kv_head, found.group) == (head // 2, 2)
        torch.testing.assert_close(found.steps.weights, found.weights)
    text = explain_model_head(model, bpe, STORY, layer=1, head=3).text
    assert ("Its K and V are those of key/value head 1, which query heads 2..3 share "
            "(grouped-query attention).") in " ".join(text.split())
    assert re.search(r"same weights \(max difference 0\.0e\+00\)", text)


def test_a_local_layers_band_and_scale_are_said_from_its_mask_and_scale(tiny_model, bpe):
    plain = tiny_model(bpe.vocab_size)
    assert mask_and_scale(plain.blocks[0].attn, 8, 64) == ""
    model = with_attention(tiny_model(bpe.vocab_size), BandAttention)
    assert mask_and_scale(model.blocks[0].attn, 8, 64) == (
        " and local: each token sees only the last 3 positions (a banded mask); the scores are "
        "multiplied by 1, not divided by √d (the '/√d' column shows them after that)")
    text = " ".join(explain_model_head(model, bpe, STORY, layer=1, head=0).text.split())
    assert "attention is causal and local: each token sees only the last 3 positions" in text
    found = model_head_steps(model, torch.tensor(bpe.encode(STORY)), 1, 0)
    assert torch.equal((found.weights > 0).sum(-1)[2:], torch.full((len(found.weights) - 2,), 3))
    torch.testing.assert_close(found.steps.weights, found.weights)
    other = with_attention(tiny_model(bpe.vocab_size), SinkHiddenAttention)
    assert mask_and_scale(other.blocks[0].attn, 8, 64) == (
        " and masked: some earlier positions are hidden too, besides the later ones")


def test_checkpoint_mode_follows_the_query_word_and_shortens_long_rows(model, bpe, tmp_path):
    save_checkpoint(tmp_path, model, bpe, run_config={}, step=1)
    text = explain(ExplainConfig(checkpoint=str(tmp_path), text=STORY, layer=1, head=0,
                                 query="laughed", top=3))
    tokens = bpe.token_strings(bpe.encode(STORY))
    i = [t.strip() for t in tokens].index("laughed")
    assert f"The query is token {i} {tokens[i]!r}" in text
    rows = table(text, f"Query {i} ")
    assert [row[0] for row in rows].index("sum") == 3  # the 3 largest weights, then the sums
    assert f"the 3 of {i + 1} visible keys with the largest weights" in text
    assert re.search(r"same weights \(max difference \d\.\de[-+]\d\d\)", text)
    diff = float(re.search(r"same weights \(max difference (\S+)\)", text).group(1))
    assert diff < 1e-6


@pytest.mark.slow
def test_figures_are_written_as_png_and_tensorboard(tmp_path):
    text = explain(ExplainConfig(causal=True, png=str(tmp_path / "a.png"),
                                 logdir=str(tmp_path / "tb")))
    assert (tmp_path / "a.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert list((tmp_path / "tb").glob("events.out.tfevents.*"))
    assert "Figure written to" in text


@pytest.mark.parametrize("cfg, message", [
    (dict(q=[[1, 0], [0]]), "q is ragged: row 0 has 2 numbers but row 1 has 1"),
    (dict(q=[[1, 0]], k=[[1, 0, 0]]), "q rows have 2 numbers but k rows have 3"),
    (dict(q=[[1, 0]], k=[[1, 0], [0, 1]], v=[[1, 0]]), "k has 2 rows (tokens) but v has 1"),
    (dict(q=[[1, "a"]]), "q[0][1] = 'a' is not allowed: entries must be finite numbers"),
    # finite in float64, inf in float32
    (dict(q=[[1e308, 1], [1, 1]]), "q[0][0] = 1e+308 does not fit in float32: entries must be "
     "at most 3.4028235e+38 in magnitude"),
    (dict(q=[[1]], v=[[-(10**400)]]), "v[0][0] = about 1e400 does not fit in float32"),
    (dict(n_head=2, x=[[1, 1, 1, 4e38]]), "x[0][3] = 4e+38 does not fit in float32"),
    # each entry fits, their dot products do not
    (dict(q=[[1e20, 1], [1, 1]]), "the numbers overflow float32 on the way (a dot product or "
     "sum beyond 3.4028235e+38 in magnitude), which would make the weights NaN: give smaller "
     "numbers in q, k and v"),
    (dict(n_head=2, x=[[1e38, 1, 1, 1], [1, 1, 1, 1]]), "would make the weights NaN: give "
     "smaller numbers in x"),
    (dict(q="1,0"), "q='1,0' is not a list of rows of numbers"),
    (dict(query=7), "query=7 is out of range: there are 3 queries, so use an index 0..2"),
    (dict(n_head=3), "d_model=4 is not divisible by n_head=3"),
    (dict(n_head=2, q=[[1, 0]]), "n_head mode projects Q, K, V from x"),
    (dict(x=[[1, 0]]), "x and d_model are for multi-head mode; add n_head"),
    (dict(n_head=2, x=[[1, 0, 1, 0]], d_model=6), "d_model=6 but x rows have 4 numbers"),
    (dict(n_head=2, query=1), "n_head mode shows every row"),
    (dict(qkv_file="a.json", q=[[1]]), "either in qkv_file='a.json' or on the command line (q)"),
    (dict(digits=-1), "digits=-1 is not allowed: must be an integer >= 0"),
    (dict(digits=10), "digits=10 is not allowed: must be at most 9: the numbers are float32"),
    (dict(n_head=2, d_model=10**7), "d_model=10000000 is more than the memory can hold: the "
     "walkthrough would print 400,000,180,000,036 numbers, about 256 bytes each, and"),
    (dict(checkpoint="run"), "checkpoint mode needs text="),
])
def test_bad_inputs_give_clear_errors(cfg, message):
    with pytest.raises(ValueError) as err:
        explain(ExplainConfig(**cfg))
    assert message in str(err.value)


@pytest.mark.parametrize("cfg, message", [
    (dict(query="dog"), "query='dog' is not one of the tokens: 0 'L"),
    (dict(query=-99), "query=-99 is out of range: there are"),
    (dict(layer=2), "layer=2 is out of range: the model has 2 layers (0..1)"),
    (dict(head=5), "head=5 is out of range: the model has 2 heads per layer (0..1)"),
    (dict(text="Lily " * 100), "but the model reads at most block_size=64"),
])
def test_bad_checkpoint_mode_inputs_give_clear_errors(model, bpe, cfg, message):
    cfg = {"checkpoint": "run", "text": STORY} | cfg
    with pytest.raises(ValueError) as err:
        cfg = ExplainConfig(**cfg)
        explain_model_head(model, bpe, cfg.text, cfg.layer, cfg.head, cfg.query, cfg.top,
                           cfg.digits)
    assert message in str(err.value)


def test_matrices_too_large_to_walk_through_are_refused_naming_what_fits(tmp_path,
                                                                         monkeypatch):
    available = SimpleNamespace(virtual_memory=lambda: SimpleNamespace(available=2**22))
    monkeypatch.setattr(tinylm.cli.sizes, "psutil", available)  # what refuse_unless_held reads
    with pytest.raises(ValueError) as err:
        explain(ExplainConfig(q=[[1]] * 300_000))
    # K = Q: Q, K, V and the output print 6 numbers per row, the steps 8 per query and key
    fits = max(t for t in range(1000) if (8 * t * t + 6 * t) * 256 <= 2**22)
    assert str(err.value) == (
        "q=[300,000 rows] is more than the memory can hold: the walkthrough would print "
        f"{8 * 300_000**2 + 6 * 300_000:,} numbers, about 256 bytes each, and 4 MiB are "
        f"available now; give q with at most {fits:,} rows")
    with pytest.raises(ValueError, match=f"give q with at most {fits} rows"):
        explain(ExplainConfig(q=[[1]] * (fits + 1)))
    assert "Your Q, K, V" in explain(ExplainConfig(q=[[1]] * fits))

    many = tmp_path / "many.json"  # 1.5 MB: the parser would hold 512 bytes for each
    many.write_text('{"q": [' + ", ".join(["[1]"] * 300_000) + "]}")
    with pytest.raises(ValueError) as err:
        explain(ExplainConfig(qkv_file=str(many)))
    assert str(err.value) == (
        f"qkv_file={many} is more than the memory can hold: reading it holds about 512 bytes per "
        f"byte, and 4 MiB are available now; give qkv_file with at most {2**22 // 512:,} bytes")


def test_a_qkv_file_that_is_no_regular_file_is_named_for_what_it_is(tmp_path):
    fifo = tmp_path / "qkv.yaml"
    if hasattr(os, "mkfifo"):
        os.mkfifo(fifo)  # opened, it would wait for a writer forever
    for path, kind in (("/dev/null", "a pipe or device"), (str(tmp_path), "a folder"),
                       *([(str(fifo), "a pipe or device")] if fifo.exists() else [])):
        with pytest.raises(ValueError) as refused:
            explain(ExplainConfig(qkv_file=path))
        assert str(refused.value) == f"qkv_file {path} is {kind}, not a regular file; give a file"
    with pytest.raises(FileNotFoundError, match=f"^qkv_file {tmp_path / 'no.yaml'} does not"):
        explain(ExplainConfig(qkv_file=str(tmp_path / "no.yaml")))


def test_qkv_file_is_read_and_checked(tmp_path):
    good = tmp_path / "qkv.json"
    good.write_text('{"q": [[1, 0], [0, 1]], "v": [[1, 2], [3, 4]]}')
    text = explain(ExplainConfig(qkv_file=str(good)))
    assert "(K = Q: k not given)" in text
    bad = tmp_path / "qkv.yaml"
    bad.write_text("q: [[1, 0]]\nw: [[1]]\n")
    with pytest.raises(ValueError, match="has unknown key w; allowed: q, k, v, x"):
        explain(ExplainConfig(qkv_file=str(bad)))
    for broken, why in (("q: [[1, 0]\nk: 3\n", "expected ',' or ']', but got '<scalar>' at line "
                                                "2, column 1"),
                        (b"\xff\xfe", "'utf-8' codec can't decode byte 0xff")):
        bad.write_bytes(broken if isinstance(broken, bytes) else broken.encode())
        with pytest.raises(ValueError) as refused:  # one line, naming the file
            explain(ExplainConfig(qkv_file=str(bad)))
        assert str(refused.value).startswith(f"qkv_file={str(bad)!r} is not valid JSON or YAML: "
                                             + why) and "\n" not in str(refused.value)


def test_a_number_past_float32_on_the_command_line_is_refused():
    cfg = compose("explain", ["q=[[1e308,1],[1,1]]"])  # as the shell passes it to Hydra
    with pytest.raises(ValueError, match=r"^q\[0\]\[0\] = 1e\+308 does not fit in float32"):
        explain(to_dataclass(ExplainConfig, cfg, "explain"))


def test_yaml_defaults_match_the_dataclass():
    cfg = compose("explain", ["q=[[1,0],[0,1]]", "causal=true"])
    assert to_dataclass(ExplainConfig, cfg, "explain") == ExplainConfig(q=[[1, 0], [0, 1]],
                                                                         causal=True)


@pytest.mark.slow
def test_command_line_prints_the_walkthrough_and_writes_no_files(tmp_path):
    script = str(ROOT / "scripts" / "explain.py")
    done = subprocess.run([sys.executable, script, "causal=true", "q=[[1,0],[0,1],[1,1]]"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "Causal scaled dot-product attention" in done.stdout
    assert "0.3302" in done.stdout  # query 1 under the mask: weights 0.3302, 0.6698
    assert list(tmp_path.iterdir()) == []  # no outputs/, .hydra/ or log files

    done = subprocess.run([sys.executable, script, "q=[[1,0],[0]]"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 1
    assert done.stderr.strip() == ("tinylm-explain: error: q is ragged: row 0 has 2 numbers but "
                                   "row 1 has 1; every row needs the same count "
                                   "(e.g. q=[[1,0],[0,1]])")


@pytest.mark.slow
def test_docs_attention_quotes_what_tinylm_explain_prints():
    doc = (ROOT / "docs" / "attention.md").read_text()
    # each console block: "$ tinylm-explain <arguments>", then lines of its output ("..." skips)
    blocks = re.findall(r"```console\n\$ tinylm-explain([^\n]*)\n(.*?)```", doc, re.S)
    assert len(blocks) == 5
    printed = []
    for args, quoted in blocks:
        cfg = compose("explain", shlex.split(args))
        text = explain(to_dataclass(ExplainConfig, cfg, "explain"))
        lines = text.splitlines()
        for line in quoted.splitlines():
            assert line == "..." or line in lines, f"tinylm-explain{args}: {line!r}"
        printed.append(text)
    # every number the prose quotes to tinylm-explain's 4 decimals is one it printed
    prose = re.sub(r"```.*?```", "", doc, flags=re.S)
    for number in re.findall(r"(?<![\d.])\d+\.\d{4}(?![\d])", prose):
        assert number in "\n".join(printed), number
    # the prose's other numbers
    assert set(re.findall(r"(?<![\d.])\d+\.\d+(?![\d])", prose)) - set(
        re.findall(r"(?<![\d.])\d+\.\d{4}(?![\d])", prose)) == {"88.72"}
    assert math.isfinite(torch.tensor(88.72).exp()) and torch.tensor(88.73).exp().isinf()
    assert "about 10^60" in prose and int(138.5929 / math.log(10)) == 60
    assert "relative step of 1/128" in prose and torch.finfo(torch.bfloat16).eps == 1 / 128
    assert "(`block_size` 128)" in prose and "(`n_embd` 128)" in prose
    assert (ModelConfig.block_size, ModelConfig.n_embd) == (128, 128)
