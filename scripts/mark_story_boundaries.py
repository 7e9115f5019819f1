"""Mark where each story of the shipped TinyStories sample starts, as the raw TinyStories files do.

    python scripts/mark_story_boundaries.py            # rewrites data/corpora/tinystories/*.txt
    python scripts/mark_story_boundaries.py --check    # says what it would mark, changes nothing

The sample holds the first rows of the hub dataset's train and validation splits, one story per
row, written one after the other with a blank line between them; a blank line also separates the
paragraphs inside a story, so the files did not say where a story ends. This script recovers the
boundaries from the text and puts a line holding only <|endoftext|> between two stories (the raw
TinyStories-train.txt's separator), which `data.sample_by=document` reads as the end of one.

A paragraph starts a story when
  1. it opens with "Once" ("Once upon a time", "Once there was", ...);
  2. the paragraph before it ends a story: "The end.", "... happily ever after.", or a moral
     ("The moral of the story is ...");
  3. the paragraph before it stops mid-sentence (a row of the dataset cut off) and this one does
     not go on from it (a quote, "Then", "She", ...);
  4. or it does not go on from the one before, names a character in its first sentence, and none
     of the names of the story so far ("One day, a little girl named Mia ...", "Tom and Sue were
     playing ..."). A name is a capitalised word that occurs inside a sentence and never in lower
     case anywhere in the sample.
Anything else continues the story before it. Rerunning the script on marked files gives the same
files. Update SHA256SUMS and data/corpora/README.md after a change.
"""

from __future__ import annotations

import argparse
import collections
import hashlib
import re
from pathlib import Path

FOLDER = Path(__file__).resolve().parent.parent / "data" / "corpora" / "tinystories"
FILES = ("train-head.txt", "validation-head.txt")
MARK = "<|endoftext|>"

ONCE = re.compile(r"^Once\b")
# the end of a story; the cp1252-decoded quote marks (â€œ ... â€\x9d) are the dataset's own
ENDING = re.compile(r"(The [Ee]nd|happily ever after|[Tt]he moral of (?:the|this) story[^.]*)"
                    r"[.!]?\"?$")
CUT_OFF = re.compile(r"[A-Za-z0-9]\s*$")  # no full stop, quote or colon: the row stopped there
GOES_ON = re.compile(r"^(\"|'|Then\b|Suddenly|But\b|So\b|And\b|Later|Finally|Soon\b|Just\b|"
                     r"Meanwhile|Next\b|Now\b|After\b|When\b|As\b|He\b|She\b|They\b|His\b|"
                     r"Her\b|Their\b|Everyone|All\b|At last|In the end|From then|From that)")


def paragraphs(text: str) -> list[str]:
    """The paragraphs of a file as they are written there, marks removed."""
    text = text.replace(f"\n{MARK}\n", "\n\n").rstrip("\n")
    return [p for p in text.split("\n\n") if p.strip()]


def name_words(texts: list[str]) -> set[str]:
    """Capitalised words seen inside a sentence (after a lower-case word or a comma) and never
    in lower case: the characters' names."""
    text = "\n".join(texts)
    lower = set(re.findall(r"\b[a-z]+\b", text))
    inside = {m.group(1) for m in re.finditer(r"[a-z,] ([A-Z][a-z]+)\b", text)}
    return {w for w in inside if w.lower() not in lower and w != "I"}


def story_starts(paras: list[str], names: set[str]) -> list[int]:
    """The indices of the paragraphs that start a story (0 always does)."""
    def named(p: str) -> set[str]:
        return {w for w in re.findall(r"[A-Z][a-z]+", p) if w in names}

    paras = [p.strip() for p in paras]
    starts, story_names = [0], named(paras[0])
    for i in range(1, len(paras)):
        p, before = paras[i], paras[i - 1]
        first_sentence = re.split(r"(?<=[.!?])\s", p, maxsplit=1)[0]
        goes_on = bool(GOES_ON.match(p))
        start = (ONCE.match(p)
                 or ENDING.search(before.rstrip("\u201d\u009d€â\"' "))
                 or before.startswith("The moral")
                 or (CUT_OFF.search(before) and not goes_on)
                 or (not goes_on and story_names and not named(p) & story_names
                     and named(first_sentence)))
        if start:
            starts.append(i)
            story_names = set()
        story_names |= named(p)
    return starts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="report only; write nothing")
    args = parser.parse_args()
    texts = {name: (FOLDER / name).read_text(encoding="utf-8") for name in FILES}
    paras = {name: paragraphs(text) for name, text in texts.items()}
    names = name_words([p for ps in paras.values() for p in ps])
    for name in FILES:
        ps = paras[name]
        starts = story_starts(ps, names)
        stories = [ps[a:b] for a, b in zip(starts, [*starts[1:], len(ps)], strict=True)]
        out = f"\n{MARK}\n".join("\n\n".join(story) for story in stories) + "\n"
        size = len(out.encode())
        openers = collections.Counter("Once" if s[0].lstrip().startswith("Once") else "other"
                                      for s in stories)
        print(f"{name}: {len(ps):,} paragraphs, {len(stories):,} stories ({openers['Once']:,} "
              f"open with 'Once'), {size:,} bytes, {size / len(stories):,.0f} per story, sha256 "
              f"{hashlib.sha256(out.encode()).hexdigest()}")
        if not args.check:
            (FOLDER / name).write_text(out, encoding="utf-8")


if __name__ == "__main__":
    main()
