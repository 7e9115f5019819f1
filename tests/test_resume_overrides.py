"""tinylm-train train.resume=true hydra.run.dir=<run>: the run's record (.hydra/config.yaml) is
the resume's one source of values, an override given again must agree with it, another
train.max_steps says what it does to the learning rate, a missing or crafted record is said in
one line before any work; and a data=text run samples from its own corpus."""

import shlex
import shutil
import signal
import sys
from types import SimpleNamespace

import pytest
import yaml
from helpers import TINY, compose, refusal, save_run
from omegaconf import OmegaConf
from test_train import ctrl_c_during_step, scalars

import tinylm.cli.train
from tinylm.cli import shell_word
from tinylm.config import ConfigError
from tinylm.train.optim import OptimConfig, lr_at
from tinylm.train.resume import schedule_change
from tinylm.train.run_config import RunConfig

STOP_AT = 6  # the run is stopped while it draws the batch of this step


def tinylm_train(monkeypatch, *argv) -> None:
    """tinylm-train with the command line `argv`, in this process."""
    monkeypatch.setattr(sys, "argv", ["tinylm-train", *argv])
    tinylm.cli.train.main()


def files_of(folder) -> dict:
    """Every file under `folder` with its bytes: what a refused command must leave as it was."""
    return {p: p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture
def stopped(corpus, tmp_path, monkeypatch, capsys):
    """(run dir, the printed resume hint) of a run started with overrides and Ctrl-C'd at step
    STOP_AT, in a run dir whose name needs the shell's quotes."""
    run_dir = tmp_path / "my run"
    started = [*TINY, f"data.files=[{corpus / 'stories.txt'}]",
               f"data.cache_dir={corpus / 'cache'}", "train.max_steps=12",
               "train.eval_interval=4", *shlex.split(shell_word("hydra.run.dir", str(run_dir)))]
    uninterrupt = ctrl_c_during_step(monkeypatch, STOP_AT)
    handlers = {signum: signal.getsignal(signum) for signum in (signal.SIGINT, signal.SIGTERM)}
    with pytest.raises(SystemExit) as stopped:
        tinylm_train(monkeypatch, *started)
    uninterrupt()
    for signum, handler in handlers.items():  # the command ignores them once stopped
        signal.signal(signum, handler)
    assert stopped.value.code == 128 + signal.SIGINT
    hint = capsys.readouterr().err.splitlines()[-1].strip()
    return run_dir, hint


@pytest.mark.slow
def test_the_printed_hint_resumes_a_run_started_with_overrides(stopped, monkeypatch, capsys):
    run_dir, hint = stopped
    prog, *args = shlex.split(hint)
    assert prog == "tinylm-train" and args[0] == "train.resume=true" and len(args) == 2
    tinylm_train(monkeypatch, *args)
    out = capsys.readouterr().out
    assert "Done: 12 steps" in out
    assert [step for step, _ in scalars(run_dir, "train/loss")] == list(range(1, 13))
    recorded = yaml.safe_load((run_dir / ".hydra" / "overrides.yaml").read_text())
    assert "model.n_embd=32" in recorded and "train.resume=true" in recorded
    tinylm_train(monkeypatch, *args, "train.max_steps=14")  # and a resume of the resumed run
    assert "Done: 14 steps" in capsys.readouterr().out


@pytest.mark.slow
def test_an_override_that_differs_from_the_run_is_refused_naming_it(stopped, monkeypatch):
    run_dir, hint = stopped
    before = files_of(run_dir)
    said = refusal(tinylm.cli.train.main, *shlex.split(hint)[1:], "model.n_embd=32",
                   "optim.lr=0.02", "train.seed=7", monkeypatch=monkeypatch)
    assert "\n" not in said and said.startswith("tinylm-train: error: train.resume=true")
    assert "2 overrides given now differ: optim.lr: 0.01 when the run started, 0.02 now; " \
           "train.seed: 1337 when the run started, 7 now; drop them" in said
    assert "model.n_embd" not in said.split("differ:")[1].split("drop them")[0]
    assert files_of(run_dir) == before
    # what it suggests instead: a new run from the checkpoint, with the run's and these values
    prog, *args = shlex.split(said.split("last checkpoint: ")[1])
    new_run = compose("config", args, return_hydra_config=True)
    assert prog == "tinylm-train" and new_run.train.resume == str(run_dir)
    assert (new_run.optim.lr, new_run.train.seed, new_run.model.n_embd) == (0.02, 7, 32)
    assert new_run.hydra.run.dir != str(run_dir)


@pytest.mark.slow
def test_an_agreeing_override_and_a_longer_max_steps_resume_and_say_what_the_lr_does(
        stopped, monkeypatch, capsys):
    run_dir, hint = stopped
    # the first two as the run recorded them, the third as its config had it by default
    tinylm_train(monkeypatch, *shlex.split(hint)[1:], "model.n_embd=32", "optim.lr=1e-2",
                 "train.seed=1337", "train.max_steps=16")
    captured = capsys.readouterr()
    assert "Done: 16 steps" in captured.out
    optim = OptimConfig(**compose("config", [*TINY]).optim)
    before, after = lr_at(STOP_AT, optim, 12), lr_at(STOP_AT, optim, 16)
    assert before != after
    assert (f"train.max_steps=16 (the run had 12): the learning-rate "
            f"schedule is rebuilt to decay to optim.min_lr at step 16, so where it resumes, after "
            f"step {STOP_AT}, the learning rate goes from {before:.3g} to {after:.3g}") \
        in captured.out  # the log
    assert dict(scalars(run_dir, "train/lr"))[STOP_AT + 1] == pytest.approx(after)
    assert "train.max_steps=16" in yaml.safe_load(
        (run_dir / ".hydra" / "overrides.yaml").read_text())


def recorded_run(run_dir, model, bpe, *overrides):
    """A run directory with a checkpoint and the record tinylm-train writes when it starts
    (.hydra/: config.yaml, hydra.yaml, overrides.yaml), as if started with `overrides`."""
    save_run(run_dir, model, bpe)
    composed = compose("config", overrides, return_hydra_config=True)
    values = {key: OmegaConf.to_container(composed[key], resolve=True) for key in RunConfig.GROUPS}
    (run_dir / ".hydra").mkdir()
    (run_dir / ".hydra" / "config.yaml").write_text(OmegaConf.to_yaml(values))
    (run_dir / ".hydra" / "hydra.yaml").write_text(OmegaConf.to_yaml(
        {"hydra": {"runtime": {"choices": dict(composed.hydra.runtime.choices)}}}))
    (run_dir / ".hydra" / "overrides.yaml").write_text(OmegaConf.to_yaml(list(overrides)))
    return run_dir


def resumed(run_dir, *overrides):
    """The RunConfig of `train.resume=true` with `overrides` given now, in `run_dir`."""
    now = ["train.resume=true", *overrides]
    values = OmegaConf.to_container(compose("config", now), resolve=True)
    choices = compose("config", now, return_hydra_config=True).hydra.runtime.choices
    return tinylm.cli.train.as_recorded(run_dir, values, now, choices)


def test_a_resume_takes_every_value_from_the_runs_record_and_what_may_change_from_now(
        tmp_path, model, bpe):
    run_dir = recorded_run(tmp_path / "run", model, bpe, "experiment=shakespeare_char",
                           "optim.lr=1e-2", "model.n_layer=2")
    cfg = resumed(run_dir, "train.max_steps=900", "train.threads=1", "optim.lr=0.01",
                  "experiment=shakespeare_char")
    assert (cfg.data.name, cfg.tokenizer.name, cfg.model.n_layer, cfg.optim.lr) == (
        "tinyshakespeare", "char", 2, 0.01)  # the record's, not conf/'s defaults
    assert (cfg.train.max_steps, cfg.train.threads, cfg.train.resume) == (900, 1, True)
    assert cfg.run_dir == str(run_dir)


@pytest.mark.parametrize("given, differs", [
    (["model.n_layer=3"], "model.n_layer: 2 when the run started, 3 now"),
    (["optim=adamw"], "optim: muon when the run started, adamw now"),
    (["experiment=shakespeare_char", "train.seed=7"],
     "experiment: null when the run started, shakespeare_char now; train.seed: 1337 when the "
     "run started, 7 now"),
])
def test_an_override_that_disagrees_with_the_record_is_refused_naming_each(
        given, differs, tmp_path, model, bpe):
    run_dir = recorded_run(tmp_path / "run", model, bpe, "model.n_layer=2")
    with pytest.raises(ConfigError) as refused:
        resumed(run_dir, *given)
    said = str(refused.value)
    assert f"given now {'differ' if len(given) > 1 else 'differs'}: {differs}; drop" in said
    prog, *args = shlex.split(said.split("last checkpoint: ")[1])
    # a new run instead: the run's overrides, those given now in place of theirs
    kept = [] if given[0].startswith("model.n_layer=") else ["model.n_layer=2"]
    assert prog == "tinylm-train" and args == [f"train.resume={run_dir}", *kept, *given]


def test_a_resume_whose_record_is_missing_says_so_before_any_work(
        tmp_path, model, bpe, monkeypatch):
    run_dir = recorded_run(tmp_path / "run", model, bpe, "model.n_layer=2")
    shutil.rmtree(run_dir / ".hydra")
    before = files_of(run_dir)
    monkeypatch.chdir(tmp_path)
    said = refusal(tinylm.cli.train.main, "train.resume=true", f"hydra.run.dir={run_dir}",
                   f"data.cache_dir={tmp_path / 'cache'}", monkeypatch=monkeypatch)
    record = run_dir / ".hydra" / "config.yaml"
    last = run_dir / "checkpoints" / "step-0000001"
    assert said == (
        f"tinylm-train: error: train.resume=true continues {run_dir} as it recorded itself, in "
        f"{record}, which is missing; restore it (its last checkpoint holds the same values: "
        f"mkdir -p {record.parent} && cp {last / 'config.yaml'} {record}), or start a new run "
        f"from that checkpoint with the values given here: tinylm-train train.resume={run_dir} "
        f"data.cache_dir={tmp_path}/cache")
    assert files_of(run_dir) == before and not (tmp_path / "cache").exists()  # no data prepared


@pytest.mark.parametrize("file, text, why", [
    ("overrides.yaml", "model: [unclosed", None),
    ("overrides.yaml", "- model.n_layer=2\n- +hydra.callbacks.x._target_=os.system\n", None),
    ("config.yaml", "model: [unclosed", "expected ',' or ']'"),
    ("config.yaml", "- 1\n", "it holds no mapping of config groups"),
    ("config.yaml", "model:\n  n_layers: 3\n", "unknown config key model.n_layers"),
])
def test_a_malformed_or_crafted_record_is_refused_in_one_line_naming_it(
        file, text, why, tmp_path, monkeypatch, model, bpe):
    run_dir = recorded_run(tmp_path / "run", model, bpe, "model.n_layer=2")
    (run_dir / ".hydra" / file).write_text(text)
    before = files_of(run_dir)
    said = refusal(tinylm.cli.train.main, "train.resume=true", f"hydra.run.dir={run_dir}",
                   monkeypatch=monkeypatch)
    path = run_dir / ".hydra" / file
    assert "\n" not in said
    if why is None:
        assert said == (f"tinylm-train: error: {path} is not the list of overrides a run "
                        "records; restore it, or remove it and give the run's overrides again "
                        "with train.resume=true")
    else:
        assert said.startswith(f"tinylm-train: error: {path} is not the record of a run (") and \
            why in said
    assert files_of(run_dir) == before


@pytest.mark.slow
@pytest.mark.parametrize("given, prompt", [
    ((), "The lighthouse keeper counted"),
    (("train.sample_prompt='Once upon a time'",), "Once upon a time")])
def test_a_data_text_run_suggests_a_prompt_from_its_corpus(
        corpus, tmp_path, monkeypatch, capsys, given, prompt):
    own = tmp_path / "notes.txt"
    text = (corpus / "stories.txt").read_text()
    own.write_text(f"\n  The lighthouse keeper counted the ships, one by one.\n\n{text}")
    run_dir = tmp_path / "run"
    tinylm_train(monkeypatch, *TINY, f"data.files=[{own}]", f"data.cache_dir={tmp_path}",
                 "train.max_steps=2", f"hydra.run.dir={run_dir}", *given)
    generate = capsys.readouterr().out.splitlines()[-2]
    prog, *args = shlex.split(generate)
    assert prog == "tinylm-generate" and compose("generate", args).prompt == prompt
    recorded = yaml.safe_load((run_dir / ".hydra" / "config.yaml").read_text())
    assert recorded["train"]["sample_prompt"] == prompt  # the sample at each evaluation too


def test_a_schedule_that_optim_lr_decay_steps_fixes_is_said_to_stay():
    ckpt = SimpleNamespace(run_config={"train": {"max_steps": 400}})
    optim = OptimConfig(lr_decay_steps=500, min_lr=1e-4)
    assert schedule_change(ckpt, optim, 600, 400) == (
        f"train.max_steps=600 (the run had 400): the learning-rate schedule stays as it was, set "
        f"by optim.lr_decay_steps=500 ({lr_at(400, optim, 600):.3g} after step 400, "
        f"optim.min_lr=0.0001 from step 500 on)")
    assert lr_at(400, optim, 600) == lr_at(400, optim, 400)
    assert schedule_change(ckpt, optim, 400, 300) is None  # the same max_steps: nothing to say
