"""Same as `tinylm-bench`: python scripts/bench.py [section=train] [repeats=9] [out=bench.json]"""

from tinylm.cli.bench import main

if __name__ == "__main__":
    main()
