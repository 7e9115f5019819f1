"""Training: the loop and what it needs (optimizer, schedule, resume, threads, logs)."""
