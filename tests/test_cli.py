"""Every tinylm-* command refuses a bad override in one line naming the key and what is allowed."""

import pytest
from helpers import run_cli

from tinylm.cli import check_command_line
from tinylm.config import ConfigError


@pytest.mark.parametrize("config_name, override, message", [
    ("generate", "tempurature=0.5",
     "unknown config key tempurature (in tempurature=0.5); allowed: checkpoint, prompt,"),
    ("probe", "ablte=true", "unknown config key ablte (in ablte=true); allowed: checkpoint,"),
    ("explain", "casual=true", "unknown config key casual (in casual=true); allowed: q, k, v,"),
    ("bench", "sectoin=train", "unknown config key or group sectoin (in sectoin=train); "
                               "allowed: model, optim, data, tokenizer, section,"),
    ("bench", "attention.heads=2", "unknown config key attention.heads (in attention.heads=2); "
                                   "allowed under attention: batch_size, seq_len, n_head, n_embd"),
    ("config", "data.fles=x", "unknown config key data.fles (in data.fles=x); allowed under "
                              "data: name, source, files,"),
    ("config", "data=nope", "data=nope: there is no data/nope.yaml; allowed data options: text, "
                            "tinyshakespeare, tinystories"),
    ("explain", "causal=[", "causal=["),  # not even parsable: the override is named
])
def test_bad_overrides_are_refused_in_one_line(config_name, override, message):
    with pytest.raises(ConfigError) as refused:
        check_command_line([override], config_name)
    assert message in str(refused.value)
    assert "\n" not in str(refused.value)


def test_good_overrides_compose():
    cfg = check_command_line(["temperature=0", "max_new_tokens=5"], "generate")
    assert cfg.temperature == 0 and cfg.max_new_tokens == 5


@pytest.mark.parametrize("module, command", [("tinylm.cli.generate", "tinylm-generate"),
                                             ("tinylm.cli.prepare", "tinylm-prepare")])
def test_the_commands_check_their_command_line_before_hydra_runs(module, command, tmp_path):
    result = run_cli(module, "tempurature=0.5", cwd=tmp_path, timeout=120)
    assert result.returncode == 1
    assert result.stderr.strip().startswith(f"{command}: error: unknown config key")
    assert len(result.stderr.strip().splitlines()) == 1
    assert not any(tmp_path.iterdir())  # nothing written: no run directory, no .hydra/
