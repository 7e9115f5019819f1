"""The "tinylm attention" TensorBoard tab: hover a word, see where each head looks.

summary.py writes what the tab reads as summaries tagged with the plugin names below; plugin.py's
AttentionPlugin (the `tensorboard_plugins` entry point, so a plain `tensorboard --logdir` finds
it) serves them, checked by reading.py, and the ES modules in static/ that draw the tab.
"""

PLUGIN_NAME = "tinylm_attention"
PROBE_PLUGIN_NAME = "tinylm_probe"
# The q, k and v behind a text's weights: not under PLUGIN_NAME, whose every tag is a text
ARITHMETIC_PLUGIN_NAME = "tinylm_arithmetic"
