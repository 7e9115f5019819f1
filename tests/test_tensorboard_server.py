"""A real TensorBoard server shows the attention maps that inspection writes."""

import json
import time
import urllib.error
import urllib.parse
import urllib.request

import pytest
from helpers import STARTUP_TIMEOUT_S, tensorboard_server

from tinylm.inspection.report import inspect_texts
from tinylm.tokenizer import CharTokenizer


def get(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=10) as response:
        return response.read()


@pytest.mark.slow
def test_tensorboard_serves_the_attention_images_over_http(tmp_path, tiny_model):
    text = "Lily saw Tom. She ran."
    tokenizer = CharTokenizer.train([text])
    model = tiny_model(tokenizer.vocab_size, block_size=32, n_layer=1)
    inspect_texts(model, tokenizer, [text], tmp_path / "logs")

    log = tmp_path / "tensorboard.log"
    with tensorboard_server(tmp_path / "logs", log, "--load_fast=false",
                            "--reload_interval", "1") as (server, base):
        # ready = the server answers and has loaded our event file (it loads in the background)
        deadline, tags = time.monotonic() + STARTUP_TIMEOUT_S, {}
        while time.monotonic() < deadline:
            assert server.poll() is None, log.read_text(errors="replace")
            try:
                tags = json.loads(get(f"{base}/data/plugin/images/tags"))
            except (urllib.error.URLError, ConnectionError):
                pass
            if tags.get(".", {}).get("attention/layer_00/all_heads"):
                break
            time.sleep(0.5)
        assert "attention/layer_00/all_heads" in tags.get(".", {}), tags

        query = urllib.parse.urlencode({"run": ".", "tag": "attention/layer_00/all_heads"})
        (entry,) = json.loads(get(f"{base}/data/plugin/images/images?{query}"))
        png = get(f"{base}/data/plugin/images/individualImage?{entry['query']}")
        assert png.startswith(b"\x89PNG") and len(png) > 1000
