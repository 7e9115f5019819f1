"""optim=muon: which parameters Muon and AdamW each get, and how the schedule drives both."""

import pytest
import torch

from tinylm.train.muon import (
    MuonWithAdamW,
    ShapeBatchedMuon,
    directly,
    newton_schulz,
    through_gram,
)
from tinylm.train.optim import OptimConfig, configure_optimizer, lr_at, set_lr

MUON_QUINTIC = (3.4445, -4.7750, 2.0315)  # torch.optim.Muon's default coefficients


@pytest.fixture
def small_model(tiny_model):
    """A 2-layer model of n_embd 8 in training mode."""
    return lambda bias=True: tiny_model(50, block_size=8, n_embd=8, bias=bias).train()


def test_muon_takes_the_blocks_matrices_and_adamw_the_rest(small_model):
    model = small_model()
    optimizer = configure_optimizer(model, OptimConfig(name="muon", lr=1e-3, muon_lr=0.02))
    assert isinstance(optimizer, MuonWithAdamW)
    assert isinstance(optimizer.muon, torch.optim.Muon)
    assert isinstance(optimizer.adamw, torch.optim.AdamW)
    names = {id(p): n for n, p in model.named_parameters()}  # the tied head: once, as wte
    muon = sorted(names[id(p)] for g in optimizer.muon.param_groups for p in g["params"])
    adamw = sorted(names[id(p)] for g in optimizer.adamw.param_groups for p in g["params"])
    assert muon == sorted(f"blocks.{i}.{name}.weight" for i in range(2) for name in (
        "attn.qkv_proj", "attn.out_proj", "mlp.fc", "mlp.proj"))
    assert {"wte.weight", "wpe.weight", "ln_f.weight", "ln_f.bias", "blocks.0.ln_1.weight",
            "blocks.1.mlp.fc.bias"} <= set(adamw)
    assert all(n.endswith((".bias", "ln_1.weight", "ln_2.weight", "ln_f.weight")) or
               n in ("wte.weight", "wpe.weight") for n in adamw)
    assert sorted(muon + adamw) == sorted(names.values())
    assert model.lm_head.weight is model.wte.weight  # so the head trains with AdamW, undecayed
    # weight decay on Muon's matrices only; the schedule scales Muon's group by muon_lr / lr
    assert [g["weight_decay"] for g in optimizer.param_groups] == [0.1, 0.0]
    assert optimizer.muon.param_groups[0]["lr_scale"] == pytest.approx(20.0)
    assert optimizer.muon.param_groups[0]["momentum"] == 0.95


def test_muon_and_adamw_both_move_their_parameters_and_save_their_state(small_model):
    model = small_model()
    optimizer = configure_optimizer(model, OptimConfig(name="muon"))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    x = torch.randint(0, 50, (4, 8))
    model(x, x).loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    assert all(not torch.equal(before[n], p) for n, p in model.named_parameters())
    assert all(p.grad is None for p in model.parameters())
    state = optimizer.state_dict()
    again = configure_optimizer(small_model(), OptimConfig(name="muon"))
    again.load_state_dict(state)
    assert again.state_dict()["muon"]["state"].keys() == state["muon"]["state"].keys()


def test_adamw_is_still_the_default(small_model):
    assert isinstance(configure_optimizer(small_model(), OptimConfig()), torch.optim.AdamW)


def test_the_schedule_reaches_muon_through_its_scale(small_model):
    optim = OptimConfig(name="muon", lr=1e-3, muon_lr=0.03, warmup_steps=0, min_lr=1e-4)
    optimizer = configure_optimizer(small_model(), optim)
    lr = set_lr(optimizer, 500, optim, max_steps=1000)  # what Trainer.train_step does
    assert lr == lr_at(500, optim, max_steps=1000)
    assert optimizer.muon.param_groups[0]["lr"] == pytest.approx(lr * 30)
    assert optimizer.adamw.param_groups[0]["lr"] == lr


@pytest.mark.parametrize(("key", "value"), [("name", "sgd"), ("muon_lr", -1.0),
                                            ("muon_momentum", 1.0)])
def test_bad_muon_settings_are_refused_naming_the_key(key, value):
    with pytest.raises(ValueError, match=rf"optim\.{key}=.* is not allowed"):
        OptimConfig(**{key: value})


@pytest.mark.parametrize("nesterov", [True, False])
def test_the_shape_batched_step_moves_the_weights_as_torchs_muon_does(nesterov):
    """Same matrices (tall, wide, square, two of a shape), same gradients, three steps: the
    weights match torch.optim.Muon's, which orthogonalizes one matrix at a time."""
    torch.manual_seed(0)
    shapes = [(24, 8), (8, 24), (8, 8), (8, 32), (8, 32), (32, 8)]
    ours = [torch.nn.Parameter(torch.randn(s)) for s in shapes]
    theirs = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    settings = dict(lr=0.02, weight_decay=0.1, momentum=0.9, nesterov=nesterov)
    optimizers = (ShapeBatchedMuon(ours, ns_dtype=torch.bfloat16, **settings),  # as torch's
                  torch.optim.Muon(theirs, **settings))
    for _ in range(3):
        grads = [torch.randn(s) for s in shapes]
        for params, optimizer in zip((ours, theirs), optimizers, strict=True):
            for p, g in zip(params, grads, strict=True):
                p.grad = g.clone()
            optimizer.step()
        for a, b in zip(ours, theirs, strict=True):
            torch.testing.assert_close(a, b, atol=1e-4, rtol=0)
    assert all(torch.equal(optimizers[0].state[a]["momentum_buffer"],
                           optimizers[1].state[b]["momentum_buffer"])
               for a, b in zip(ours, theirs, strict=True))


def muon_weights_after_steps(ns_dtype: torch.dtype | None, steps: int = 3) -> list[torch.Tensor]:
    """The weights of three matrices after `steps` ShapeBatchedMuon steps on fixed gradients."""
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s)) for s in [(24, 8), (8, 32), (8, 32)]]
    optimizer = ShapeBatchedMuon(params, ns_dtype=ns_dtype, lr=0.02, momentum=0.9)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn_like(p)
        optimizer.step()
    return [p.detach() for p in params]


@pytest.mark.parametrize("fast_bf16", [True, False])
def test_muon_iterates_in_bf16_only_where_the_hardware_has_it(monkeypatch, fast_bf16):
    """ns_dtype=None (what configure_optimizer builds): bf16 as torch does where bf16 is fast,
    fp32 where it is emulated (~80x slower than fp32 on an AVX2-only CPU)."""
    monkeypatch.setattr("tinylm.train.muon.has_fast_bf16", lambda device: fast_bf16)
    chosen = muon_weights_after_steps(ns_dtype=None)
    expected = muon_weights_after_steps(torch.bfloat16 if fast_bf16 else torch.float32)
    other = muon_weights_after_steps(torch.float32 if fast_bf16 else torch.bfloat16)
    assert all(torch.equal(a, b) for a, b in zip(chosen, expected, strict=True))
    assert not any(torch.equal(a, b) for a, b in zip(chosen, other, strict=True))
    # the two precisions take the same steps, up to bf16's rounding
    for a, b in zip(chosen, other, strict=True):
        torch.testing.assert_close(a, b, atol=0.02, rtol=0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_newton_schulz_gives_each_matrix_singular_values_near_one(dtype):
    torch.manual_seed(0)
    updates = [torch.randn(48, 16), torch.randn(16, 48), torch.randn(16, 48)]
    orthogonal = newton_schulz(updates, MUON_QUINTIC, 5, 1e-7, dtype)
    for u, x in zip(updates, orthogonal, strict=True):
        assert x.shape == u.shape and x.dtype == dtype
        s = torch.linalg.svdvals(x.float())
        assert 0.5 < s.min() and s.max() < 1.5  # Muon's quintic: roughly 1, not exactly
        assert torch.linalg.svdvals(u).max() > 3  # ... where the update itself was far from it


@pytest.mark.parametrize("shape", [(3, 16, 32), (2, 16, 64), (2, 8, 40)])
@pytest.mark.parametrize("conditioning", ["random", "nearly low-rank"])
def test_iterating_on_the_gram_matrix_gives_the_direct_iterations_result(shape, conditioning):
    """P_5···P_1 X_0 with each A updated as P A P, against X <- P X five times, in float64 (the
    algebra) and in fp32 (its rounding, against the float64 result)."""
    torch.manual_seed(0)
    n, rows, cols = shape
    x = torch.randn(shape, dtype=torch.float64)
    if conditioning == "nearly low-rank":  # like a momentum of a few similar gradients
        x = torch.randn(n, rows, 2, dtype=torch.float64) @ torch.randn(n, 2, cols,
                                                                        dtype=torch.float64)
        x += 1e-3 * torch.randn(shape, dtype=torch.float64)
    x /= x.norm(dim=(1, 2), keepdim=True)
    expected = directly(x, MUON_QUINTIC, 5)
    torch.testing.assert_close(through_gram(x, MUON_QUINTIC, 5), expected, atol=1e-12, rtol=0)
    in_fp32 = through_gram(x.float(), MUON_QUINTIC, 5).double()
    torch.testing.assert_close(in_fp32, expected, atol=1e-4, rtol=0)
    assert through_gram(x, MUON_QUINTIC, 0).equal(x)  # no step leaves X as it is


@pytest.mark.parametrize(("dtype", "shape", "via_gram"), [
    (torch.float32, (16, 48), True), (torch.float32, (48, 16), True),  # tall: wide side first
    (torch.float32, (16, 24), False), (torch.bfloat16, (16, 48), False)])
def test_only_wide_fp32_matrices_take_the_gram_route(monkeypatch, dtype, shape, via_gram):
    calls = []

    def spy(x, coefficients, steps):
        calls.append(x.shape)
        return through_gram(x, coefficients, steps)

    monkeypatch.setattr("tinylm.train.muon.through_gram", spy)
    torch.manual_seed(0)
    update = torch.randn(shape)
    (orthogonal,) = newton_schulz([update], MUON_QUINTIC, 5, 1e-7, dtype)
    assert orthogonal.shape == update.shape
    assert calls == ([(1, min(shape), max(shape))] if via_gram else [])
