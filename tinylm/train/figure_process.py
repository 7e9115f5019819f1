"""The figures of an evaluation, drawn by a helper process while training goes on.

Drawing takes longer than dozens of training steps, and a thread would hold the GIL the loop
needs. An extra is a module-level function (the helper imports it by name) that takes plain data
and the step and returns serialized TensorBoard `Summary` protos.

    extras = Extras()                                         # the helper starts at the first job
    extras.start(lay_out_attention_grid, tokens, n_head)      # now, laying a figure out
    extras.submit(250, attention_grid_summaries, weights, tokens)   # weights (L, nh, T, T)
    extras.write_finished(writer)                             # between steps: what is done
    dropped = extras.close(writer, wait=True)                 # end of run: wait for the rest
"""

from __future__ import annotations

import contextlib
import io
import logging
import multiprocessing
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import Executor, Future, ProcessPoolExecutor, ThreadPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from functools import lru_cache

import numpy as np
from PIL import Image
from tensorboard.compat.proto.summary_pb2 import Summary

log = logging.getLogger(__name__)

HELPER_NICENESS = 10  # how much lower the helper's priority is (Unix nice; 19 is the lowest)


def _start_helper() -> None:
    # a training process killed outright (kill -9) cannot stop its helper, which would wait for
    # jobs forever: a watcher thread ends the helper when its parent is gone
    threading.Thread(target=_exit_with_parent, daemon=True).start()
    with contextlib.suppress(AttributeError, OSError):  # os.nice: Unix only
        os.nice(HELPER_NICENESS)
    import tinylm.inspection.figures  # noqa: F401  (the import is the warm-up)


def _exit_with_parent() -> None:
    multiprocessing.parent_process().join()  # returns once the training process has ended
    os._exit(0)


def _nothing() -> None:
    pass


class Extras:
    """Runs extras in a helper (a `process`, or a `thread` for tests and comparison) and writes
    their summaries to TensorBoard in the order they were submitted."""

    def __init__(self, helper: str = "process"):
        # (step, wall time, result, extra, args): the extra and its args to draw it here if the
        # helper process dies
        self._pending: list[tuple[int, float, Future, Callable, tuple]] = []
        # a pool spawns its process at the first job; spawn on every OS: a fork of a process
        # running OpenMP threads is not safe
        self._executor: Executor
        if helper == "process":
            self._executor = ProcessPoolExecutor(
                1, mp_context=multiprocessing.get_context("spawn"), initializer=_start_helper)
        else:
            self._executor = ThreadPoolExecutor(1, thread_name_prefix="tinylm-extras")

    def start(self, warm_up: Callable[..., object] | None = None, *args) -> Future:
        """Start the helper now, not at the first submit, and have it run `warm_up(*args)`
        first (returns that job's Future), on another core while the caller starts up."""
        return self._executor.submit(warm_up or _nothing, *args)

    def submit(self, step: int, extra: Callable[..., list[bytes]], *args) -> None:
        """Run `extra(*args, step)` in the helper; its summaries are written at `step`."""
        walltime = time.time()  # TensorBoard shows when the evaluation happened
        try:
            done = self._executor.submit(extra, *args, step)
        except BrokenProcessPool:  # it stopped before this job, e.g. after start()
            self._draw_here_instead()
            done = self._executor.submit(extra, *args, step)
        self._pending.append((step, walltime, done, extra, args))

    @property
    def pending(self) -> int:
        """Extras submitted and not yet written."""
        return len(self._pending)

    def write_finished(self, writer) -> None:
        """Write the summaries of the extras finished so far, oldest first; an extra that
        failed raises its error here."""
        while self._pending and self._pending[0][2].done():
            self._write(writer, *self._pending.pop(0))

    def close(self, writer, wait: bool = True) -> int:
        """Stop the helper: write what is pending (wait=True) or drop what is not done yet;
        returns how many extras were dropped."""
        dropped = 0
        for job in self._pending:
            if wait or (job[2].done() and job[2].exception() is None):
                self._write(writer, *job)
            else:
                dropped += not job[2].done()
        self._pending.clear()
        self._executor.shutdown(wait=wait, cancel_futures=True)
        return dropped

    def _write(self, writer, step: int, walltime: float, done: Future, extra: Callable,
               args: tuple) -> None:
        try:
            summaries = done.result()
        except BrokenProcessPool:
            self._draw_here_instead()
            summaries = extra(*args, step)
        for serialized in summaries:
            writer.file_writer.add_summary(Summary.FromString(serialized), step, walltime)

    def _draw_here_instead(self) -> None:
        """The helper process stopped, e.g. in a script that calls train() without `if __name__
        == "__main__":`, which the spawned helper imports again: draw in this process instead
        (once; later jobs find the thread in place)."""
        if isinstance(self._executor, ProcessPoolExecutor):
            log.warning("the process drawing the evaluation figures stopped (a script that "
                        "calls train() needs `if __name__ == '__main__':`); drawing them in the "
                        "training process instead")
            self._executor.shutdown(wait=False, cancel_futures=True)
            self._executor = ThreadPoolExecutor(1, thread_name_prefix="tinylm-extras")


# ------------------------------------------------------------------------------ the extras


def image_summary(tag: str, image: np.ndarray) -> bytes:
    """A serialized TensorBoard image Summary of an RGB uint8 array (H, W, 3): the bytes that
    SummaryWriter.add_image(tag, image, dataformats="HWC") writes."""
    height, width, channels = image.shape
    png = io.BytesIO()
    Image.fromarray(image).save(png, format="PNG")
    picture = Summary.Image(height=height, width=width, colorspace=channels,
                            encoded_image_string=png.getvalue())
    return Summary(value=[Summary.Value(tag=tag, image=picture)]).SerializeToString()


@lru_cache(maxsize=4)  # a run captures the same probe prompt each time: one layout serves all
def _attention_grids(tokens: tuple[str, ...], n_head: int):
    from tinylm.inspection.figures import AttentionGridImages  # matplotlib: in the helper only

    return AttentionGridImages(tokens)


def lay_out_attention_grid(tokens: list[str], n_head: int) -> None:
    """Lay out the figure attention_grid_summaries draws for `tokens` (most of a first draw's
    time), so that the first evaluation's figures take only the rest."""
    _attention_grids(tuple(tokens), n_head)(np.zeros((n_head, len(tokens), len(tokens)),
                                                     dtype=np.float32))


def attention_grid_summaries(weights: np.ndarray, tokens: list[str], step: int) -> list[bytes]:
    """`attention/layer_NN`: every head of each layer; weights (n_layer, n_head, T, T)."""
    grids = _attention_grids(tuple(tokens), weights.shape[1])
    return [image_summary(f"attention/layer_{layer:02d}", grids(w, f"layer {layer}, step {step}"))
            for layer, w in enumerate(weights)]


def layer_head_summaries(tag: str, values: np.ndarray, title: str, label: str,
                         step: int) -> list[bytes]:
    """`tag`: a (n_layer, n_head) table of per-head numbers as a heatmap."""
    from tinylm.inspection.figures import figure_to_image, layer_head_heatmap  # matplotlib

    return [image_summary(tag, figure_to_image(layer_head_heatmap(values, title, label)))]
