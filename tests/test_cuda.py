"""The CUDA paths the README claims, checked for device and dtype slips: train.device=auto and
train.precision=auto choose CUDA and bf16 or fp16 there, the fused attention and the chunked loss
agree with the explicit arithmetic in half precision, dropout there is PyTorch's own, a short
training run on the GPU gives a finite loss and a checkpoint that loads on the CPU, and greedy
generation with the KV cache on the GPU gives the CPU's tokens. Every test here is marked `cuda`:
skipped where torch sees no GPU.
"""

import math

import pytest
import torch
from helpers import run_cli, run_config

import tinylm.fast
from tinylm.attention import MultiHeadAttention, attention_steps
from tinylm.checkpoint import load_checkpoint
from tinylm.device import resolve_device
from tinylm.fast import dropout, fused_attention, lm_head_cross_entropy
from tinylm.generate import generate
from tinylm.hooks import caching
from tinylm.train.runtime import resolve_precision
from tinylm.train.trainer import train

pytestmark = pytest.mark.cuda

CUDA = torch.device("cuda")
# Largest difference from the fp32 arithmetic: bf16 keeps 8 significant bits, fp16 11, and the
# fused kernels round the attention weights to the input dtype before multiplying by v.
TOLERANCE = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 3e-2}
HALF = [torch.float16, torch.bfloat16]


def skip_without_bf16(dtype):
    if dtype == torch.bfloat16 and not torch.cuda.is_bf16_supported():
        pytest.skip("this GPU has no bf16")


def cuda_precision() -> str:
    """What train.precision=auto chooses on this GPU, as the start-up line names it."""
    return "bfloat16" if torch.cuda.is_bf16_supported() else "float16"


# ---- device and precision -----------------------------------------------------------------------

def test_auto_chooses_cuda_and_bf16_or_fp16_there():
    device = resolve_device("auto")
    assert device.type == "cuda"
    assert resolve_device("cuda:0") == torch.device("cuda", 0)
    expected = torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    assert resolve_precision("auto", device) == expected
    assert resolve_precision("fp16", device) == torch.float16  # refused only off CUDA
    assert resolve_precision("fp32", device) == torch.float32


# ---- attention ----------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, *HALF], ids=str)
@pytest.mark.parametrize("t_q", [12, 3, 1])
def test_the_fused_kernel_equals_attention_steps_on_cuda(dtype, t_q):
    """PyTorch's fused kernel, as MultiHeadAttention calls it (also for the last t_q queries of
    12 cached keys), against attention_steps in fp32 on the same rounded inputs."""
    skip_without_bf16(dtype)
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 4, t, 16, device=CUDA).to(dtype) for t in (t_q, 12, 12))
    fused = fused_attention(q, k, v, 0.0)
    explicit = attention_steps(q.float(), k.float(), v.float(), is_causal=True).output
    assert fused.dtype == dtype and fused.device.type == "cuda"
    assert explicit.device.type == "cuda"
    assert (fused.float() - explicit).abs().max() <= TOLERANCE[dtype]


@pytest.mark.parametrize("dtype", HALF, ids=str)
def test_the_fast_path_matches_the_explicit_path_under_cuda_autocast(dtype):
    skip_without_bf16(dtype)
    torch.manual_seed(6)
    mha = MultiHeadAttention(32, 4, dropout=0.0).to(CUDA).eval()
    x = torch.randn(2, 12, 32, device=CUDA)
    x_fast, x_explicit = x.clone().requires_grad_(), x.clone().requires_grad_()
    with torch.autocast("cuda", dtype=dtype):
        fast = mha(x_fast)
        with caching(mha, ["hook_pattern"]) as cache:  # a hook on the weights: the explicit path
            explicit = mha(x_explicit)
    weights = cache["hook_pattern"]
    assert weights.shape == (2, 4, 12, 12) and weights.device.type == "cuda"
    assert fast.dtype == explicit.dtype == dtype
    assert (fast.float() - explicit.float()).abs().max() <= TOLERANCE[dtype]
    fast.float().square().sum().backward()
    explicit.float().square().sum().backward()
    for grad in (x_fast.grad, x_explicit.grad):
        assert grad.dtype == torch.float32 and torch.isfinite(grad).all() and grad.abs().sum() > 0
    scale = x_explicit.grad.abs().max()
    assert (x_fast.grad - x_explicit.grad).abs().max() <= 10 * TOLERANCE[dtype] * scale


def test_dropout_on_cuda_is_pytorchs_own():
    # the cheaper mask is a CPU's: on the GPU, F.dropout draws it inside its kernel
    x = torch.randn(4096, device=CUDA)
    torch.manual_seed(7)
    ours = dropout(x, 0.3)
    torch.manual_seed(7)
    assert torch.equal(ours, torch.nn.functional.dropout(x, 0.3))


# ---- the chunked loss ---------------------------------------------------------------------------

@pytest.fixture
def small_chunks(monkeypatch):
    """Chunks of 8 rows, so a few dozen rows take several chunks and a ragged last one."""
    monkeypatch.setattr(tinylm.fast, "CHUNK_LOGITS", 8 * 50)
    monkeypatch.setattr(tinylm.fast, "MIN_ROWS_PER_CHUNK", 1)


def loss_and_grads(h, weight, targets, device, autocast_dtype=None):
    """lm_head_cross_entropy's loss, dloss/dh and dloss/dweight on `device`, under autocast to
    `autocast_dtype` if given."""
    h, weight = (t.detach().to(device).requires_grad_() for t in (h, weight))
    with torch.autocast(device.type, dtype=autocast_dtype, enabled=autocast_dtype is not None):
        loss = lm_head_cross_entropy(h, weight, targets.to(device))
    return (loss, *torch.autograd.grad(loss, (h, weight)))


@pytest.mark.parametrize("dtype", [None, *HALF], ids=str)
def test_the_chunked_loss_on_cuda_gives_the_cpus_fp32_loss_and_gradients(small_chunks, dtype):
    """fp32 and fp16 autocast (whose head runs in fp32, as it must before a GradScaler multiplies
    the gradients): the CPU's numbers; bf16 autocast: close to them."""
    skip_without_bf16(dtype)
    torch.manual_seed(0)
    h, weight = torch.randn(37, 16), torch.randn(50, 16) * 0.5
    targets = torch.randint(0, 50, (37,))
    targets[[0, 5, 17]] = -1
    expected = loss_and_grads(h, weight, targets, torch.device("cpu"))
    ours = loss_and_grads(h, weight, targets, CUDA, dtype)
    assert all(t.device.type == "cuda" and t.dtype == torch.float32 for t in ours)
    # fp32 sums in another order on the GPU; bf16 rounds the matmul operands to 8 bits
    loss_tolerance, grad_tolerance = (1e-2, 2e-2) if dtype == torch.bfloat16 else (1e-5, 1e-4)
    assert abs(ours[0].item() - expected[0].item()) <= loss_tolerance
    for mine, theirs in zip(ours[1:], expected[1:], strict=True):
        assert (mine.cpu() - theirs).abs().max() <= grad_tolerance * theirs.abs().max()
    assert torch.all(ours[1][[0, 5, 17]] == 0)  # an ignored row gets no gradient


# ---- the model ----------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", HALF, ids=str)
def test_a_training_step_on_cuda_keeps_fp32_weights_and_gradients(tiny_model, dtype):
    skip_without_bf16(dtype)
    model = tiny_model(60, block_size=16).train().to(CUDA)
    idx = torch.randint(0, 60, (3, 16), device=CUDA)
    targets = torch.randint(0, 60, (3, 16), device=CUDA)
    with torch.autocast("cuda", dtype=dtype):
        out = model(idx, targets)
    assert out.logits.device.type == "cuda" and out.loss.dtype == torch.float32
    assert math.isfinite(out.loss.item())
    out.loss.backward()
    for name, p in model.named_parameters():
        assert p.dtype == p.grad.dtype == torch.float32, name
        assert p.grad.device.type == "cuda" and torch.isfinite(p.grad).all(), name


def test_the_model_on_cuda_gives_the_cpus_logits(trained_run):
    run_dir, _ = trained_run
    on_cpu = load_checkpoint(run_dir, device="cpu").model
    on_cuda = load_checkpoint(run_dir, device="cuda").model
    assert all(p.device.type == "cuda" for p in on_cuda.parameters())
    idx = torch.randint(0, on_cpu.config.vocab_size, (2, on_cpu.config.block_size))
    with torch.inference_mode():
        expected = on_cpu(idx).logits
        logits = on_cuda(idx.to(CUDA)).logits
    assert logits.device.type == "cuda"
    assert (logits.cpu() - expected).abs().max() <= 1e-4


# ---- generation ---------------------------------------------------------------------------------

def test_greedy_generation_with_the_kv_cache_on_cuda_gives_the_cpus_tokens(trained_run):
    run_dir, _ = trained_run
    ckpt = load_checkpoint(run_dir, device="cpu")
    on_cuda = load_checkpoint(run_dir, device="cuda").model
    idx = torch.tensor([ckpt.tokenizer.encode("Once upon a time, Lily")] * 2)
    # 40 new tokens run past block_size=32, through the sliding-window re-prefill
    expected = generate(ckpt.model, idx, 40, temperature=0.0, use_cache=True)
    cached = generate(on_cuda, idx.to(CUDA), 40, temperature=0.0, use_cache=True)
    uncached = generate(on_cuda, idx.to(CUDA), 40, temperature=0.0, use_cache=False)
    assert cached.device.type == "cuda"
    assert torch.equal(cached.cpu(), expected) and torch.equal(uncached.cpu(), expected)
    # sampling draws from a generator on the GPU
    sampled = generate(on_cuda, idx.to(CUDA), 10, temperature=1.0, top_k=5,
                       generator=torch.Generator(device=CUDA).manual_seed(0))
    assert sampled.shape == (2, idx.size(1) + 10)


@pytest.mark.slow
def test_tinylm_generate_on_cuda_prints_the_cpus_greedy_text_and_inspects(trained_run, tmp_path):
    run_dir, _ = trained_run
    args = [f"checkpoint={run_dir}", "prompt=Lily went to the park", "max_new_tokens=20",
            "temperature=0"]
    on_cpu = run_cli("tinylm.cli.generate", *args, "device=cpu", cwd=tmp_path)
    on_cuda = run_cli("tinylm.cli.generate", *args, "device=cuda", "inspect=true",
                      f"logdir={tmp_path / 'inspect'}", cwd=tmp_path)
    assert on_cpu.returncode == 0, on_cpu.stderr
    assert on_cuda.returncode == 0, on_cuda.stderr
    assert " on cuda" in on_cuda.stderr
    assert on_cuda.stdout.startswith(on_cpu.stdout.rstrip("\n"))
    assert (tmp_path / "inspect" / "attention" / "layer_00" / "all_heads.png").is_file()
    sampled = run_cli("tinylm.cli.generate", *args[:-1], "temperature=1.0", "seed=3",
                      "device=cuda", cwd=tmp_path)
    assert sampled.returncode == 0, sampled.stderr


# ---- training -----------------------------------------------------------------------------------

ON_CUDA = ["train.device=cuda", "train.precision=auto", "train.max_steps=20",
           "train.sample_tokens=8", "train.probe_prompt='Lily went home. She'"]


def start_up_line(caplog) -> str:
    return next(r.message for r in caplog.records if r.message.startswith("Model:"))


def test_a_short_run_on_cuda_trains_and_its_checkpoint_loads_on_the_cpu(
        corpus, tmp_path, caplog):
    run_dir = tmp_path / "run"
    with caplog.at_level("INFO", logger="tinylm.train"):
        metrics = train(run_config(corpus, run_dir, *ON_CUDA))
    assert f"); {cuda_precision()} on cuda;" in start_up_line(caplog)
    assert metrics["step"] == 20
    assert math.isfinite(metrics["val_loss"]) and metrics["val_loss"] < math.log(300)

    ckpt = load_checkpoint(run_dir, device="cpu", prefer="last")
    for name, p in ckpt.model.named_parameters():
        # saved as fp32 whatever the autocast dtype, and read back onto the CPU
        assert p.device.type == "cpu" and p.dtype == torch.float32, name
        assert torch.isfinite(p).all(), name
    state = torch.load(ckpt.trainer_state_path, weights_only=True, map_location="cpu")
    assert state["step"] == 20
    out = generate(ckpt.model, torch.tensor([[ckpt.tokenizer.eot_id]]), 5, temperature=0.0)
    assert out.shape == (1, 6)

    # a resume on the GPU restores the CUDA generator's state and carries on
    caplog.clear()
    with caplog.at_level("INFO", logger="tinylm.train"):
        metrics = train(run_config(corpus, run_dir, *ON_CUDA, "train.max_steps=25",
                                   "train.resume=true"))
    assert metrics["step"] == 25 and math.isfinite(metrics["val_loss"])
    assert f"); {cuda_precision()} on cuda;" in start_up_line(caplog)


def test_fp16_on_cuda_trains_with_a_gradient_scaler_to_a_finite_loss(corpus, tmp_path, caplog):
    run_dir = tmp_path / "run"
    with caplog.at_level("INFO", logger="tinylm.train"):
        metrics = train(run_config(corpus, run_dir, *ON_CUDA, "train.precision=fp16"))
    assert "); float16 on cuda;" in start_up_line(caplog)
    assert math.isfinite(metrics["val_loss"]) and metrics["val_loss"] < math.log(300)
    ckpt = load_checkpoint(run_dir, device="cpu", prefer="last")
    assert all(p.dtype == torch.float32 and torch.isfinite(p).all()
               for p in ckpt.model.parameters())
