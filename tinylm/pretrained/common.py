"""What every architecture's loader shares: the files of a Hugging Face folder, one-line
refusals of a config.json value, and reading a safetensors file into a model by a table of names,
each tensor's shape compared from the header before it is read."""

from __future__ import annotations

import re
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from tinylm.config import shown

HUB_PREFIX = "hf:"
CONFIG_FILE, WEIGHTS_FILE, TOKENIZER_FILE = "config.json", "model.safetensors", "tokenizer.json"
PICKLE_FILE = "pytorch_model.bin"
CONVERT = "python scripts/convert_bin_to_safetensors.py"

# tinylm's name -> the stored name, or a tuple of stored names stacked along dim 0 (tinylm's
# qkv_proj holds q, k and v one after another), or None: zeros (a bias the checkpoint lacks)
Table = dict[str, "str | tuple[str, ...] | None"]


def refused(where: Path, key: str, value, rule: str) -> ValueError:
    """The one error a config.json value tinylm cannot take raises."""
    return ValueError(f"{where}: {key}={shown(value)} is not supported: {rule}")


def shape_of(hf: dict, keys: dict[str, str], where: Path, layers: int) -> dict[str, int]:
    """tinylm's shape (n_layer, n_head, ...: our name -> config.json's key in `keys`), each value
    a whole number and n_layer the count the weights file holds: checked before anything is
    computed from them or built, since a layer count is work and memory."""
    for key in keys.values():
        if type(hf.get(key)) is not int:  # not a bool, a float, a string
            raise refused(where, key, hf.get(key), "it must be a whole number")
    if hf[keys["n_layer"]] != layers:
        raise ValueError(f"{where}: {keys['n_layer']}={hf[keys['n_layer']]}, but the "
                         f"{WEIGHTS_FILE} beside it holds {layers} layers: they are not one model")
    return {ours: hf[theirs] for ours, theirs in keys.items()}


def built(config_class: type, where: Path, **values):
    """config_class(**values) without dropout (a pretrained model is loaded to be read, not
    trained); a value its checks refuse is named with the file."""
    try:
        return config_class(dropout=0.0, **values)
    except (TypeError, ValueError) as err:
        raise ValueError(f"{where}: {err}") from None


def name_table(n_layer: int, block: str, names: Table, outside: Table) -> Table:
    """Every tinylm name -> its stored name: `outside` as they are, and `names` in each of the
    n_layer blocks, whose stored names start with `block` ("h.{i}.")."""
    table = dict(outside)
    for i in range(n_layer):
        prefix = block.format(i=i)
        for ours, theirs in names.items():
            if isinstance(theirs, str):
                theirs = prefix + theirs
            elif theirs is not None:
                theirs = tuple(prefix + name for name in theirs)
            table[f"blocks.{i}.{ours}"] = theirs
    return table


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


def load_weights(file: Path, model: nn.Module, table: Table,
                 transposed: frozenset[str] = frozenset()) -> None:
    """`model`'s weights (float32) from a safetensors file by `table`, into `model` built on the
    meta device; each tensor's shape is compared from the header, before it is read, with the
    model's. A stored name in `transposed` is (in, out), the transpose of nn.Linear's (out, in).
    What the model lacks (a bias its config leaves out, a tied head) is not read."""
    needs = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    tied = model.lm_head.weight is model.wte.weight
    if tied:
        del needs["lm_head.weight"]  # the embedding, read once
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
            if ours not in needs:
                continue
            if theirs is None:
                state[ours] = torch.zeros(needs[ours])
            elif isinstance(theirs, tuple):
                rows, *rest = needs[ours]
                part = (rows // len(theirs), *rest)
                state[ours] = torch.cat([read(name, part) for name in theirs])
            else:
                state[ours] = read(theirs, needs[ours])
    if tied:
        state["lm_head.weight"] = state["wte.weight"]
    model.load_state_dict(state, strict=True, assign=True)
    if tied:  # tied again: assign gave each name its own Parameter
        model.lm_head.weight = model.wte.weight
