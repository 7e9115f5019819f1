"""Same as `tinylm-prepare`: python scripts/prepare.py data=tinyshakespeare tokenizer=char"""

from tinylm.cli.prepare import main

if __name__ == "__main__":
    main()
