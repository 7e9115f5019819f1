"""AttentionGridImages: the pixels of a fresh attention grid, drawing only what changes; figures
saved whole, in the format the path names; an image logged as one PNG; an event file the disk
refuses raised once."""

import io
import threading

import numpy as np
import pytest
from conftest import fill_disk
from helpers import causal_weights
from PIL import Image
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from tinylm.inspection.figures import (
    AttentionGridImages,
    attention_grid_figure,
    event_writer,
    figure_to_image,
    layer_head_heatmap,
    log_image,
    save_figure,
)


@pytest.mark.slow
@pytest.mark.parametrize(("n_head", "t", "max_labels", "highlight"), [
    (4, 6, 32, ()),
    (3, 12, 5, (7,)),  # 1 token in 3 labelled, a red pronoun, an empty fourth panel
])
def test_every_layer_and_title_gives_the_pixels_of_a_fresh_figure(n_head, t, max_labels,
                                                                  highlight):
    tokens = [f"tok{i}" for i in range(t)]
    grids = AttentionGridImages(tokens, max_labels=max_labels, highlight=highlight)
    # titles of other lengths than the first, whose layout the later images keep
    for seed, title in enumerate(["layer 0, step 0", "layer 1, step 250", "layer 12, step 10000",
                                  ""]):
        weights = causal_weights(seed, (n_head, t, t))
        fresh = figure_to_image(attention_grid_figure(weights, tokens, title, max_labels,
                                                      highlight)[0])
        assert np.array_equal(grids(weights, title), fresh), title


def test_a_heatmap_centred_on_a_baseline_marks_it_on_its_colour_bar():
    accuracy = np.array([[0.39, 0.56], [0.5, 0.44]])
    fig = layer_head_heatmap(accuracy, "accuracy", "accuracy", center=0.5)
    _, bar = fig.axes
    (line,) = bar.get_lines()
    assert list(line.get_ydata()) == [0.5, 0.5] and line.get_linestyle() == "--"
    assert 0.5 in bar.get_yticks()
    low, high = bar.get_ylim()
    assert low < 0.39 and high > 0.56 and high - 0.5 == pytest.approx(0.5 - low)
    plain = layer_head_heatmap(accuracy)  # no baseline: no line
    assert not plain.axes[1].get_lines()


def test_weights_of_another_shape_are_refused():
    tokens = ["a", "b", "c"]
    grids = AttentionGridImages(tokens)
    grids(causal_weights(0, (2, 3, 3)))
    with pytest.raises(ValueError, match="must have 2 heads"):
        grids(causal_weights(0, (4, 3, 3)))
    with pytest.raises(ValueError, match="T=3 tokens"):
        grids(causal_weights(0, (2, 4, 4)))


@pytest.mark.slow
def test_a_saved_figure_takes_the_format_its_suffix_names_and_leaves_no_temporary_file(tmp_path):
    fig, _, _ = attention_grid_figure(causal_weights(0, (2, 4, 4)), list("abcd"), "t", 8, ())
    starts = {"a.png": b"\x89PNG", "b.svg": b"<?xml", "c": b"\x89PNG"}  # no suffix: PNG
    for name, start in starts.items():
        assert save_figure(fig, tmp_path / "figs" / name) == tmp_path / "figs" / name
        assert (tmp_path / "figs" / name).read_bytes().startswith(start), name
    assert sorted(p.name for p in (tmp_path / "figs").iterdir()) == sorted(starts)


def test_a_logged_image_is_the_same_png_in_tensorboard_and_on_disk(tmp_path):
    image = np.random.default_rng(0).integers(0, 256, (5, 7, 3), dtype=np.uint8)
    with event_writer(tmp_path) as writer:
        log_image(writer, "attention/layer_00/all_heads", image, 3, png_dir=tmp_path)
    events = EventAccumulator(str(tmp_path), size_guidance={"images": 0})
    events.Reload()
    (logged,) = events.Images("attention/layer_00/all_heads")
    assert logged.step == 3 and (logged.width, logged.height) == (7, 5)
    png = (tmp_path / "attention" / "layer_00" / "all_heads.png").read_bytes()
    assert logged.encoded_image_string == png
    assert np.array_equal(np.asarray(Image.open(io.BytesIO(png))), image)


def test_an_event_file_the_disk_refuses_is_raised_once_without_the_threads_traceback(
        small_disk, monkeypatch):
    disk = small_disk(64)
    fill_disk(disk)
    printed = []  # what would print a thread's traceback
    monkeypatch.setattr(threading, "excepthook", printed.append)
    with pytest.raises(OSError, match="No space left on device"), \
            event_writer(disk / "tb") as writer:
        writer.add_image("image", np.zeros((64, 64, 3), dtype=np.uint8), 0, dataformats="HWC")
    assert printed == []
    assert threading.excepthook == printed.append  # quiet only while the writer lived
