"""Take docs/teaching.md's screenshots of the attention tab on a trained run.

    python scripts/tab_screenshots.py runs/<date>/<time>            # into docs/
    python scripts/tab_screenshots.py runs/<date>/<time> --out shots

On a copy of the run (its checkpoints and training logs; the run itself is not written), it runs
tinylm-probe with activation patching and tinylm-generate inspect=true on the lesson's texts, then
the browser test that walks through every view a class sees
(tests/test_tensorboard_plugin.py::test_a_class_sees_every_view_named_with_its_legends_and_one_pair_picker)
over that logdir, which saves each view as a PNG of at most 150 KB: tab-landing.png,
tab-pronoun.png (also as attention-tab.png, the README's picture), tab-all-heads.png,
tab-patching.png, tab-chance.png, tab-arithmetic.png. Needs Debian's chromium and
chromium-driver, as the browser tests do; about half a minute on 2 cores.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# the lesson's texts: a pronoun of each gender and a name of each before it; "It", a dog
LESSONS = {"1_park": "Lily and Tom went to the park. She",
           "2_dog": "Lily had a dog. It was happy. Tom saw her. She"}
TEST = ("tests/test_tensorboard_plugin.py::"
        "test_a_class_sees_every_view_named_with_its_legends_and_one_pair_picker")


def run(*args: str) -> None:
    print("$", " ".join(args[2:]), flush=True)
    subprocess.run([sys.executable, *args], check=True, cwd=ROOT, stdout=subprocess.DEVNULL)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run", type=Path, help="a trained run directory (runs/<date>/<time>)")
    parser.add_argument("--out", type=Path, default=ROOT / "docs", help="where the PNGs go")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="tinylm-shots-") as tmp:
        copy = Path(tmp) / "run"
        for part in ("checkpoints", "tensorboard"):
            shutil.copytree(args.run / part, copy / part, symlinks=True)
        run("-m", "tinylm.cli.probe", f"checkpoint={copy}", "ablate=mean", "patch=true",
            f"logdir={copy / 'probe' / 'lesson'}")
        for name, prompt in LESSONS.items():
            run("-m", "tinylm.cli.generate", f"checkpoint={copy}", f'prompt="{prompt}"',
                "inspect=true", "max_new_tokens=0", f"logdir={copy / 'inspect' / name}")
        args.out.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, "TINYLM_TAB_LOGDIR": str(copy),
               "TINYLM_TAB_SCREENSHOTS": str(args.out.resolve())}
        subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", TEST],
                       check=True, cwd=ROOT, env=env)
    # the README's and inspecting.md's picture of the tab: a pronoun clicked, a name hovered
    shutil.copyfile(args.out / "tab-pronoun.png", args.out / "attention-tab.png")
    print(f"screenshots in {args.out}")


if __name__ == "__main__":
    main()
