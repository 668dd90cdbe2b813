"""The base models' tokenizers, loaded once per test process (an xdist worker) and shared by every
module that reads them (tests/ is on sys.path beside conftest.py). A test that changes a tokenizer
copies it first (``copy.deepcopy``)."""

from __future__ import annotations

import functools
from pathlib import Path


@functools.cache
def tokenizer(model_dir: Path | str):
    """``AutoTokenizer.from_pretrained(model_dir)``, once per process and directory."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir))
