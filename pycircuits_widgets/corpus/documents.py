"""A corpus: the documents a sweep reads, from texts, files, JSON lines, a ``datasets.Dataset`` or the
Python stdlib, read in bounded memory, with a count of what was skipped and why.

Every source yields each document as a stream of text chunks (at most ``CHUNK_BYTES`` of input at a
time), so a 100 MB line is never held whole. The first pass over a corpus (``Corpus.scan``, run by its
``fingerprint``) reads everything once, decides each document's fate and hashes what is kept; the
windows pass (``windows.py``) reads the kept documents again, checking each against its hash, so a file
that changed in between is refused rather than swept half old, half new.

Hostile input, per document (counted in ``Corpus.skipped`` by reason, or refused with a ``CorpusError``
naming the file and line):

=================  ==========================================================================
``empty``          no text (an empty file, ``""``, a blank JSON line)
``binary``         a file whose first 8 KiB hold a NUL byte (git's rule for "binary")
``undecodable``    bytes that are not UTF-8, or a text with lone surrogates; with ``errors=``
                   ``"skip"`` (default) the document is skipped, ``"replace"`` keeps it with
                   U+FFFD in place of each bad byte, ``"strict"`` refuses it naming the offset
``too_long``       a JSON line longer than ``max_line_bytes`` (parsing one needs it whole)
``not_a_file``     a glob's match that is no regular file: a FIFO, a socket, a device, a dangling link
``duplicate``      a glob's match that is a file already in the corpus, reached again through a link
=================  ==========================================================================

A path that does not exist, a directory, a FIFO or other non-file, a symbolic-link loop, a glob that
matches nothing, a line that is not a JSON object or lacks the field, nests too deep or holds a number
too long to read, a read error: ``CorpusError`` (or ``FileNotFoundError``) naming the file (and line),
before anything is swept. A JSON-lines file may start with a UTF-8 byte-order mark.
"""

from __future__ import annotations

import codecs
import errno
import glob as globbing
import hashlib
import json
import os
import re
import stat
from array import array
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from .arguments import check_positive
from .globs import expand

CHUNK_BYTES = 1 << 20
"""Most bytes of input read (and characters yielded) at a time."""
BINARY_PROBE = 8192
"""A file with a NUL byte in its first ``BINARY_PROBE`` bytes is binary."""
ERRORS = ("skip", "replace", "strict")
_SURROGATE = re.compile("[\ud800-\udfff]")


class CorpusError(ValueError):
    """A corpus that cannot be read as asked (the message names the file, line and what was expected)."""


class Skip(Exception):
    """Raised by a document's chunk stream: the document is skipped for ``reason`` (a ``skipped`` key)."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


@dataclass(frozen=True)
class Document:
    """One document: ``name`` (for messages) and ``chunks()``, a fresh stream of its text each call."""

    name: str
    chunks: Callable[[], Iterator[str]]


def _check_errors(errors: str) -> str:
    if errors not in ERRORS:
        raise ValueError(f"errors must be one of {ERRORS}, got {errors!r}")
    return errors


def _decode_stream(blocks: Iterator[bytes], name: str, errors: str) -> Iterator[str]:
    """UTF-8 text of ``blocks`` chunk by chunk; bad bytes per ``errors`` (module docstring)."""
    decoder = codecs.getincrementaldecoder("utf-8")("replace" if errors == "replace" else "strict")
    offset = 0
    for block in blocks:
        try:
            text = decoder.decode(block)
        except UnicodeDecodeError as err:
            if errors == "skip":
                raise Skip("undecodable") from None
            raise CorpusError(f"{name}: bytes at offset {offset + err.start} are not UTF-8 ({err.reason}); pass "
                              "errors='skip' to skip such documents or errors='replace' to keep them with U+FFFD") from None
        offset += len(block)
        if text:
            yield text
    try:
        tail = decoder.decode(b"", final=True)
    except UnicodeDecodeError:
        if errors == "skip":
            raise Skip("undecodable") from None
        raise CorpusError(f"{name}: the file ends inside a UTF-8 character (offset {offset}); pass errors='skip' "
                          "or errors='replace'") from None
    if tail:
        yield tail


def _text_chunks(text: str, name: str, errors: str) -> Iterator[str]:
    """``text`` in slices of ``CHUNK_BYTES`` characters; lone surrogates (not text: no UTF-8 form) per ``errors``."""
    surrogate = None if text.isascii() else _SURROGATE.search(text)
    if surrogate is not None:
        if errors == "skip":
            raise Skip("undecodable")
        if errors == "strict":
            raise CorpusError(f"{name}: character {surrogate.start()} is a lone surrogate ({surrogate.group()!r}), "
                              "which is not text; pass errors='skip' or errors='replace'")
        text = _SURROGATE.sub("\ufffd", text)
    for start in range(0, len(text), CHUNK_BYTES):
        yield text[start:start + CHUNK_BYTES]


def _file_blocks(path: Path) -> Iterator[bytes]:
    kind = _kind(path)
    if kind not in ("file", "missing"):  # (checked again: a FIFO's open would block until a writer came)
        raise CorpusError(f"{path} is no longer a regular file ({kind}); build the Corpus again")
    try:
        f = open(path, "rb")  # noqa: SIM115 (entered below: only the open's own error is the corpus's to name)
    except OSError as err:
        raise CorpusError(f"{path} cannot be read ({err.strerror or err})") from None
    with f:
        try:
            head = f.read(BINARY_PROBE)
            if b"\0" in head:
                raise Skip("binary")
            if head:
                yield head
            while block := f.read(CHUNK_BYTES):
                yield block
        except OSError as err:
            raise CorpusError(f"{path}: read error at byte {f.tell()} ({err.strerror or err})") from None


def _kind(path: Path) -> str:
    """``"file"`` for a regular file (through links), else what ``path`` is, for a message or a skip."""
    try:
        mode = os.stat(path).st_mode
    except OSError as err:
        if err.errno == errno.ELOOP:
            return "a symbolic-link loop"
        return "a dangling link" if os.path.islink(path) else "missing"
    if stat.S_ISREG(mode):
        return "file"
    if stat.S_ISDIR(mode):
        return "a directory"
    return "a FIFO" if stat.S_ISFIFO(mode) else "a socket" if stat.S_ISSOCK(mode) else "a device or other non-file"


def _file_document(path: Path, errors: str) -> Document:
    return Document(str(path), lambda: _decode_stream(_file_blocks(path), str(path), errors))


def _expand(paths_or_glob) -> tuple[list[Path], Counter]:
    """Files named by a path, a glob or a list of them: globs sorted (``globs.expand``: each real folder
    listed once, whatever links loop back), each file once (the first path that reaches it, links
    followed), in order; and what the globs matched and left out (``skipped`` reasons)."""
    items = [paths_or_glob] if isinstance(paths_or_glob, (str, Path)) else paths_or_glob
    try:
        items = list(items)
    except TypeError:
        raise TypeError("from_files takes a path, a glob or a list of them, got "
                        f"{type(paths_or_glob).__name__}") from None
    files: dict[tuple[int, int], Path] = {}  # (device, inode) -> the first path to it
    skipped: Counter = Counter()
    for item in items:
        if not isinstance(item, (str, Path)):
            raise TypeError(f"from_files: {item!r} is a {type(item).__name__}, expected a path or a glob (str)")
        if isinstance(item, str) and globbing.has_magic(item):
            matched = [(Path(p), _kind(Path(p))) for p in expand(item)]
            found = [path for path, kind in matched if kind == "file"]
            if not found:
                raise CorpusError(f"from_files: no file matches {item!r}")
            others = sum(kind not in ("file", "a directory") for _, kind in matched)
            if others:
                skipped["not_a_file"] += others
        else:
            path, kind = Path(item), _kind(Path(item))
            if kind == "missing":
                raise FileNotFoundError(f"from_files: {path} does not exist")
            if kind == "a directory":
                raise CorpusError(f"from_files: {path} is a directory; pass a glob such as '{path}/**/*.txt'")
            if kind != "file":
                raise CorpusError(f"from_files: {path} is {kind}, not a regular file")
            found = [path]
        for path in found:
            st = os.stat(path)
            if (st.st_dev, st.st_ino) not in files:
                files[st.st_dev, st.st_ino] = path
            elif path != files[st.st_dev, st.st_ino]:  # (the same path given twice is no duplicate document)
                skipped["duplicate"] += 1
    return list(files.values()), skipped


def _jsonl_documents(path: Path, field: str, errors: str, max_line_bytes: int) -> Iterator[Document]:
    """One document per line of ``path``: the string at ``field`` of the line's JSON object."""
    number = 0
    try:
        with open(path, "rb") as f:
            for number, line in enumerate(iter(lambda: f.readline(max_line_bytes + 1), b""), 1):
                yield _jsonl_line(f, line, number, f"{path}:{number}", field, errors, max_line_bytes)
    except OSError as err:
        raise CorpusError(f"{path}: read error after line {number} ({err.strerror or err})") from None


def _jsonl_line(f, line: bytes, number: int, where: str, field: str, errors: str, max_line_bytes: int) -> Document:
    """The document of one JSON line read from ``f`` (``_jsonl_documents``; a too long line's rest is read
    from ``f`` in bounded pieces and dropped)."""
    if number == 1 and line.startswith(codecs.BOM_UTF8):
        line = line[len(codecs.BOM_UTF8):]
    if len(line) > max_line_bytes and not line.endswith(b"\n"):
        while (rest := f.readline(CHUNK_BYTES)) and not rest.endswith(b"\n"):
            pass
        return Document(where, _raise(Skip("too_long")))
    if not line.strip():
        return Document(where, _raise(Skip("empty")))
    try:
        text = line.decode("utf-8", "replace" if errors == "replace" else "strict")
    except UnicodeDecodeError as err:
        if errors == "skip":
            return Document(where, _raise(Skip("undecodable")))
        raise CorpusError(f"{where}: byte {err.start} of the line is not UTF-8; pass errors='skip' or "
                          "errors='replace'") from None
    try:
        row = json.loads(text)
    except json.JSONDecodeError as err:
        raise CorpusError(f"{where}: not a JSON line ({err.msg} at column {err.colno})") from None
    except RecursionError:
        raise CorpusError(f"{where}: the JSON nests too deep to read") from None
    except ValueError as err:  # e.g. an integer longer than Python reads (sys.get_int_max_str_digits)
        raise CorpusError(f"{where}: a value on the line cannot be read ({err})") from None
    return Document(where, _field_text(row, field, where, errors))


def _field_text(row, field: str, where: str, errors: str) -> Callable[[], Iterator[str]]:
    if not isinstance(row, dict):
        raise CorpusError(f"{where}: expected a JSON object with a {field!r} field, got {type(row).__name__}")
    if field not in row:
        raise CorpusError(f"{where}: no field {field!r} (fields: {sorted(row)[:10]}); pass field=...")
    text = row[field]
    if not isinstance(text, str):
        raise CorpusError(f"{where}: field {field!r} is {type(text).__name__}, expected a string")
    return lambda: _text_chunks(text, where, errors)


def _raise(skip: Skip) -> Callable[[], Iterator[str]]:
    def chunks():
        raise skip
        yield  # a generator: the skip is raised when read, like any other document's

    return chunks


def _text_documents(texts: list[str], errors: str, prefix: str = "text") -> Iterator[Document]:
    for i, text in enumerate(texts):
        yield Document(f"{prefix} {i}", (lambda t=text, n=f"{prefix} {i}": _text_chunks(t, n, errors)))


def _dataset_documents(dataset, field: str, errors: str) -> Iterator[Document]:
    rows = dataset.iter(batch_size=256) if hasattr(dataset, "iter") else None
    i = 0
    if rows is not None:
        for batch in rows:
            for text in batch[field]:
                yield _dataset_row(text, f"row {i}", field, errors)
                i += 1
        return
    for row in dataset:
        yield _dataset_row(row[field], f"row {i}", field, errors)
        i += 1


def _dataset_row(text, where: str, field: str, errors: str) -> Document:
    if not isinstance(text, str):
        raise CorpusError(f"dataset {where}: column {field!r} holds {type(text).__name__}, expected strings")
    return Document(where, lambda: _text_chunks(text, where, errors))


class Corpus:
    """The documents a sweep reads, in a fixed order (module docstring). Build one with a classmethod:
    ``from_texts``, ``from_files``, ``from_jsonl``, ``from_dataset`` or ``python_stdlib``.

    ``fingerprint`` (sha256 of the kept documents' own sha256s, in order), ``documents`` (how many were
    kept) and ``skipped`` (``{reason: count}``) come from one pass over the corpus, run on first use."""

    def __init__(self, documents: Callable[[], Iterator[Document]], description: str, skipped: Counter | None = None):
        self._documents = documents
        self.description = description
        self._found_skipped = Counter(skipped)  # what the source left out before any document (``_expand``)
        # per document: the first 8 bytes of its sha256 (0: skipped), 8 bytes a document whatever its size
        self._digests: array | None = None
        self.skipped: Counter = Counter()
        self._fingerprint: str | None = None

    # --- sources --------------------------------------------------------------------------------
    @classmethod
    def from_texts(cls, texts, *, errors: str = "skip") -> Corpus:
        """Documents from a list of strings (kept in memory, in order)."""
        if isinstance(texts, str):
            raise TypeError("from_texts takes a list of strings (one per document), got one str; wrap it: [text]")
        texts = list(texts)
        for i, text in enumerate(texts):
            if not isinstance(text, str):
                raise TypeError(f"from_texts: item {i} is a {type(text).__name__}, expected str")
        errors = _check_errors(errors)
        return cls(lambda: _text_documents(texts, errors), f"{len(texts)} texts")

    @classmethod
    def from_files(cls, paths_or_glob, *, errors: str = "skip") -> Corpus:
        """One document per file: a path, a glob (``"docs/**/*.md"``, expanded now and sorted) or a list of
        them, read as UTF-8 in chunks (a file of any size in bounded memory)."""
        errors = _check_errors(errors)
        files, skipped = _expand(paths_or_glob)
        if not files:
            raise CorpusError("from_files: no files given")
        return cls(lambda: (_file_document(p, errors) for p in files), f"{len(files)} files", skipped)

    @classmethod
    def from_jsonl(cls, path, field: str = "text", *, errors: str = "skip", max_line_bytes: int = 64 << 20) -> Corpus:
        """One document per line of a JSON-lines file: the string at ``field`` of each line's object. Lines
        longer than ``max_line_bytes`` are skipped (``too_long``), never read whole."""
        errors = _check_errors(errors)
        path = Path(path)
        kind = _kind(path)
        if kind == "missing":
            raise FileNotFoundError(f"from_jsonl: {path} does not exist")
        if kind != "file":
            raise CorpusError(f"from_jsonl: {path} is {kind}, not a regular file")
        if not isinstance(field, str):
            raise TypeError(f"from_jsonl: field must be a str, got {type(field).__name__}")
        check_positive("from_jsonl: max_line_bytes", max_line_bytes, "a positive int (bytes)")
        # the file's name, not its path: a store and a saved page must not carry the author's folders
        return cls(lambda: _jsonl_documents(path, field, errors, max_line_bytes), f"{path.name} [{field!r}]")

    @classmethod
    def from_dataset(cls, dataset, field: str = "text", *, errors: str = "skip") -> Corpus:
        """One document per row of a Hugging Face ``datasets.Dataset`` (or ``IterableDataset``): its
        ``field`` column, in the dataset's order. ``datasets`` is not a dependency; any re-iterable object
        with ``column_names`` whose rows are dicts works."""
        errors = _check_errors(errors)
        columns = getattr(dataset, "column_names", None)
        if columns is None:
            raise TypeError(f"from_dataset takes a datasets.Dataset (with column_names), got {type(dataset).__name__}")
        if field not in columns:
            raise CorpusError(f"from_dataset: no column {field!r} (columns: {list(columns)}); pass field=...")
        return cls(lambda: _dataset_documents(dataset, field, errors), f"dataset [{field!r}]")

    @classmethod
    def python_stdlib(cls) -> Corpus:
        """The corpus every machine has: CPython's pydoc topics and stdlib sources
        (``models.corpus.corpus_documents``, the shipped models' training corpus, same order)."""
        from ..models.corpus import corpus_documents

        texts = corpus_documents("all")
        return cls(lambda: _text_documents(texts, "replace", "stdlib document"), "python_stdlib")

    # --- the first pass -----------------------------------------------------------------------------
    def scan(self) -> None:
        """Read every document once: hash the kept ones and count the skipped (module docstring)."""
        if self._digests is not None:
            return
        digests, skipped, whole = array("Q"), Counter(self._found_skipped), hashlib.sha256()
        for doc in self._documents():
            digest = document_digest(doc)
            if isinstance(digest, str):
                skipped[digest] += 1
                digests.append(0)
                continue
            digests.append(short_digest(digest))
            whole.update(digest)
        self._digests, self.skipped, self._fingerprint = digests, skipped, whole.hexdigest()

    @property
    def fingerprint(self) -> str:
        """sha256 (hex) over the kept documents' sha256s in order: the corpus as swept."""
        self.scan()
        return self._fingerprint

    @property
    def documents(self) -> int:
        """How many documents are kept (after the skips)."""
        self.scan()
        return len(self._digests) - self._digests.count(0)

    def kept(self) -> Iterator[tuple[Document, int]]:
        """Each kept document with its ``short_digest`` from the scan (``windows.py`` checks it as it reads)."""
        self.scan()
        n = 0
        for n, doc in enumerate(self._documents(), 1):
            if n > len(self._digests):
                break
            if self._digests[n - 1]:
                yield doc, self._digests[n - 1]
        if n != len(self._digests):
            raise CorpusError(f"the corpus changed since it was scanned: {len(self._digests)} documents then, "
                              f"{'more' if n > len(self._digests) else n} now; build the Corpus again")

    def __repr__(self) -> str:
        state = "" if self._digests is None else f", {self.documents} documents, skipped {dict(self.skipped)}"
        return f"Corpus({self.description}{state})"


def document_digest(doc: Document) -> bytes | str:
    """sha256 of the document's UTF-8 text, or the reason it is skipped (``"empty"`` when it has no text)."""
    h, n = hashlib.sha256(), 0
    try:
        for chunk in doc.chunks():
            data = chunk.encode("utf-8")
            h.update(data)
            n += len(data)
    except Skip as skip:
        return skip.reason
    return h.digest() if n else "empty"


def short_digest(digest: bytes) -> int:
    """The first 8 bytes of a sha256 as a nonzero integer (0 marks a skipped document)."""
    return int.from_bytes(digest[:8], "little") or 1
