#!/usr/bin/env python3
"""Draw the architecture picture: docs/architecture.dot -> docs/architecture.svg, with Graphviz's
``dot``. Both files are committed, so the README and the docs page show the picture on the
repository's page, in an editor and on the docs site alike, with nothing drawn at a build.

    scripts/draw-architecture.py          # redraw the SVG after editing the .dot file
    scripts/draw-architecture.py --check  # exit 1 if the SVG was drawn from another source

The SVG records the sha256 of the source it was drawn from in an XML comment;
tests/unit/test_draw_architecture.py compares it with the .dot file's, so a source changed
without a redraw fails the suite (the test starts no process: it needs no Graphviz).
"""

from __future__ import annotations

import argparse
import hashlib
import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOURCE = ROOT / "docs" / "architecture.dot"
PICTURE = ROOT / "docs" / "architecture.svg"
STAMP = "<!-- drawn from docs/architecture.dot by scripts/draw-architecture.py; source sha256 {} -->"
STAMPED = re.compile(r"<!-- drawn from docs/architecture\.dot by scripts/draw-architecture\.py; "
                     r"source sha256 ([0-9a-f]{64}) -->")


def source_sha256(source: bytes) -> str:
    return hashlib.sha256(source).hexdigest()


def recorded_sha256(svg: str) -> str | None:
    """The sha256 of the source an SVG was drawn from, as its stamp records it (None: no stamp)."""
    found = STAMPED.search(svg)
    return found[1] if found else None


def draw(source: bytes) -> str:
    """The SVG of a Graphviz source, stamped with that source's sha256 after its XML declaration."""
    dot = shutil.which("dot")
    if dot is None:
        sys.exit("draw-architecture: Graphviz's `dot` is not installed: `apt-get install graphviz` "
                 "(only redrawing needs it; the docs and the tests read the committed SVG)")
    done = subprocess.run([dot, "-Tsvg"], input=source, capture_output=True, timeout=60)
    if done.returncode != 0:
        sys.exit(f"draw-architecture: dot could not draw {SOURCE.name}: {done.stderr.decode().strip()}")
    svg = done.stdout.decode()
    head, sep, rest = svg.partition("?>\n")  # after <?xml ...?>: the declaration must come first
    stamp = STAMP.format(source_sha256(source))
    return f"{head}{sep}{stamp}\n{rest}" if sep else f"{stamp}\n{svg}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="only check that the SVG matches its source")
    args = parser.parse_args()
    source = SOURCE.read_bytes()
    if args.check:
        current = PICTURE.is_file() and recorded_sha256(PICTURE.read_text()) == source_sha256(source)
        if not current:
            print(f"{PICTURE.relative_to(ROOT)} is older than {SOURCE.relative_to(ROOT)}: run {sys.argv[0]}",
                  file=sys.stderr)
        return 0 if current else 1
    PICTURE.write_text(draw(source))
    print(f"drew {PICTURE.relative_to(ROOT)} from {SOURCE.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
