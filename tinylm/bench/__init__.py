"""tinylm-bench: tinylm beside what users would pick instead. Nothing in tinylm imports this."""
