"""The "tinylm attention" TensorBoard tab: hover a word, see where each head looks.

`summary.attention_summary` turns one inspected text into a TensorBoard summary tagged with the
plugin's name; `plugin.AttentionPlugin` (registered through the `tensorboard_plugins` entry
point, so a plain `tensorboard --logdir <run dir>` finds it) serves those summaries and the
ES module in static/ that draws the tab.
"""

PLUGIN_NAME = "tinylm_attention"
