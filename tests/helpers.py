"""Plain functions the test files share: the real conf/ composed, a saved run, a command-line run,
a tensorboard server, random attention weights, attention's weights read at its hook point, a
Llama-family folder as transformers saves it. The fixtures built from them live in conftest.py."""

import contextlib
import json
import os
import socket
import subprocess
import sys

import numpy as np
import pytest
import torch
from hydra import compose as hydra_compose
from hydra import initialize_config_dir
from omegaconf import DictConfig, OmegaConf
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, processors, trainers

import tinylm.config
from tinylm.checkpoint import save_checkpoint
from tinylm.cli import config_dir, register, run_schemas
from tinylm.files import project_root
from tinylm.hooks import caching
from tinylm.train.run_config import RunConfig

# A tiny model on a tiny corpus: a run of 30 steps takes about a second on a quiet core.
TINY = ["data=text", "tokenizer.vocab_size=300", "model.n_layer=2", "model.n_head=2",
        "model.n_embd=32", "model.block_size=32", "train.batch_size=8", "train.max_steps=30",
        "train.eval_interval=10", "train.eval_batches=2", "train.checkpoint_interval=10",
        "train.log_interval=1", "train.sample_tokens=0", "train.probe_prompt=''",
        "train.device=cpu", "train.precision=fp32", "optim.lr=1e-2", "optim.warmup_steps=5",
        # two separate runs (full_run and one stopped and resumed) match bit for bit only with
        # the same thread count, and auto may choose another one for each as the load changes
        "train.threads=1"]
# The session's trained run (conftest's `trained_run`): dropout, so that the RNG matters.
TRAINED_RUN = ["model.dropout=0.1", "train.sample_tokens=16",
               "train.probe_prompt='Lily went home. She'"]


def causal_weights(seed: int, shape: tuple[int, ...]) -> np.ndarray:
    """Random float32 attention weights of `shape` (..., T, T): zero above the diagonal, each
    row summing to 1 over the keys it may see."""
    w = np.tril(np.random.default_rng(seed).random(shape)).astype(np.float32)
    return w / w.sum(-1, keepdims=True)


def attention_with_weights(mha, x, **kwargs):
    """mha(x, **kwargs) and its weights (B, n_head, T_q, T_k), read at its hook point
    hook_pattern (which makes it take the explicit path): (y, weights)."""
    with caching(mha, ["hook_pattern"], detach=False) as cache:
        y = mha(x, **kwargs)
    return y, cache["hook_pattern"]


def schemas() -> dict[str, type]:
    """ConfigStore name -> the dataclass that is the schema of that group or command config."""
    from tinylm.bench.config import BenchConfig
    from tinylm.cli.explain import ExplainConfig
    from tinylm.cli.export import ExportConfig
    from tinylm.cli.generate import GenerateConfig
    from tinylm.cli.probe import ProbeConfig

    return {**run_schemas(), "generate_schema": GenerateConfig, "probe_schema": ProbeConfig,
            "explain_schema": ExplainConfig, "bench_schema": BenchConfig,
            "export_schema": ExportConfig}


def compose(config_name, overrides=(), return_hydra_config=False):
    """The real conf/ composed as the command line composes it: `config_name` with `overrides`
    (and Hydra's own `hydra` node too with return_hydra_config)."""
    register(schemas())
    with initialize_config_dir(config_dir=str(config_dir()), version_base="1.3"):
        return hydra_compose(config_name, overrides=list(overrides),
                             return_hydra_config=return_hydra_config)


def to_dataclass(cls, node, prefix):
    """tinylm.config.to_dataclass of a composed config node, as the commands build theirs."""
    values = OmegaConf.to_container(node, resolve=True) if isinstance(node, DictConfig) else node
    return tinylm.config.to_dataclass(cls, values, prefix)


def run_config(corpus, run_dir, *overrides) -> RunConfig:
    """A training run on the `corpus` fixture: conf/ with TINY and `overrides` on top."""
    cfg = compose("config", [*TINY, f"data.files=[{corpus / 'stories.txt'}]",
                             f"data.cache_dir={corpus / 'cache'}", *overrides])
    return RunConfig.from_config(OmegaConf.to_container(cfg, resolve=True), run_dir)


def refusal(main, *argv, monkeypatch) -> str:
    """What a command's `main` says when it refuses the command line `argv` (one exit line)."""
    monkeypatch.setattr(sys, "argv", ["tinylm", *argv])
    with pytest.raises(SystemExit) as stopped:
        main()
    assert isinstance(stopped.value.code, str), stopped.value.code
    return stopped.value.code


def save_run(run_dir, model, tokenizer):
    """A run directory whose `last` and `best` checkpoint is `model`."""
    save_checkpoint(run_dir, model, tokenizer, {"model": model.config.to_dict()}, step=1,
                    tags=("last", "best"))
    return run_dir


def run_cli(module, *args, cwd, timeout=300):
    """Run `python -m <module> args...` in `cwd`, as a user would from a shell."""
    env = {**os.environ, "PYTHONIOENCODING": "utf-8"}
    return subprocess.run([sys.executable, "-m", module, *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# How long a test waits for a fresh tensorboard server to answer and load its event files.
STARTUP_TIMEOUT_S = 90


@contextlib.contextmanager
def tensorboard_server(logdir, log_path, *flags):
    """`tensorboard --logdir logdir` on a free port of 127.0.0.1: yields (process, base URL).

    Its output goes to log_path, a file rather than a pipe: a full pipe would block the server.
    """
    port = free_port()
    with open(log_path, "wb") as log_file:
        process = subprocess.Popen(
            [sys.executable, "-m", "tensorboard.main", "--logdir", str(logdir),
             "--host", "127.0.0.1", "--port", str(port), *flags],
            stdout=log_file, stderr=subprocess.STDOUT)
    try:
        yield process, f"http://127.0.0.1:{port}"
    finally:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def torch_save_failing_at(n: int, error: OSError):
    """A torch.save that writes its first n - 1 files and then part of the n-th, and raises
    `error` there: a disk that fills up, or a crash, in the middle of a checkpoint."""
    save, calls = torch.save, []

    def failing_save(obj, f, *args, **kwargs):
        calls.append(f)
        if len(calls) == n:
            f.write(b"\x00" * 100)  # the checkpoint hands torch.save an open file
            raise error
        return save(obj, f, *args, **kwargs)

    return failing_save



# ---- Llama-family folders (tinylm/pretrained/llama.py), as transformers saves them ---------------

LLAMA_VOCAB = 1024  # the probe texts' names whole: 98 of the 108 agreement items pair up
BOS, EOS = "<s>", "</s>"
# name -> (model_type, the transformers config's values); all 2 layers, hidden 32-64
LLAMA_CASES = {
    # grouped-query heads (2 queries per key/value head), a slower rotation, its own LM head,
    # Llama 3's rotary scaling
    "llama-gqa-llama3": ("llama", dict(
        hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=96,
        rope_theta=5000.0, tie_word_embeddings=False,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 16})),
    # one key/value head for all 4 query heads, linear rotary scaling, tied head, biases in
    # q, k, v and o_proj and in the MLP
    "llama-mqa-linear": ("llama", dict(
        hidden_size=32, num_attention_heads=4, num_key_value_heads=1, intermediate_size=80,
        tie_word_embeddings=True, rope_scaling={"rope_type": "linear", "factor": 2.0},
        attention_bias=True, mlp_bias=True)),
    # q/k/v biases, tied head, Qwen's rope_theta
    "qwen2": ("qwen2", dict(
        hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
        rope_theta=1e6, tie_word_embeddings=True)),
    "mistral": ("mistral", dict(
        hidden_size=32, num_attention_heads=2, num_key_value_heads=1, intermediate_size=64,
        sliding_window=None)),
}


def llama_texts() -> list[str]:
    """What the Llama-family tokenizers learn from: the shipped probe texts and their
    counterfactuals (weighted, so that their names are whole tokens and a pair's two names
    mostly as many), and the start of the shipped TinyStories sample."""
    probes = [json.loads(line) for name in ("pronouns", "agreement")
              for line in (project_root() / "data" / "probes" / f"{name}.jsonl").read_text()
              .splitlines()]
    texts = [t for item in probes for t in (item["text"], item.get("counterfactual")) if t]
    stories = (project_root() / "data" / "corpora" / "tinystories" / "train-head.txt"
               ).read_text(encoding="utf-8")[:50_000]
    return texts * 5 + stories.splitlines()


def make_llama_tokenizer(bos: bool, eos: str) -> HFTokenizer:
    """A byte-level BPE of LLAMA_VOCAB tokens with <unk>, <s> and `eos`; with `bos`, a
    post-processor that starts every text with <s>, as Llama's tokenizer.json does."""
    hf = HFTokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    hf.train_from_iterator(llama_texts(), trainers.BpeTrainer(
        vocab_size=LLAMA_VOCAB, special_tokens=["<unk>", BOS, eos], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    if bos:
        hf.post_processor = processors.TemplateProcessing(
            single=f"{BOS} $A", special_tokens=[(BOS, hf.token_to_id(BOS))])
    return hf


def save_llama_folder(folder, case: str, seed: int = 0):
    """The transformers model of LLAMA_CASES[case] with random weights, saved into `folder`
    with its tokenizer.json as a download is (Qwen2's tokenizer adds no BOS and ends texts
    with <|endoftext|>, as Qwen's does); returns it in eval mode."""
    from transformers import AutoConfig, AutoModelForCausalLM

    model_type, values = LLAMA_CASES[case]
    torch.manual_seed(seed)
    eos = "<|endoftext|>" if model_type == "qwen2" else EOS
    tokenizer = make_llama_tokenizer(bos=model_type != "qwen2", eos=eos)
    config = AutoConfig.for_model(
        model_type, vocab_size=tokenizer.get_vocab_size(), num_hidden_layers=2,
        max_position_embeddings=64, eos_token_id=tokenizer.token_to_id(eos),
        bos_token_id=tokenizer.token_to_id(BOS), attn_implementation="eager", **values)
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():  # biases and norms too (transformers starts them at 0 and 1), so that
        for p in model.parameters():  # a weight read into the wrong place shows
            p.normal_(0.0, 0.2)
    model.save_pretrained(folder)
    tokenizer.save(str(folder / "tokenizer.json"))
    return model

