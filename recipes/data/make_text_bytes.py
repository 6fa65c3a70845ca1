"""Write `text_bytes.bin`: the repository's own text (README and `pdcli/` sources) as byte tokens.

One uint16 token per byte (vocabulary 256), for the `token_file` recipes (`configs/data/token_file.yaml`).
Nothing is downloaded. The committed file is a snapshot made by running this from the repository
root (the sources move on, so running it again gives other bytes of the same kind):

    python recipes/data/make_text_bytes.py
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[2]
NUM_TOKENS = 98_304
"""Enough for a few hundred windows of 64 tokens; small enough to commit (192 KiB)."""


def main() -> None:
    sources = [REPO / "README.md", *sorted((REPO / "pdcli").rglob("*.py"))]
    text = b"".join(path.read_bytes() for path in sources)[:NUM_TOKENS]
    out = Path(__file__).with_name("text_bytes.bin")
    np.frombuffer(text, dtype=np.uint8).astype(np.uint16).tofile(out)
    print(f"{out}: {len(text)} tokens from {len(sources)} files")


if __name__ == "__main__":
    main()
