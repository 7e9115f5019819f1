"""Every tinylm-* command refuses a bad override in one line naming the key and what is allowed,
composed once by Hydra, and writes nothing when it refuses."""

import ast
import os
import shlex
import subprocess
import sys
from types import SimpleNamespace

import pytest
from helpers import compose, refusal, run_cli, save_run, to_dataclass

import tinylm.cli.bench
import tinylm.cli.explain
import tinylm.cli.generate
import tinylm.cli.prepare
import tinylm.cli.probe
import tinylm.cli.train
from tinylm.checkpoint import tagged_checkpoint
from tinylm.cli import shell_word
from tinylm.cli.generate import GenerateConfig
from tinylm.files import PACKAGE_DIR

MAINS = {"generate": tinylm.cli.generate.main, "probe": tinylm.cli.probe.main,
         "explain": tinylm.cli.explain.main, "bench": tinylm.cli.bench.main,
         "config": tinylm.cli.train.main, "prepare": tinylm.cli.prepare.main}
PROGS = {"config": "tinylm-train"}


def refused(config_name, override, monkeypatch, tmp_path) -> str:
    """The one line the command of `config_name` ends with on `override`, checked to have
    written nothing into the current directory."""
    monkeypatch.chdir(tmp_path)
    said = refusal(MAINS[config_name], override, monkeypatch=monkeypatch)
    prog = PROGS.get(config_name, f"tinylm-{config_name}")
    assert said.startswith(f"{prog}: error: ") and "\n" not in said
    assert not any(tmp_path.iterdir())  # no run directory, no .hydra/, no log
    return said.removeprefix(f"{prog}: error: ")


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
    ("prepare", "tempurature=0.5", "unknown config key or group tempurature"),
    ("config", "trian.max_steps=5", "unknown config key or group trian"),
    ("config", "train.max_step=5", "unknown config key train.max_step (in train.max_step=5); "
                                   "allowed under train: max_steps,"),
    ("config", "model=huge", "model=huge: there is no model/huge.yaml; allowed model options: "
                             "default"),
    ("config", "experiment=nope", "allowed experiment options: shakespeare_char"),
    ("config", "+model.n_layers=3", "unknown config key model.n_layers; allowed under model:"),
    ("config", "model.n_embd=130", "model.n_embd=130 is not allowed: must be divisible by "
                                   "model.n_head=4"),
    ("config", "train.batch_size=0", "train.batch_size=0 is not allowed: must be an integer >= 1"),
    ("config", "optim.lr=-0.001", "optim.lr=-0.001 is not allowed: must be a finite number >= 0"),
    ("config", "train.precision=fp8", "train.precision='fp8' is not allowed; allowed: auto, "
                                      "fp32, bf16"),
    ("config", "train.threads=0", "train.threads=0 is not allowed: must be auto or an integer "
                                  ">= 1"),
    ("config", "optim.name=sgd", "optim.name='sgd' is not allowed; allowed: adamw, muon"),
])
def test_bad_overrides_are_refused_in_one_line(config_name, override, message, monkeypatch,
                                               tmp_path):
    assert message in refused(config_name, override, monkeypatch, tmp_path)


# The values an adversarial run found slipping through: a wrong type is refused by the schema at
# composition, a wrong range by the dataclass's validators; both before any data or model.
BOOL, FLOAT, FINITE = "must be true or false", "must be a float", "must be a finite number >= 0"
TEMPERATURE = "must be 0 (greedy) or a finite number >= 0.001"


@pytest.mark.parametrize("config_name, override, rule", [
    ("config", "model.bias=maybe", BOOL),
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
    ("explain", "causal=1", BOOL),
    ("bench", "repeats=many", "must be an integer"),
    ("config", "data.files=notes.txt", "must be a list, e.g. [a, b]"),
])
def test_wrong_types_and_ranges_are_refused_in_one_line(config_name, override, rule,
                                                        monkeypatch, tmp_path):
    assert refused(config_name, override, monkeypatch, tmp_path) == \
        f"{override} is not allowed: {rule}"


@pytest.mark.parametrize("config_name, override, said", [
    ("config", "model.bias=no", "model.bias='no'"),
    ("config", "train.compile=off", "train.compile='off'"),
    ("generate", "use_cache=1", "use_cache=1"),
    ("explain", "causal=yes", "causal='yes'"),
])
def test_a_bool_that_omegaconf_would_read_is_held_to_the_flag_rule(config_name, override, said,
                                                                   monkeypatch, tmp_path):
    # OmegaConf reads no, off, yes and 1 as bools: a word must never flip a setting unseen
    assert refused(config_name, override, monkeypatch, tmp_path) == \
        f"{said} is not allowed: must be true or false"


@pytest.mark.parametrize("override, said", [
    ("ablate=yes", "ablate='yes' is not allowed; allowed: false, true, zero, mean"),
    ("patch=1", "patch=1 is not allowed: must be true or false or a string"),  # not the flag
    ("patch=exact", "patch='exact' is not allowed; allowed: false, true, fast"),
])
def test_a_flag_that_also_takes_words_names_every_value(override, said, monkeypatch, tmp_path):
    assert refused("probe", override, monkeypatch, tmp_path) == said


@pytest.mark.parametrize("sweep, message", [
    (["optim.lr=-1.0,-2.0"], "optim.lr=-1.0 is not allowed: must be a finite number >= 0 "
                             "(job 0 of the sweep's 2)"),
    # a later job's bad value is found before the first job trains
    (["model.n_layer=1,0,2", "train.max_steps=1"],
     "model.n_layer=0 is not allowed: must be an integer >= 1 (job 1 of the sweep's 3)"),
    (["train.seed=1,2", "train.compile=false,no"],
     "train.compile='no' is not allowed: must be true or false (job 1 of the sweep's 4)"),
    (["train.seed=1,2", "data=tinystories,nope"], "data=tinystories,nope: there is no "
     "data/nope.yaml; allowed data options: text, tinyshakespeare, tinystories, tinystories_hub "
     "(job 1 of the sweep's 4)"),
])
def test_a_bad_value_in_any_job_of_a_sweep_refuses_the_sweep_before_a_job_runs(sweep, message,
                                                                             monkeypatch,
                                                                             tmp_path):
    monkeypatch.chdir(tmp_path)
    said = refusal(tinylm.cli.train.main, "-m", *sweep, monkeypatch=monkeypatch)
    assert said == f"tinylm-train: error: {message}; no job was run"
    assert not any(tmp_path.iterdir())  # nor Hydra's record of a sweep that ran nothing


def test_a_sweep_is_checked_from_hydras_own_list_of_jobs_before_its_first_job(
        monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    checked, check = [], tinylm.cli.train.check_sweep

    def check_then_stop(jobs, compose):
        check(jobs, compose)  # returns: every job's values are allowed
        checked.extend(jobs)
        raise ValueError("stopped before the first job")

    monkeypatch.setattr(tinylm.cli.train, "check_sweep", check_then_stop)
    said = refusal(tinylm.cli.train.main, "--multirun", "model.n_layer=1,2",
                   "optim.lr=range(1,3)", "hydra.sweep.dir=sweep", monkeypatch=monkeypatch)
    assert said == "tinylm-train: error: stopped before the first job"
    # Hydra's basic sweeper's jobs, in its order; its own settings are not a job's
    assert checked == [[f"model.n_layer={n}", f"optim.lr={lr}"] for n in (1, 2) for lr in (1, 2)]
    assert not any(tmp_path.iterdir())


def test_no_hand_made_sweep_and_no_rewritten_command_line_in_the_commands():
    for path in (PACKAGE_DIR / "cli").glob("*.py"):
        text = path.read_text(encoding="utf-8")
        assert "itertools.product" not in text and "sys.argv[1:] =" not in text, path.name


@pytest.mark.parametrize("config_name, argv, said", [
    # a value of several words, unquoted: the shell hands Hydra "upon" alone
    ("generate", ["prompt=Once", "upon", "a", "time", "max_new_tokens=5"],
     "prompt=Once upon a time: options are key=value, one word each; quote a value with "
     "spaces: 'prompt=\"Once upon a time\"'"),
    ("generate", ["--checkpoint", "runs/my run"],
     "--checkpoint runs/my run: options are key=value: 'checkpoint=runs/my run'"),
    ("probe", ["--checkpoint=runs/x"], "--checkpoint=runs/x: options are key=value: "
                                       "checkpoint=runs/x"),
    ("config", ["--train.max_steps", "5"], "--train.max_steps 5: options are key=value: "
                                           "train.max_steps=5"),
    ("config", ["--experiment"], "--experiment: options are key=value: experiment=<value>"),
    ("config", ["hello"], "hello: options are key=value; --help lists them"),
])
def test_a_new_users_command_line_is_answered_with_the_key_value_form(
        config_name, argv, said, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    prog = PROGS.get(config_name, f"tinylm-{config_name}")
    assert refusal(MAINS[config_name], *argv, monkeypatch=monkeypatch) == \
        f"{prog}: error: {said}"
    assert not any(tmp_path.iterdir())


def test_the_key_value_form_offered_pastes_back_as_the_value(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    said = refusal(tinylm.cli.generate.main, "prompt=Once", "upon", "a", "time,", "Lily",
                   monkeypatch=monkeypatch)
    (pasted,) = shlex.split(said.rpartition(": ")[2])
    assert compose("generate", [pasted]).prompt == "Once upon a time, Lily"
    # Hydra's own flags and a flag's value are Hydra's to read
    monkeypatch.setattr(sys, "argv", ["tinylm-generate", "--cfg", "job", "--package", "_global_"])
    tinylm.cli.refuse_what_hydra_cannot_read(GenerateConfig, ())


@pytest.mark.parametrize("config_name, argv", [
    ("generate", ["prompt=Hi there", "max_new_tokens=5"]),
    ("probe", ["ablate=true"]),
    ("explain", ["checkpoint=", "text=Hi there"]),
])
def test_a_command_without_a_checkpoint_says_to_train_first_and_names_the_newest_run(
        config_name, argv, model, bpe, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    main, prog = MAINS[config_name], f"tinylm-{config_name}"
    required = "checkpoint= is required: a run directory or a checkpoint directory; train one " \
               "first with tinylm-train"
    assert refusal(main, *argv, monkeypatch=monkeypatch) == f"{prog}: error: {required}"
    runs = tmp_path / "runs"
    for name, written in (("2026-12-02/09-00-00", 1_000), ("my run", 3_000),
                          ("2026-12-03/12-00-00", 2_000)):
        last = tagged_checkpoint(save_run(runs / name, model, bpe) / "checkpoints", "last")
        os.utime(last, (written, written))
    (runs / "untrained" / "checkpoints").mkdir(parents=True)  # no checkpoint: not a choice
    os.symlink("last", runs / "untrained" / "checkpoints" / "last")  # a tag linking to itself
    newest = " ".join([prog, "'checkpoint=runs/my run'",
                       *map(shlex.quote, [arg for arg in argv if arg != "checkpoint="])])
    assert refusal(main, *argv, monkeypatch=monkeypatch) == \
        f"{prog}: error: {required}, or use the newest run here, e.g. {newest}"


def test_good_overrides_compose():
    cfg = to_dataclass(GenerateConfig, compose("generate", ["temperature=0", "max_new_tokens=5"]),
                       "generate")
    assert cfg.temperature == 0 and cfg.max_new_tokens == 5


@pytest.mark.slow
@pytest.mark.parametrize("module, command, override, message", [
    ("tinylm.cli.generate", "tinylm-generate", "tempurature=0.5", "unknown config key"),
    ("tinylm.cli.prepare", "tinylm-prepare", "tempurature=0.5", "unknown config key"),
    ("tinylm.cli.train", "tinylm-train", "optim.lr=nan", "optim.lr=nan is not allowed"),
    ("tinylm.cli.generate", "tinylm-generate", "temperature=nan", "temperature=nan is not allowed"),
])
def test_the_commands_refuse_a_bad_command_line_in_one_line_and_write_nothing(
        module, command, override, message, tmp_path):
    result = run_cli(module, override, cwd=tmp_path, timeout=120)
    assert result.returncode == 1
    assert result.stderr.strip().startswith(f"{command}: error: {message}")
    assert len(result.stderr.strip().splitlines()) == 1
    assert not any(tmp_path.iterdir())  # nothing written: no run directory, no .hydra/


def _python(code: str) -> str:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, check=True).stdout.strip()


@pytest.mark.slow
def test_the_model_imports_no_hydra_tensorboard_matplotlib_or_bench():
    loaded = _python("import sys, tinylm.model, tinylm.generate, tinylm.checkpoint; "
                     "print(sorted({m.split('.')[0] for m in sys.modules} & {'hydra', "
                     "'omegaconf', 'tensorboard', 'matplotlib', 'transformers'} | "
                     "{m for m in sys.modules if m.startswith(('tinylm.bench', 'tinylm.cli'))}))")
    assert loaded == "[]"


@pytest.mark.slow
def test_importing_the_commands_elsewhere_leaves_the_signals_alone():
    # a command's console script installs its start-up handler (test_train_faults); a test, a
    # notebook or a library importing tinylm.cli keeps Python's Ctrl-C
    assert _python("import signal, tinylm.cli.train; print(signal.getsignal(signal.SIGINT) is "
                   "signal.default_int_handler, signal.getsignal(signal.SIGTERM) is "
                   "signal.SIG_DFL)") == "True True"


def test_no_private_hydra_module_is_read():
    private = []
    for path in PACKAGE_DIR.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            private += [f"{path.name}: {n}" for n in names if "hydra._" in n or "._internal" in n]
    assert private == []


@pytest.mark.slow
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


# A value as a shell user quotes it once (prompt="a, b" reaches Hydra as prompt=a, b): the line
# says how to quote it, and the command it names, pasted into a shell, gives Hydra that value.
@pytest.mark.parametrize("override, value, reason", [
    ("prompt=Once upon a time, Lily said", "Once upon a time, Lily said",
     "Hydra reads a comma as a sweep over values; quote the value twice"),
    ('prompt=He said "hi"', 'He said "hi"', "quote the value if it holds spaces or symbols"),
    ('prompt="He said "hi""', 'He said "hi"', "quote the value if it holds spaces or symbols"),
    ("prompt=Lily's cat", "Lily's cat", "quote the value if it holds spaces or symbols"),
])
def test_a_value_quoted_once_is_refused_with_the_command_to_paste(override, value, reason,
                                                                   monkeypatch, tmp_path):
    said = refused("generate", override, monkeypatch, tmp_path)
    assert said.startswith(f"{override}: ") and reason in said
    (pasted,) = shlex.split(said.rpartition(": ")[2])
    assert compose("generate", [pasted]).prompt == value


def test_a_comma_in_a_list_value_is_shown_the_brackets(monkeypatch, tmp_path):
    said = refused("prepare", "data.files=a.txt,b.txt", monkeypatch, tmp_path)
    assert said == "data.files=a.txt,b.txt: a list is written in brackets: " \
                   "'data.files=[a.txt,b.txt]'"


@pytest.mark.parametrize("value", ["runs/my run", 'say "hi", then \'bye\'', "C:\\runs\\x\\",
                                   'a\\"b', "true", "1", "a=b"])
def test_a_suggested_override_pastes_back_as_its_value(value):
    (pasted,) = shlex.split(shell_word("checkpoint", value))
    assert compose("generate", [pasted]).checkpoint == value


def test_the_next_steps_and_the_resume_hint_paste_into_a_shell(capsys):
    metrics = {"run_dir": "/tmp/my runs/it's", "val_loss": 1.5, "val_perplexity": 4.48,
               "best_val_loss": 1.5, "tokens_per_sec": 0, "step": 10, "seconds": 3,
               "checkpoint": "c/step-10", "best_checkpoint": "c/step-10"}
    cfg = SimpleNamespace(train=SimpleNamespace(sample_prompt='He said "hi"'),
                          run_dir=metrics["run_dir"])
    tinylm.cli.train.print_next_steps(metrics, cfg)
    generate, tensorboard = capsys.readouterr().out.splitlines()[-2:]
    prog, *args = shlex.split(generate)
    pasted = compose("generate", args)
    assert prog == "tinylm-generate" and pasted.checkpoint == "/tmp/my runs/it's"
    assert pasted.prompt == 'He said "hi"'
    assert shlex.split(tensorboard) == ["tensorboard", "--logdir", "/tmp/my runs/it's"]
    resume = shlex.split(tinylm.cli.train.resume_command(cfg))
    assert resume[:2] == ["tinylm-train", "train.resume=true"]
    assert compose("config", resume[1:], return_hydra_config=True).hydra.run.dir == \
        "/tmp/my runs/it's"


def test_plain_paths_and_prompts_print_as_before(capsys):
    metrics = {"run_dir": "runs/small", "val_loss": None, "best_val_loss": 1.5,
               "tokens_per_sec": 0, "step": 10, "seconds": 3, "checkpoint": "c/step-10",
               "best_checkpoint": "c/step-10"}
    cfg = SimpleNamespace(train=SimpleNamespace(sample_prompt="Once upon a time"),
                          run_dir="runs/small")
    tinylm.cli.train.print_next_steps(metrics, cfg)
    assert capsys.readouterr().out.endswith(
        "Next:\n  tinylm-generate checkpoint=runs/small 'prompt=\"Once upon a time\"'\n"
        "  tensorboard --logdir runs/small\n")
    assert tinylm.cli.train.resume_command(cfg) == \
        "tinylm-train train.resume=true hydra.run.dir=runs/small"
