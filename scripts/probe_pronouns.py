"""Same as `tinylm-probe`: python scripts/probe_pronouns.py checkpoint=<run> ablate=true
"""

from tinylm.cli.probe import main

if __name__ == "__main__":
    main()
