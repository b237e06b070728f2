"""Corpora and their windows: the windowing rule against a stream built by hand from the tokenizer, every
source (texts, files, JSON lines, a datasets.Dataset, the stdlib), and hostile input (binary and
undecodable files, lone surrogates, empty documents, a 100 MB line, missing files, bad JSON, a file
changed between the scan and the sweep): a counted skip or a clear error, in bounded memory."""

import codecs
import errno
import glob
import json
import os
import tracemalloc
from pathlib import Path

import datasets
import numpy as np
import pytest

import pycircuits_widgets as pcw
from pycircuits_widgets.corpus import Corpus, CorpusError
from pycircuits_widgets.corpus.globs import expand
from pycircuits_widgets.corpus.windows import PIECE_CHARS, pieces, separator_id, tokenizer_identity, window_blocks
from pycircuits_widgets.models import load_pretrained
from pycircuits_widgets.models.corpus import corpus_documents

TEXTS = ["def f(x):\n    return x + 1\n", "", "import os\nprint(os.sep)\n" * 7, "a", "class A:\n    pass\n" * 3]


@pytest.fixture(scope="module")
def tok():
    return load_pretrained("attn-only-2l").tokenizer


@pytest.fixture(scope="module")
def stdlib_docs():
    return corpus_documents("all")


def windows(corpus, tok, seq_len, **kw):
    blocks = list(window_blocks(corpus, tok, seq_len, block=kw.pop("block", 4), **kw))
    return np.concatenate(blocks) if blocks else np.zeros((0, seq_len), np.int64)


def hand_stream(tok, texts):
    stream = []
    for text in texts:
        if text:
            stream += tok.encode(text) + [tok.end_of_text_id]
    return stream


def test_windows_are_the_separated_stream_cut_in_order_with_the_tail_dropped(tok):
    corpus = Corpus.from_texts(TEXTS)
    stream = hand_stream(tok, TEXTS)
    for seq_len in (1, 5, 16):
        n = len(stream) // seq_len
        expected = np.array(stream[:n * seq_len]).reshape(n, seq_len)
        for block in (1, 3, 100):
            assert np.array_equal(windows(corpus, tok, seq_len, block=block), expected)
    assert corpus.documents == 4 and corpus.skipped == {"empty": 1}
    assert separator_id(tok) == tok.end_of_text_id == 0


def test_start_and_stop_give_the_same_windows_as_slicing_the_whole(tok):
    corpus = Corpus.from_texts(TEXTS)
    whole = windows(corpus, tok, 4)
    for start, stop in ((0, 3), (2, 7), (5, None), (0, len(whole) + 5)):
        assert np.array_equal(windows(corpus, tok, 4, start=start, stop=stop), whole[start:stop])
    blocks = list(window_blocks(corpus, tok, 4, block=3, start=2, stop=9))
    assert [len(b) for b in blocks] == [3, 3, 1]  # blocks count from start: shards line up on resume


def test_long_documents_are_tokenised_in_pieces_that_give_the_whole_texts_tokens(tok, stdlib_docs):
    long_docs = sorted(stdlib_docs, key=len)[-2:]
    assert all(len(d) > 2 * PIECE_CHARS for d in long_docs)
    for doc in long_docs:
        parts = list(pieces(doc))
        assert "".join(parts) == doc and max(map(len, parts)) <= PIECE_CHARS and len(parts) > 2
        stream = windows(Corpus.from_texts([doc]), tok, 1, block=10**7)[:, 0].tolist()
        assert stream == tok.encode(doc) + [tok.end_of_text_id]


def test_a_tokenizer_that_adds_a_prefix_adds_it_once_per_document(tok):
    class WithBOS:  # as LLaMA's tokenizer: every encoding starts with BOS
        end_of_text_id = 0

        def encode(self, text):
            return [1] + tok.encode(text)

    doc = "x = 1\n" * (PIECE_CHARS // 3)
    stream = windows(Corpus.from_texts([doc, "y\n"]), WithBOS(), 1, block=10**7)[:, 0].tolist()
    assert stream == [1] + tok.encode(doc) + [0] + [1] + tok.encode("y\n") + [0]


def test_files_from_a_glob_sorted_with_binary_undecodable_and_empty_ones_counted(tmp_path, tok):
    (tmp_path / "b.txt").write_text("second file\n")
    (tmp_path / "a.txt").write_text("first file\n")
    (tmp_path / "c.txt").write_bytes(b"caf\xe9 latin-1\n")
    (tmp_path / "d.bin").write_bytes(b"\x7fELF\x00\x01binary")
    (tmp_path / "e.txt").write_bytes(b"")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "f.txt").write_text("nested\n")
    corpus = Corpus.from_files(str(tmp_path / "**" / "*.*"))
    assert corpus.documents == 3 and dict(corpus.skipped) == {"undecodable": 1, "binary": 1, "empty": 1}
    stream = windows(corpus, tok, 1)[:, 0].tolist()
    assert stream == hand_stream(tok, ["first file\n", "second file\n", "nested\n"])
    assert corpus.fingerprint == Corpus.from_texts(["first file\n", "second file\n", "nested\n"]).fingerprint

    replaced = Corpus.from_files([tmp_path / "c.txt"], errors="replace")
    assert windows(replaced, tok, 1)[:, 0].tolist() == hand_stream(tok, ["caf\ufffd latin-1\n"])
    with pytest.raises(CorpusError, match=r"c\.txt: bytes at offset 3 are not UTF-8"):
        Corpus.from_files(tmp_path / "c.txt", errors="strict").scan()


def test_missing_paths_directories_and_empty_globs_are_refused_by_name(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.txt does not exist"):
        Corpus.from_files(tmp_path / "nope.txt")
    with pytest.raises(CorpusError, match="is a directory; pass a glob"):
        Corpus.from_files(str(tmp_path))
    with pytest.raises(CorpusError, match="no file matches"):
        Corpus.from_files(str(tmp_path / "*.md"))
    with pytest.raises(TypeError, match="expected a path or a glob"):
        Corpus.from_files([3])
    with pytest.raises(ValueError, match="errors must be one of"):
        Corpus.from_texts(["x"], errors="ignore")
    with pytest.raises(TypeError, match="item 1 is a bytes"):
        Corpus.from_texts(["x", b"y"])
    with pytest.raises(TypeError, match="got one str"):
        Corpus.from_texts("just one text")
    (tmp_path / "docs.jsonl").write_text('{"text": "one"}\n')
    for bad in (0, -1, 2.5, "64"):  # -1 read every line as empty: a corpus of no documents, no error
        with pytest.raises(ValueError, match=f"max_line_bytes must be a positive int .bytes., got {bad!r}"):
            Corpus.from_jsonl(tmp_path / "docs.jsonl", max_line_bytes=bad)
    gone = tmp_path / "gone.txt"
    gone.write_text("here when listed\n")
    corpus = Corpus.from_files(gone)
    gone.unlink()
    with pytest.raises(CorpusError, match="gone.txt cannot be read"):
        corpus.scan()


def test_a_100_mb_line_is_read_in_bounded_memory(tmp_path, tok):
    path = tmp_path / "one_line.txt"
    block = ("abcdefghij" * 100_000).encode()  # 1 MB, no whitespace: one word for the pre-tokenizer
    with open(path, "wb") as f:
        f.writelines(block for _ in range(100))
    corpus = Corpus.from_files(path)
    tracemalloc.start()
    try:
        corpus.scan()  # reads (and hashes) all 100 MB
        first = windows(corpus, tok, 64, stop=20)  # tokenises only what 20 windows need
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert corpus.documents == 1 and first.shape == (20, 64)
    assert peak < 16 * 2**20, f"peak Python allocation {peak / 2**20:.1f} MiB for a 100 MB line"
    assert first.reshape(-1).tolist() == tok.encode("abcdefghij" * 200)[:20 * 64]


def test_lone_surrogates_are_undecodable_text(tok):
    texts = ["ok\n", "bad \ud800 text\n"]
    assert dict(Corpus.from_texts(texts).skipped) == {} and Corpus.from_texts(texts).documents == 1
    replaced = windows(Corpus.from_texts(texts, errors="replace"), tok, 1)[:, 0].tolist()
    assert replaced == hand_stream(tok, ["ok\n", "bad \ufffd text\n"])
    with pytest.raises(CorpusError, match="text 1: character 4 is a lone surrogate"):
        Corpus.from_texts(texts, errors="strict").scan()


def test_jsonl_lines_skips_and_refusals(tmp_path, tok):
    path = tmp_path / "docs.jsonl"
    rows = [json.dumps({"text": "first\n", "id": 1}), "", json.dumps({"text": ""}), json.dumps({"text": "x" * 5000}),
            json.dumps({"text": "second\n"})]
    path.write_bytes(("\n".join(rows) + "\n").encode() + b'{"text": "caf\xe9"}\n')
    corpus = Corpus.from_jsonl(path, max_line_bytes=1000)
    assert corpus.documents == 2
    assert dict(corpus.skipped) == {"empty": 2, "too_long": 1, "undecodable": 1}
    assert windows(corpus, tok, 1)[:, 0].tolist() == hand_stream(tok, ["first\n", "second\n"])

    for line, message in (('{"text": 1}', r"bad.jsonl:2: field 'text' is int, expected a string"),
                          ('{"body": "x"}', r"bad.jsonl:2: no field 'text' \(fields: \['body'\]\)"),
                          ("[1, 2]", r"bad.jsonl:2: expected a JSON object"),
                          ("{not json", r"bad.jsonl:2: not a JSON line")):
        bad = tmp_path / "bad.jsonl"
        bad.write_text(json.dumps({"text": "fine"}) + "\n" + line + "\n")
        with pytest.raises(CorpusError, match=message):
            Corpus.from_jsonl(bad).scan()
    with pytest.raises(FileNotFoundError):
        Corpus.from_jsonl(tmp_path / "missing.jsonl")


def test_a_hugging_face_dataset_column(tok):
    ds = datasets.Dataset.from_dict({"content": ["alpha beta\n", "", "gamma\n"], "n": [1, 2, 3]})
    corpus = Corpus.from_dataset(ds, field="content")
    assert corpus.documents == 2 and corpus.fingerprint == Corpus.from_texts(["alpha beta\n", "gamma\n"]).fingerprint
    assert windows(corpus, tok, 1)[:, 0].tolist() == hand_stream(tok, ["alpha beta\n", "gamma\n"])
    with pytest.raises(CorpusError, match=r"no column 'text' \(columns: \['content', 'n'\]\)"):
        Corpus.from_dataset(ds)
    with pytest.raises(CorpusError, match="column 'n' holds int"):
        Corpus.from_dataset(ds, field="n").scan()


def test_a_file_changed_after_the_scan_is_refused(tmp_path, tok):
    path = tmp_path / "doc.txt"
    path.write_text("before\n" * 50)
    corpus = Corpus.from_files(path)
    corpus.scan()
    path.write_text("after!\n" * 50)
    with pytest.raises(CorpusError, match="doc.txt changed since the corpus was scanned"):
        windows(corpus, tok, 4)
    lines = tmp_path / "docs.jsonl"
    lines.write_text(json.dumps({"text": "one\n"}) + "\n")
    corpus = Corpus.from_jsonl(lines)
    corpus.scan()
    lines.write_text(json.dumps({"text": "one\n"}) + "\n" + json.dumps({"text": "two\n"}) + "\n")
    with pytest.raises(CorpusError, match="changed since it was scanned: 1 documents then, more now"):
        windows(corpus, tok, 1)


def test_the_stdlib_corpus_and_the_tokenizer_identity(tok, stdlib_docs):
    corpus = Corpus.python_stdlib()
    assert corpus.documents + sum(corpus.skipped.values()) == len(stdlib_docs)
    assert corpus.fingerprint == Corpus.python_stdlib().fingerprint
    first = windows(corpus, tok, 32, stop=3)
    assert first.reshape(-1).tolist() == hand_stream(tok, stdlib_docs[:1])[:96]
    assert tokenizer_identity(tok) == f"Tokenizer:{tok.fingerprint()}"


def test_fifos_links_and_link_cycles_are_refused_or_counted_never_read_twice_or_waited_on(tmp_path, tok):
    (tmp_path / "docs" / "sub").mkdir(parents=True)
    (tmp_path / "docs" / "a.txt").write_text("first file\n")
    (tmp_path / "docs" / "sub" / "b.txt").write_text("second file\n")
    (tmp_path / "docs" / "sub" / "loop").symlink_to(tmp_path / "docs")  # a directory cycle under **
    (tmp_path / "docs" / "again.txt").symlink_to(tmp_path / "docs" / "a.txt")  # the same file by another name
    (tmp_path / "docs" / "dangling.txt").symlink_to(tmp_path / "nowhere.txt")
    os.mkfifo(tmp_path / "docs" / "pipe.txt")
    corpus = Corpus.from_files(str(tmp_path / "docs" / "**" / "*.txt"))
    assert corpus.documents == 2
    assert dict(corpus.skipped) == {"not_a_file": 2, "duplicate": 1}  # the pipe and the dangling link; again.txt
    stream = windows(corpus, tok, 1)[:, 0].tolist()
    assert stream == hand_stream(tok, ["first file\n", "second file\n"])  # each file once, whatever the cycle holds
    with pytest.raises(CorpusError, match=r"pipe\.txt is a FIFO, not a regular file"):
        Corpus.from_files(tmp_path / "docs" / "pipe.txt")  # refused: its open would wait for a writer forever
    (tmp_path / "self").symlink_to(tmp_path / "self")
    with pytest.raises(CorpusError, match="self is a symbolic-link loop, not a regular file"):
        Corpus.from_files(tmp_path / "self")
    with pytest.raises(CorpusError, match="self is a symbolic-link loop, not a regular file"):
        Corpus.from_jsonl(tmp_path / "self")


def test_jsonl_lines_that_cannot_be_read_are_refused_naming_the_file_and_line(tmp_path, tok):
    path = tmp_path / "docs.jsonl"
    good = json.dumps({"text": "one\n"}) + "\n"
    for line, message in (("[" * 200_000 + "]" * 200_000, "docs.jsonl:2: the JSON nests too deep to read"),
                          ('{"text": "x", "n": ' + "9" * 5000 + "}", (r"docs.jsonl:2: a value on the line cannot be read"
                                                                     r" \(Exceeds the limit"))):
        path.write_text(good + line + "\n")
        with pytest.raises(CorpusError, match=message):
            Corpus.from_jsonl(path).scan()
    # a byte-order mark before the first line (Windows editors write one) is not part of the JSON
    path.write_bytes(codecs.BOM_UTF8 + good.encode())
    corpus = Corpus.from_jsonl(path)
    assert corpus.documents == 1 and windows(corpus, tok, 1)[:, 0].tolist() == hand_stream(tok, ["one\n"])
    # the description names the file, not the folders of the author's machine (a store and a page carry it)
    assert corpus.description == "docs.jsonl ['text']" and str(tmp_path) not in corpus.description


def test_a_read_error_is_refused_naming_the_file_and_line(tmp_path, monkeypatch):
    path, lines = tmp_path / "doc.txt", tmp_path / "docs.jsonl"
    path.write_text("text\n" * 10)
    lines.write_text((json.dumps({"text": "one\n"}) + "\n") * 3)
    corpus, by_line = Corpus.from_files(path), Corpus.from_jsonl(lines)
    real_open = open

    class Failing:
        """A file whose reads fail (EIO, a bad disk) after ``good`` lines."""

        def __init__(self, f, good):
            self.f, self.good = f, good

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

        def read(self, n=-1):
            raise OSError(errno.EIO, "Input/output error")

        def readline(self, n=-1):
            if self.good == 0:
                raise OSError(errno.EIO, "Input/output error")
            self.good -= 1
            return self.f.readline(n)

        def tell(self):
            return 0

    failing = {str(path): 0, str(lines): 2}
    monkeypatch.setattr("builtins.open", lambda p, *a, **k: Failing(real_open(p, *a, **k), failing[str(p)])
                        if str(p) in failing else real_open(p, *a, **k))
    with pytest.raises(CorpusError, match=r"doc\.txt: read error at byte 0 \(Input/output error\)"):
        corpus.scan()
    with pytest.raises(CorpusError, match=r"docs\.jsonl: read error after line 2 \(Input/output error\)"):
        by_line.scan()


def test_a_glob_lists_each_real_folder_once_whatever_links_loop_back(tmp_path, tok, monkeypatch):
    # two links back to the top under ** made glob.glob walk 2**40 paths (one made it read the tree 41 times):
    # every real folder is listed once, links to folders elsewhere are followed, hidden names stay unmatched
    (tmp_path / "docs" / "sub").mkdir(parents=True)
    (tmp_path / "outside").mkdir()
    (tmp_path / "docs" / "a.txt").write_text("first file\n")
    (tmp_path / "docs" / ".hidden.txt").write_text("not matched by *\n")
    (tmp_path / "docs" / "sub" / "b.txt").write_text("second file\n")
    (tmp_path / "outside" / "c.txt").write_text("third file\n")
    for name in ("up1", "up2", "up3"):
        (tmp_path / "docs" / "sub" / name).symlink_to(tmp_path / "docs")
    (tmp_path / "docs" / "ext").symlink_to(tmp_path / "outside")
    listed = []
    scandir = os.scandir

    def counting_scandir(path="."):
        listed.append(os.path.realpath(path))
        if len(listed) > 100:  # the loops' walk would not end: stop it, and fail below
            raise RecursionError("more than 100 folder listings for 3 folders")
        return scandir(path)

    monkeypatch.setattr(os, "scandir", counting_scandir)
    try:
        corpus = Corpus.from_files(str(tmp_path / "docs" / "**" / "*.txt"))
    except RecursionError as err:
        pytest.fail(f"{err}: the glob walks the link cycles")
    monkeypatch.undo()
    assert sorted(listed) == sorted({str(tmp_path / "docs"), str(tmp_path / "docs" / "sub"), str(tmp_path / "outside")})
    assert corpus.documents == 3 and dict(corpus.skipped) == {}
    assert windows(corpus, tok, 1)[:, 0].tolist() == hand_stream(tok, ["first file\n", "third file\n", "second file\n"])
    # without loops the matches are glob's own (this package's tree, hidden files and patterns of each kind)
    package = Path(pcw.__file__).parent
    for pattern in ("**/*.py", "*/__init__.py", "corpus/[gs]*.p?", "**/.*", "**"):
        ours = expand(str(package / pattern))
        assert ours == sorted({p.rstrip(os.sep) for p in glob.glob(str(package / pattern), recursive=True)}), pattern
