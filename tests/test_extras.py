"""The evaluation extras' helper: summaries drawn elsewhere, written in order, waited for."""

import os
import subprocess
import sys
import threading
import time
from concurrent.futures.process import BrokenProcessPool

import numpy as np
import pytest
from helpers import causal_weights
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch.utils.tensorboard import SummaryWriter

import tinylm.inspection.figures
from tinylm.inspection.figures import attention_grid_figure, figure_to_image
from tinylm.train.figure_process import (
    Extras,
    attention_grid_summaries,
    image_summary,
    lay_out_attention_grid,
)

TOKENS = ["Lily", " went", " home", ".", " She"]


def weights(seed):
    """(n_layer=2, n_head=2, T, T) rows that sum to 1 over the causal keys."""
    return causal_weights(seed, (2, 2, 5, 5))


def images(logdir):
    events = EventAccumulator(str(logdir), size_guidance={"images": 0})
    events.Reload()
    return {tag: events.Images(tag) for tag in events.Tags()["images"]}


@pytest.mark.slow
def test_the_helper_process_writes_what_add_image_writes(tmp_path):
    extras = Extras("process")
    with SummaryWriter(tmp_path / "helper") as writer:
        extras.submit(10, attention_grid_summaries, weights(0), TOKENS)
        extras.submit(20, attention_grid_summaries, weights(1), TOKENS)
        assert extras.close(writer, wait=True) == 0
    assert extras.pending == 0
    with SummaryWriter(tmp_path / "inline") as writer:  # what training wrote before the helper
        for step, seed in ((10, 0), (20, 1)):
            for layer, w in enumerate(weights(seed)):
                fig = attention_grid_figure(w, TOKENS, f"layer {layer}, step {step}")
                writer.add_image(f"attention/layer_{layer:02d}", figure_to_image(fig), step,
                                 dataformats="HWC")
    helper, inline = images(tmp_path / "helper"), images(tmp_path / "inline")
    assert sorted(helper) == sorted(inline) == ["attention/layer_00", "attention/layer_01"]
    for tag in helper:
        assert [e.step for e in helper[tag]] == [10, 20]
        assert [e.encoded_image_string for e in helper[tag]] == [
            e.encoded_image_string for e in inline[tag]]


@pytest.mark.slow
def test_a_helper_started_early_lays_the_grid_out_and_draws_what_a_fresh_figure_draws(tmp_path):
    extras = Extras("process")
    extras.start(lay_out_attention_grid, TOKENS, 2)
    with SummaryWriter(tmp_path / "helper") as writer:
        extras.submit(10, attention_grid_summaries, weights(0), TOKENS)
        assert extras.close(writer, wait=True) == 0
    with SummaryWriter(tmp_path / "inline") as writer:
        for layer, w in enumerate(weights(0)):
            writer.add_image(f"attention/layer_{layer:02d}", figure_to_image(
                attention_grid_figure(w, TOKENS, f"layer {layer}, step 10")), 10,
                dataformats="HWC")
    helper, inline = images(tmp_path / "helper"), images(tmp_path / "inline")
    assert sorted(helper) == ["attention/layer_00", "attention/layer_01"]
    for tag in helper:
        assert [e.encoded_image_string for e in helper[tag]] == [
            e.encoded_image_string for e in inline[tag]]


@pytest.mark.slow
def test_the_warm_up_is_the_first_draws_layout(monkeypatch):
    laid_out = []
    lay_out = tinylm.inspection.figures.AttentionGridImages._lay_out
    monkeypatch.setattr(tinylm.inspection.figures.AttentionGridImages, "_lay_out",
                        lambda self, *args: (laid_out.append(tuple(self.tokens)),
                                             lay_out(self, *args)))
    tokens = ["Tom", " saw", " it", "."]  # a token list no other test lays out in this process
    extras = Extras("thread")
    extras.start(lay_out_attention_grid, tokens, 3)
    extras.close(None, wait=True)
    assert laid_out == [tuple(tokens)]
    attention_grid_summaries(causal_weights(1, (2, 3, 4, 4)), tokens, 7)
    assert laid_out == [tuple(tokens)]  # the evaluation's draw reuses the layout


def _helper_that_dies():
    os._exit(1)


def slow_summary(release: threading.Event, step):
    release.wait(10)
    return [image_summary("slow", np.zeros((2, 2, 3), dtype=np.uint8))]


def test_finished_extras_are_written_in_order_and_close_can_drop_the_rest(tmp_path):
    release = threading.Event()
    extras = Extras("thread")
    with SummaryWriter(tmp_path) as writer:
        extras.submit(1, attention_grid_summaries, weights(0), TOKENS)
        extras.submit(2, slow_summary, release)
        extras.submit(3, attention_grid_summaries, weights(1), TOKENS)
        extras._pending[0][2].result()  # the first is done; the second waits for `release`
        extras.write_finished(writer)
        assert extras.pending == 2  # the third may be done, but waits its turn behind the second
        assert extras.close(writer, wait=False) == 2
        release.set()
    written = images(tmp_path)
    assert [e.step for e in written["attention/layer_00"]] == [1]
    assert "slow" not in written


def test_an_extra_that_fails_raises_in_the_training_process(tmp_path):
    extras = Extras("thread")
    with pytest.raises(ValueError, match="weights must be"), SummaryWriter(tmp_path) as writer:
        extras.submit(1, attention_grid_summaries, weights(0)[:, :, :3, :3], TOKENS)
        extras.write_finished(writer)


@pytest.mark.slow
def test_figures_are_still_drawn_when_the_helper_process_cannot_run(tmp_path, monkeypatch, caplog):
    # what a script that calls train() without `if __name__ == "__main__":` meets
    monkeypatch.setattr("tinylm.train.figure_process._start_helper", _helper_that_dies)
    extras = Extras("process")
    with SummaryWriter(tmp_path) as writer:
        extras.submit(5, attention_grid_summaries, weights(0), TOKENS)
        extras.submit(6, attention_grid_summaries, weights(1), TOKENS)
        extras.close(writer, wait=True)
    assert [e.step for e in images(tmp_path)["attention/layer_01"]] == [5, 6]
    assert sum("drawing them in the training process" in r.message
               for r in caplog.records) == 1


@pytest.mark.slow
def test_figures_are_drawn_here_when_the_helper_stopped_before_the_first_one(tmp_path, monkeypatch,
                                                                            caplog):
    monkeypatch.setattr("tinylm.train.figure_process._start_helper", _helper_that_dies)
    extras = Extras("process")
    with pytest.raises(BrokenProcessPool):
        extras.start().result(timeout=60)
    with SummaryWriter(tmp_path) as writer:
        extras.submit(5, attention_grid_summaries, weights(0), TOKENS)
        extras.close(writer, wait=True)
    assert [e.step for e in images(tmp_path)["attention/layer_01"]] == [5]
    assert sum("drawing them in the training process" in r.message
               for r in caplog.records) == 1


@pytest.mark.slow
def test_one_process_draws_models_of_other_head_counts_on_the_same_prompt():
    """The layouts a process keeps (one per token list) do not mix up two models' grids, as
    two runs in one process with the drawing thread would ask."""
    for n_head in (2, 3, 2):
        w = causal_weights(n_head, (1, n_head, 5, 5))
        fresh = image_summary("attention/layer_00", figure_to_image(
            attention_grid_figure(w[0], TOKENS, "layer 0, step 7")))
        assert attention_grid_summaries(w, TOKENS, 7) == [fresh]


ORPHANED_TRAINING = '''
import os
from types import SimpleNamespace

from tensorboard.compat.proto.summary_pb2 import Summary

from tinylm.train.figure_process import Extras


def helper_pid(step):
    return [Summary(value=[Summary.Value(tag="pid", simple_value=os.getpid())]).SerializeToString()]


if __name__ == "__main__":
    pids = []
    def add_summary(summary, step, walltime):
        pids.append(int(summary.value[0].simple_value))

    writer = SimpleNamespace(file_writer=SimpleNamespace(add_summary=add_summary))
    extras = Extras()
    extras.submit(0, helper_pid)
    while extras.pending:
        extras.write_finished(writer)
    print(pids[0], flush=True)
    os._exit(1)  # gone without any clean-up, as after kill -9
'''


def _running(pid: int) -> bool:
    """Whether process `pid` still runs (a zombie, ended but not yet reaped, does not)."""
    if os.path.isdir("/proc"):
        try:
            with open(f"/proc/{pid}/stat") as stat:
                return stat.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
        except FileNotFoundError:
            return False
    try:
        os.kill(pid, 0)
    except OSError:
        return False
    return True


@pytest.mark.slow
def test_the_helper_ends_when_the_training_process_dies_without_closing_it(tmp_path):
    script = tmp_path / "orphaned_training.py"
    script.write_text(ORPHANED_TRAINING)
    ran = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                         timeout=60)
    helper = int(ran.stdout.split()[0])
    deadline = time.monotonic() + 30
    while _running(helper) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _running(helper)
