"""Imported first by every tinylm-* command, before torch and Hydra (their imports take the first
second or two): Ctrl-C or SIGTERM meanwhile ends the command in one line with the shell's status
(130, 143), not a KeyboardInterrupt traceback; nothing was written yet. The command's own
handlers (tinylm.train.runtime.STOP) take over once it starts.

Only where a command starts (its console script, python -m, scripts/): importing tinylm.cli
elsewhere (a test, a notebook) leaves the signals alone.
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
