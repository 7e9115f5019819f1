"""Same as `tinylm-generate`: python scripts/generate.py checkpoint=<run> prompt="Once upon a time"
"""

from tinylm.cli.generate import main

if __name__ == "__main__":
    main()
