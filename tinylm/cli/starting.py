"""Imported first by every tinylm-* command, before torch and Hydra (a second or two of imports):
Ctrl-C or SIGTERM meanwhile ends it in one line with the shell's status, not a traceback, until
the command's own handlers (tinylm.train.runtime.STOP) take over. Only where a command starts (its
console script, python -m, scripts/): a test or a notebook importing tinylm.cli keeps its signals.
"""

import os
import signal
import sys


def stopped_while_starting(signum: int, frame: object) -> None:
    """One line, the shell's status, and out at once: an exception raised into torch's import
    would leave it half made, and its teardown at exit can then abort."""
    prog = os.path.basename(sys.argv[0])
    sys.stderr.write(f"\n{prog if prog.startswith('tinylm-') else 'tinylm'}: interrupted\n")
    sys.stderr.flush()
    os._exit(128 + signum)


if os.path.basename(sys.argv[0]).startswith("tinylm-") or sys.argv[0] == "-m" or \
        os.path.basename(os.path.dirname(os.path.abspath(sys.argv[0]))) == "scripts":
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, stopped_while_starting)
