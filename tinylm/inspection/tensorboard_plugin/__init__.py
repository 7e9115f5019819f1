"""The "tinylm attention" TensorBoard tab: hover a word, see where each head looks.

summary.py writes one inspected text, or one tinylm-probe report, as a summary tagged with a
plugin name below; plugin.py's AttentionPlugin (the `tensorboard_plugins` entry point, so a plain
`tensorboard --logdir` finds it) serves those summaries and the ES module in static/ that draws
the tab.
"""

PLUGIN_NAME = "tinylm_attention"
PROBE_PLUGIN_NAME = "tinylm_probe"
