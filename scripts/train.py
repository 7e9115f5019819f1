"""Same as `tinylm-train`: python scripts/train.py experiment=shakespeare_char
(and the entry point for torchrun: torchrun --standalone --nproc_per_node=2 scripts/train.py)
"""

from tinylm.cli.train import main

if __name__ == "__main__":
    main()
