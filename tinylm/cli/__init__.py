"""Thin Hydra entry points behind the tinylm-* console scripts."""
