"""Hook points: the one way into a model's activations, to read them or to replace them.

A HookPoint returns its input unchanged; the model passes each activation worth looking at
through one, so that every one has a name (its module's path and attribute). A hook on it sees
the activation, and what the hook returns (if not None) replaces it for the rest of the pass:

    blocks.{i}.hook_resid_pre      (B, T, C)        the residual stream into block i
    blocks.{i}.attn.hook_q         (B, nh, T, hs)   queries, per head
    blocks.{i}.attn.hook_k/_v      (B, nkv, T_k, hs) keys and values, per key/value head
    blocks.{i}.attn.hook_pattern   (B, nh, T, T_k)  attention weights, rows sum to 1
    blocks.{i}.attn.hook_z         (B, nh, T, hs)   each head's output, before the out projection
    blocks.{i}.hook_resid_post     (B, T, C)        the residual stream out of block i

    with hooks(model, {"blocks.1.attn.hook_z": zero_head_2}):   # replace
        logits = model(idx).logits
    out, cache = run_with_cache(model, idx, ["hook_pattern"])    # read
    cache["blocks.0.attn.hook_pattern"]                          # (B, nh, T, T)

A name may be given whole or by its last part ("hook_pattern": in every layer). Attention takes
its explicit path, the one that has weights, only while a hook is on hook_pattern.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager

import torch
from torch import nn

# fn(activation) -> None to read it, or a tensor of its shape to replace it
Hook = Callable[[torch.Tensor], torch.Tensor | None]


class HookPoint:
    """A named place in the forward pass: identity, unless a hook reads or replaces its value.

    A plain object, not an nn.Module: a decoding step passes ~7 per layer, and reaching a
    submodule (through nn.Module.__getattr__) would cost more than the step's own arithmetic there.
    """

    def __init__(self):
        self.fns: list[Hook] = []

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        for fn in self.fns:
            out = fn(x)
            x = x if out is None else out
        return x

    @property
    def hooked(self) -> bool:
        return bool(self.fns)


def hook_points(model: nn.Module) -> dict[str, HookPoint]:
    """Every hook point of `model` by its name: its module's path, then its attribute."""
    points = {}
    for path, module in model.named_modules():
        for name, point in vars(module).items():
            if isinstance(point, HookPoint):
                points[f"{path}.{name}" if path else name] = point
    return points


def resolve(model: nn.Module, names: Iterable[str]) -> list[str]:
    """The full names that `names` mean: each a full name, or a last part matching every layer's;
    a name that matches none is refused with the names there are."""
    points = hook_points(model)
    found = []
    for name in names:
        found += [m for m in _matching(points, name) if m not in found]
    return found


def _matching(points: Mapping[str, HookPoint], name: str) -> list[str]:
    """The names of `points` that `name` means (see resolve)."""
    matches = [p for p in points if p == name or p.endswith(f".{name}")]
    if not matches:
        kinds = sorted({p.rsplit(".", 1)[-1] for p in points})
        raise KeyError(f"no hook point {name!r}; there are {', '.join(kinds)} in each layer, "
                       "or a full name like blocks.0.attn.hook_pattern")
    return matches


@contextmanager
def hooks(model: nn.Module, fns: Mapping[str, Hook]) -> Iterator[None]:
    """Inside: each fn runs on its hook point's activation (see the module docstring)."""
    points = hook_points(model)
    added = []
    try:
        for name, fn in fns.items():
            for full in _matching(points, name):
                points[full].fns.append(fn)
                added.append((points[full], fn))
        yield
    finally:
        for point, fn in added:
            point.fns.remove(fn)


@contextmanager
def caching(model: nn.Module, names: Iterable[str], detach: bool = True
            ) -> Iterator[dict[str, torch.Tensor]]:
    """Inside: a dict filling with the named activations as a forward pass reaches them (a
    second pass overwrites them). detach=False keeps them in the autograd graph."""
    cache: dict[str, torch.Tensor] = {}

    def keep(name: str) -> Hook:
        def fn(x: torch.Tensor) -> None:
            cache[name] = x.detach() if detach else x
        return fn
    with hooks(model, {name: keep(name) for name in resolve(model, names)}):
        yield cache


def run_with_cache(model: nn.Module, idx: torch.Tensor, names: Iterable[str], **kwargs
                   ) -> tuple[object, dict[str, torch.Tensor]]:
    """model(idx, **kwargs) and the named activations it passed through."""
    with caching(model, names) as cache:
        out = model(idx, **kwargs)
    return out, cache
