"""What every architecture's loader shares: the files of a Hugging Face folder, one-line
refusals of a config.json value, and reading a safetensors file into a model by a table of names,
each tensor's shape compared from the header before it is read."""

from __future__ import annotations

import re
from collections.abc import Iterable
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

HUB_PREFIX = "hf:"
CONFIG_FILE, WEIGHTS_FILE, TOKENIZER_FILE = "config.json", "model.safetensors", "tokenizer.json"
PICKLE_FILE = "pytorch_model.bin"
CONVERT = "python scripts/convert_bin_to_safetensors.py"

# tinylm's name -> the stored name, or a tuple of stored names stacked along dim 0 (tinylm's
# qkv_proj holds q, k and v one after another), or None: zeros (a bias the checkpoint lacks)
Table = dict[str, "str | tuple[str, ...] | None"]


def short(value) -> str:
    """repr of a config value, cut to one readable line (a crafted value may be huge)."""
    text = repr(value)
    return text if len(text) <= 80 else f"{text[:77]}..."


def refused(where: Path, key: str, value, rule: str) -> ValueError:
    """The one error a config.json value tinylm cannot take raises."""
    return ValueError(f"{where}: {key}={short(value)} is not supported: {rule}")


def whole_numbers(hf: dict, keys: Iterable[str], where: Path) -> None:
    """Refuse a shape value that is not an int (a bool, a float, a string)."""
    for key in keys:
        if type(hf.get(key)) is not int:
            raise refused(where, key, hf.get(key), "it must be a whole number")


def same_layers(hf: dict, key: str, layers: int, where: Path) -> None:
    """Refuse a layer count other than the weights file's, before anything is built: a layer
    count is work and memory, and the file's header already says how many there are."""
    if hf[key] != layers:
        raise ValueError(f"{where}: {key}={hf[key]}, but the {WEIGHTS_FILE} beside it holds "
                         f"{layers} layers: they are not one model")


def stored_names(f) -> dict[str, str]:
    """The names in an open safetensors file, without transformers' "transformer." prefix
    (GPT2LMHeadModel's save has it, the hub's gpt2 not) -> the name as stored."""
    return {name.removeprefix("transformer."): name for name in f.keys()}


def layers_in(file: Path, block: str) -> int:
    """How many blocks a safetensors file holds, from its header alone; `block` is the regex of
    a block's prefix with the layer number as its group (r"h\\.(\\d+)\\.")."""
    with safe_open(str(file), "pt") as f:
        pattern = re.compile(block)
        return len({m.group(1) for m in map(pattern.match, stored_names(f)) if m})


def read_tensors(file: Path, model: nn.Module, table: Table,
                 transposed: frozenset[str] = frozenset()) -> dict[str, torch.Tensor]:
    """`model`'s state dict from a safetensors file by `table`; each tensor's shape is compared
    from the header, before it is read, with `model`'s (built on the meta device: shapes only).
    A stored name in `transposed` is (in, out), the transpose of nn.Linear's (out, in)."""
    needs = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    state = {}
    with safe_open(str(file), "pt") as f:
        stored = stored_names(f)

        def read(name: str, shape: tuple[int, ...]) -> torch.Tensor:
            if name not in stored:
                raise ValueError(f"{file} has no tensor {name}: it is not the "
                                 f"{model.config.n_layer}-layer model its {CONFIG_FILE} "
                                 "describes")
            flip = name in transposed
            shape = shape[::-1] if flip else shape
            found = tuple(f.get_slice(stored[name]).get_shape())
            if found != shape:
                raise ValueError(f"{file} does not fit the model its {CONFIG_FILE} describes: "
                                 f"size mismatch for {name}: {list(found)} in the file, the "
                                 f"model needs {list(shape)}")
            tensor = f.get_tensor(stored[name]).float()
            return tensor.t().contiguous() if flip else tensor

        for ours, theirs in table.items():
            if theirs is None:
                state[ours] = torch.zeros(needs[ours])
            elif isinstance(theirs, tuple):
                rows, *rest = needs[ours]
                part = (rows // len(theirs), *rest)
                state[ours] = torch.cat([read(name, part) for name in theirs])
            else:
                state[ours] = read(theirs, needs[ours])
    return state
