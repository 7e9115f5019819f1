"""tinylm: a tiny from-scratch causal Transformer LM whose attention heads you can inspect."""

__version__ = "0.1.0"
