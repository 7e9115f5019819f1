"""Same as the tinylm-explain command: `python scripts/explain.py causal=true`."""

from tinylm.cli.explain import main

if __name__ == "__main__":
    main()
