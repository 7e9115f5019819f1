"""Same as `tinylm-export`: python scripts/export.py checkpoint=<run> out=exported/my-run
"""

from tinylm.cli.export import main

if __name__ == "__main__":
    main()
