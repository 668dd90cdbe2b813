"""The ``search`` tool: BM25 (the ``bm25s`` library) over a JSONL corpus of passages.

Each corpus line is ``{"id": ..., "title": ... (optional), "text": ...}``; title and text are
indexed together, lower-cased, English stop words removed, no stemming. The index is built
once per corpus content and cached under ``<cache_dir>/<sha256 of the corpus file>``, written
to a temporary directory and renamed, so a half-written cache is never loaded; a changed
corpus gets a new key.

A job may bring its own corpus (the ``search-qa`` task): its calls carry ``{"corpus": path}``
as context and are answered from that corpus. :class:`CorpusIndexes` keeps the indexes of
the last few such corpora in memory (least recently used dropped first), keyed by path,
size and modification time, so an edited file is indexed again.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import tempfile
import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import bm25s

from marlaas.tasks.base import json_records

logging.getLogger("bm25s").setLevel(logging.WARNING)  # bm25s sets its own logger to DEBUG
MAX_K = 20
STOPWORDS = "en"


class CorpusError(ValueError):
    """A corpus file that is missing or has a malformed line; the message names the line."""


@dataclass(frozen=True)
class Passage:
    id: str
    text: str
    title: str = ""

    def render(self, rank: int) -> str:
        heading = f"[{rank}] {self.title} ({self.id})" if self.title else f"[{rank}] ({self.id})"
        return f"{heading}\n{self.text}"


def read_corpus(path: Path) -> list[Passage]:
    """The passages of a JSONL corpus (blank lines skipped); a bad line raises :class:`CorpusError`."""
    passages = []
    for number, record in json_records(Path(path), "search corpus", CorpusError):
        if not isinstance(record.get("text"), str):
            raise CorpusError(f'{path}:{number}: expected an object with a "text" string')
        passages.append(Passage(id=str(record.get("id", number)), text=record["text"],
                                title=str(record.get("title") or "")))
    if not passages:
        raise CorpusError(f"search corpus {path} has no passages")
    return passages


class SearchIndex:
    """BM25 over one corpus; :meth:`search` returns the best passages for a query."""

    def __init__(self, passages: list[Passage], retriever: bm25s.BM25, from_cache: bool) -> None:
        self.passages = passages
        self.retriever = retriever
        self.from_cache = from_cache  # True when the index was loaded, not built

    @classmethod
    def open(cls, corpus: Path, cache_dir: Path | None = None) -> SearchIndex:
        """Load the corpus; load its index from ``cache_dir`` or build (and cache) it."""
        corpus = Path(corpus)
        passages = read_corpus(corpus)
        if cache_dir is None:
            return cls(passages, _build(passages), from_cache=False)
        digest = hashlib.sha256(corpus.read_bytes()).hexdigest()
        cached = Path(cache_dir) / digest
        if (cached / "params.index.json").is_file():
            return cls(passages, bm25s.BM25.load(cached, show_progress=False), from_cache=True)
        retriever = _build(passages)
        cached.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{digest[:12]}-", dir=cached.parent))
        try:
            retriever.save(staging, show_progress=False)
            os.rename(staging, cached)  # atomic; a concurrent builder may have won: keep theirs
        except OSError:
            if not (cached / "params.index.json").is_file():
                raise
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        return cls(passages, retriever, from_cache=False)

    def search(self, query: str, k: int) -> list[tuple[Passage, float]]:
        """Up to ``k`` passages sharing a term with ``query``, best first, with their scores."""
        tokens = bm25s.tokenize([query], stopwords=STOPWORDS, return_ids=False, show_progress=False)
        if not tokens[0]:
            return []
        k = max(1, min(k, len(self.passages)))
        ids_Q_K, scores_Q_K = self.retriever.retrieve(tokens, k=k, show_progress=False)
        return [(self.passages[int(i)], float(s))
                for i, s in zip(ids_Q_K[0], scores_Q_K[0]) if s > 0]


class CorpusIndexes:
    """Indexes of the corpora jobs bring, the ``capacity`` most recently used kept in memory.

    Safe to use from several threads: a corpus is opened once while other calls wait for it,
    and calls on other corpora go on meanwhile.
    """

    def __init__(self, cache_dir: Path | None, capacity: int = 4) -> None:
        self.cache_dir = cache_dir
        self.capacity = capacity
        self._indexes: OrderedDict[tuple, SearchIndex] = OrderedDict()
        self._opening: dict[tuple, threading.Lock] = {}
        self._lock = threading.Lock()

    def get(self, corpus: str | Path) -> SearchIndex:
        """The index of ``corpus``, opened (and disk-cached) on first use; :class:`CorpusError` if
        the file is missing, unreadable or malformed."""
        path = Path(corpus).expanduser()
        try:
            stat = path.stat()
        except FileNotFoundError:
            raise CorpusError(f"search corpus {path} does not exist") from None
        except OSError as exc:
            raise CorpusError(f"search corpus {path} cannot be read: {exc}") from None
        key = (str(path.resolve()), stat.st_size, stat.st_mtime_ns)
        with self._lock:
            if key in self._indexes:
                self._indexes.move_to_end(key)
                return self._indexes[key]
            opening = self._opening.setdefault(key, threading.Lock())
        with opening:
            with self._lock:
                if key in self._indexes:  # opened by the call this one waited for
                    return self._indexes[key]
            try:
                index = SearchIndex.open(path, self.cache_dir)
            except BaseException:
                with self._lock:
                    self._opening.pop(key, None)
                raise
            with self._lock:
                self._opening.pop(key, None)
                self._indexes[key] = index
                while len(self._indexes) > self.capacity:
                    self._indexes.popitem(last=False)
            return index

    def __len__(self) -> int:
        return len(self._indexes)


def _build(passages: list[Passage]) -> bm25s.BM25:
    texts = [f"{p.title}\n{p.text}" if p.title else p.text for p in passages]
    retriever = bm25s.BM25()
    retriever.index(bm25s.tokenize(texts, stopwords=STOPWORDS, show_progress=False),
                    show_progress=False)
    return retriever


def render_results(query: str, found: list[tuple[Passage, float]]) -> str:
    """Search results as the model reads them: numbered passages, best first."""
    if not found:
        return f"no passage matches {query!r}"
    return "\n\n".join(passage.render(rank) for rank, (passage, _) in enumerate(found, 1))
