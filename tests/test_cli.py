"""Every tinylm-* command refuses a bad override in one line naming the key and what is allowed."""

import gc
import os
import subprocess
import sys

import hydra._internal.utils
import pytest
from helpers import run_cli, save_run

import tinylm.cli.command_line
from tinylm.cli.command_line import check_command_line, check_command_line_or_exit
from tinylm.config import ConfigError


@pytest.mark.parametrize("config_name, override, message", [
    ("generate", "tempurature=0.5",
     "unknown config key tempurature (in tempurature=0.5); allowed: checkpoint, prompt,"),
    ("probe", "ablte=true", "unknown config key ablte (in ablte=true); allowed: checkpoint,"),
    ("explain", "casual=true", "unknown config key casual (in casual=true); allowed: q, k, v,"),
    ("bench", "sectoin=train", "unknown config key or group sectoin (in sectoin=train); "
                               "allowed: section, threads, repeats, warmup, seed, out, model,"),
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


def _builders():
    from tinylm.cli.bench import bench_config_of
    from tinylm.cli.command_line import checked_config
    from tinylm.cli.explain import ExplainConfig
    from tinylm.cli.generate import GenerateConfig
    from tinylm.cli.probe import ProbeConfig
    from tinylm.cli.train import build_run_config

    return {"config": build_run_config, "generate": checked_config(GenerateConfig, "generate"),
            "probe": checked_config(ProbeConfig, "probe"),
            "explain": checked_config(ExplainConfig, "explain"), "bench": bench_config_of}


# The values an adversarial run found slipping through: a wrong type is refused by the schema at
# composition, a wrong range by the dataclass's validators; both before any data or model.
BOOL, FLOAT, FINITE = "must be true or false", "must be a float", "must be a finite number >= 0"
TEMPERATURE = "must be 0 (greedy) or a finite number >= 0.001"


@pytest.mark.parametrize("config_name, override, rule", [
    ("config", "model.bias=maybe", BOOL),
    ("config", "model.bias=no", BOOL),
    ("config", "train.compile=maybe", BOOL),
    ("generate", "use_cache=maybe", BOOL),
    ("config", "model.dropout=abc", FLOAT),
    ("generate", "temperature=abc", FLOAT),
    ("config", "optim.lr=nan", FINITE),
    ("config", "optim.lr=inf", FINITE),
    ("config", "optim.grad_clip=nan", FINITE),
    ("generate", "temperature=nan", TEMPERATURE),
    ("generate", "temperature=1e-45", TEMPERATURE),
    ("generate", "top_k=2.5", "must be an integer, or null"),
    ("generate", "seed=abc", "must be an integer"),
    ("probe", "ablate=yes", BOOL),
    ("explain", "causal=1", BOOL),
    ("bench", "repeats=many", "must be an integer"),
    ("config", "data.files=notes.txt", "must be a list, e.g. [a, b]"),
])
def test_wrong_types_and_ranges_are_refused_in_one_line(config_name, override, rule):
    with pytest.raises(ConfigError) as refused:
        check_command_line([override], config_name, _builders()[config_name])
    assert str(refused.value) == f"{override} is not allowed: {rule}"


def test_good_overrides_compose():
    cfg = check_command_line(["temperature=0", "max_new_tokens=5"], "generate")
    assert cfg.temperature == 0 and cfg.max_new_tokens == 5


@pytest.mark.parametrize("module, command, override, message", [
    ("tinylm.cli.generate", "tinylm-generate", "tempurature=0.5", "unknown config key"),
    ("tinylm.cli.prepare", "tinylm-prepare", "tempurature=0.5", "unknown config key"),
    ("tinylm.cli.train", "tinylm-train", "optim.lr=nan", "optim.lr=nan is not allowed"),
    ("tinylm.cli.generate", "tinylm-generate", "temperature=nan", "temperature=nan is not allowed"),
])
def test_the_commands_check_their_command_line_before_hydra_runs(module, command, override,
                                                                  message, tmp_path):
    result = run_cli(module, override, cwd=tmp_path, timeout=120)
    assert result.returncode == 1
    assert result.stderr.strip().startswith(f"{command}: error: {message}")
    assert len(result.stderr.strip().splitlines()) == 1
    assert not any(tmp_path.iterdir())  # nothing written: no run directory, no .hydra/


# What tinylm reads of Hydra beyond its public API falls back to Hydra's own behaviour when a
# Hydra release changes it.
def test_without_hydras_private_parser_hydra_reads_the_command_line_itself(monkeypatch, capsys):
    from tinylm.cli import generate

    monkeypatch.delattr(hydra._internal.utils, "get_args_parser")
    monkeypatch.setattr(sys, "argv", ["tinylm-generate", "tempurature=0.5"])
    assert check_command_line_or_exit("tinylm-generate", "generate") is None  # nothing checked
    with pytest.raises(SystemExit) as stopped:
        generate.main()  # Hydra's own parser, and its own words for the bad override
    assert stopped.value.code == 1
    assert "Could not override 'tempurature'" in capsys.readouterr().err


def test_a_hydra_error_worded_otherwise_comes_out_as_its_first_line(monkeypatch):
    # the wording is not recognized
    monkeypatch.setattr(tinylm.cli.command_line, "KEY_IN_HYDRA_ERROR", ())
    with pytest.raises(ConfigError) as refused:
        check_command_line(["tempurature=0.5"], "generate")
    assert str(refused.value) == "tempurature=0.5: Could not override 'tempurature'."


def _python(code: str) -> str:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, check=True).stdout.strip()


def test_the_training_command_imports_neither_hydra_nor_torch_until_it_runs():
    # the helper drawing the figures imports this module again (spawn): it starts sooner
    loaded = _python("import sys, tinylm.cli.train; "
                     "print(sorted({m.split('.')[0] for m in sys.modules} & "
                     "{'hydra', 'omegaconf', 'torch'}))")
    assert loaded == "[]"


def test_the_commands_leave_their_objects_out_of_the_collection_at_exit():
    # registered before tinylm.cli is imported, so it runs after tinylm's exit handler
    frozen = _python("import atexit, gc; "
                     "atexit.register(lambda: print(gc.get_freeze_count() > 0)); "
                     "import tinylm.cli")
    assert frozen == "True"


ATTENTION_PAGE_FAULTS = """
import resource, torch
import tinylm.cli  # the commands' malloc settings
from tinylm.model import ModelConfig, TinyLM
model = TinyLM(ModelConfig(vocab_size=256, n_layer=2)).eval()
idx = torch.zeros(4, 128, dtype=torch.long)
faults = []
with torch.inference_mode():
    for _ in range(12):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        model(idx, return_attention=True)  # ~14 MB of (4, 4, 128, 128) intermediates, freed
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(sum(faults[3:]))  # after three calls to warm up
"""


@pytest.mark.skipif(sys.platform != "linux", reason="tunes glibc's malloc, which is Linux's")
def test_the_commands_reuse_freed_memory_instead_of_faulting_it_in_again():
    # without the tuning glibc gave the freed intermediates back to the kernel, and the next
    # calls faulted them in again: 9,000-11,000 page faults over the last 9 calls here, against
    # 0-200 with it
    faults = int(_python(ATTENTION_PAGE_FAULTS))
    assert faults < 2000


def test_training_starts_with_the_collector_off_and_trains_with_it_on(monkeypatch, tmp_path):
    import tinylm.cli.train
    import tinylm.train

    seen = {}

    def check(cfg):
        seen["checking"] = gc.isenabled()
        return build_run_config(cfg)

    def stop_before_training(cfg):
        seen["training"], seen["frozen"] = gc.isenabled(), gc.get_freeze_count()
        raise ValueError("stopped")

    build_run_config = tinylm.cli.train.build_run_config
    monkeypatch.setattr(tinylm.cli.train, "build_run_config", check)
    monkeypatch.setattr(tinylm.train.trainer, "train", stop_before_training)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["tinylm-train", "hydra.run.dir=run"])
    try:
        with pytest.raises(SystemExit, match="tinylm-train: error: stopped"):
            tinylm.cli.train.main()
    finally:
        gc.unfreeze()  # the rest of the session collects as before
    assert (seen["checking"], seen["training"]) == (False, True)
    assert seen["frozen"] > 0  # what start-up made is left out of the collections
    assert seen["frozen"] > 100_000  # start-up's objects (torch's among them) left out
    assert gc.isenabled()


@pytest.mark.parametrize("module, args, shown", [
    ("tinylm.cli.explain", [], "2. Scaled: S / ?d  (?2 = 1.4142)"),
    ("tinylm.cli.generate", ["prompt='x → y'", "max_new_tokens=1", "temperature=0"], "x ? y"),
])
def test_output_redirected_in_a_code_page_without_a_character_shows_a_question_mark(
        module, args, shown, model, bpe, tmp_path):
    # Windows writes a pipe or a file in its ANSI code page, cp1252 say: no √, no →
    run_dir = save_run(tmp_path / "run", model, bpe)
    if module == "tinylm.cli.generate":
        args = [f"checkpoint={run_dir}", *args]
    done = subprocess.run([sys.executable, "-m", module, *args], cwd=tmp_path,
                          env={**os.environ, "PYTHONIOENCODING": "cp1252"},
                          capture_output=True, timeout=300)
    assert done.returncode == 0, done.stderr.decode("cp1252", "replace")
    assert shown in done.stdout.decode("cp1252")
