"""Convert a Hugging Face model whose weights are only a pickle (pytorch_model.bin) to a folder
that tinylm loads (model.safetensors), once, when you choose to:

    python scripts/convert_bin_to_safetensors.py hf:roneneldan/TinyStories-33M models/ts-33m
    python scripts/convert_bin_to_safetensors.py <folder with pytorch_model.bin> <new folder>
    tinylm-generate checkpoint=models/ts-33m prompt="Once upon a time"

tinylm itself never loads a pickle: unpickling can run any code the file holds. This script reads
one with torch.load(weights_only=True), PyTorch's restricted unpickler that builds tensors and
plain containers only and refuses anything else, and writes the tensors as model.safetensors
beside a copy of config.json and tokenizer.json (made from vocab.json and merges.txt where the
model has no tokenizer.json). From hf:<id> it downloads those files into Hugging Face's cache.
"""

from __future__ import annotations

import json
import pickle
import shutil
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

from tinylm.files import published_atomically
from tinylm.pretrained import CONFIG_FILE, HUB_PREFIX, PICKLE_FILE, TOKENIZER_FILE, WEIGHTS_FILE
from tinylm.tokenizer import EOT


def source_files(source: str) -> dict[str, Path]:
    """The files of `source` (a folder, or hf:<id> downloaded) by name; missing ones left out."""
    if not source.startswith(HUB_PREFIX):
        return {p.name: p for p in Path(source).iterdir()} if Path(source).is_dir() else {}
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import EntryNotFoundError
    files = {}
    for name in (CONFIG_FILE, PICKLE_FILE, TOKENIZER_FILE, "vocab.json", "merges.txt"):
        try:
            files[name] = Path(hf_hub_download(source.removeprefix(HUB_PREFIX), name))
        except EntryNotFoundError:
            pass
    return files


def gpt2_tokenizer(vocab: Path, merges: Path) -> Tokenizer:
    """GPT-2's byte-level BPE (tokenizer.json) from its vocab.json and merges.txt."""
    tokenizer = Tokenizer(models.BPE.from_file(str(vocab), str(merges)))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([AddedToken(EOT, special=True)])  # in vocab.json already
    return tokenizer


def convert(source: str, out: Path) -> None:
    files = source_files(source)
    for needed in (CONFIG_FILE, PICKLE_FILE):
        if needed not in files:
            sys.exit(f"{source} has no {needed}: nothing to convert")
    try:
        state = torch.load(files[PICKLE_FILE], map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError) as err:
        sys.exit(f"{files[PICKLE_FILE]} holds more than tensors, so it is not converted: "
                 f"{str(err).splitlines()[0]}")
    # safetensors refuses tensors that share memory: of those (a tied LM head is the embedding
    # again) the first is kept, which tinylm reads (transformer.wte.weight)
    seen, tensors = set(), {}
    for name, tensor in state.items():
        if tensor.data_ptr() in seen:
            continue
        seen.add(tensor.data_ptr())
        tensors[name] = tensor.contiguous().clone()
    with published_atomically(out) as build:
        save_file(tensors, str(build / WEIGHTS_FILE), metadata={"format": "pt"})
        shutil.copyfile(files[CONFIG_FILE], build / CONFIG_FILE)
        if TOKENIZER_FILE in files:
            shutil.copyfile(files[TOKENIZER_FILE], build / TOKENIZER_FILE)
        elif "vocab.json" in files and "merges.txt" in files:
            gpt2_tokenizer(files["vocab.json"], files["merges.txt"]).save(
                str(build / TOKENIZER_FILE))
    kind = json.loads(files[CONFIG_FILE].read_text()).get("model_type")
    print(f"wrote {out / WEIGHTS_FILE} ({len(tensors)} tensors of a {kind} model); "
          f"now: tinylm-generate checkpoint={out}")


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    convert(sys.argv[1], Path(sys.argv[2]))
