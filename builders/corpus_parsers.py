r"""The corpus parsers of the instruction set (`python -m builders.instructions`, builders/instruction_set.py
builds and splits it): one task function per task, each reading the documents of the corpus sources it knows.

Tasks (name (split family; corpus source): one real example; long outputs abridged here with "..."):
- `define_word` (dict; wordnet, gcide): 'Define the word "intumescence".', input 'Dictionary: WordNet 3.0'
  -> 'n 1: swelling up with blood or other fluids (as with congestion) [syn: intumescence, intumescency]' +
  '\n2: the increase in volume of certain substances when they are heated (often accompanied by release of
  water) [syn: intumescence, intumescency, swelling]'. WordNet: the entry's sense lines, each sense's lines
  joined without their leading whitespace, senses added while the answer stays within ~300 characters
  (the first always; cut at a sentence or ';' boundary when longer). GCIDE: the entry's first sense
  ('Define the word "Abscond".' -> 'To hide, withdraw, or be concealed.'). The input names the dictionary,
  since the two define the same words differently.
- `which_word` (dict; wordnet, gcide): 'Which word means: searching someone for concealed weapons or illegal
  drugs by having them remove their clothes?' -> 'strip search'. The gloss of the first sense without
  examples, citations or synonym list; only where the answer is unique: WordNet senses whose synonym list
  names no other word, glosses that no other headword of the dictionary has, never one containing its word.
- `define_term` (dict; foldoc): 'Define the computing term "cache".' -> '/kash/ A small fast memory holding
  recently accessed data, designed to speed up subsequent access to the same data. ...' (the entry's
  first paragraph without its <category> tags, cut to ~300 characters at a sentence boundary).
- `which_term` (dict; foldoc): 'Which computing term means: The country code for Luxembourg?' -> 'lu'.
- `manpage_name` (man; manpages_en): 'What does the `ldd` command do?' -> 'print shared object dependencies'
  (the NAME line's description; function pages are asked 'What does the `acct` function do?', file and
  overview pages 'What is the `proc` man page about?').
- `manpage_option` (man; manpages_en): 'What does the `-v, --verbose` option of `ldd` do?' -> 'Print all
  information, including, for example, symbol versioning information.' (the paragraph under that option
  line in OPTIONS). Small: only 10 pages of this corpus (sections 1 and 8) have an OPTIONS section.
- `python_docstring` (python; cpython311_stdlib): 'Write the docstring of the Python function `POP3.top`.',
  input 'def top(self, which, howmuch):' -> "Retrieve message header of message number 'which'\nand first
  'howmuch' lines of message body. ..." (ast.get_docstring; the signature is ast.unparse of the arguments).
- `python_function_for_doc` (python; cpython311_stdlib): 'Which function or method of the Python 3.11
  standard library has this docstring? ...', input 'Add together all the stats for two profile entries.'
  -> 'add_func_stats'. The corpus documents carry no file path, so a function's module is unknown: names
  are qualified inside their file (`func`, `Class.method`), and docstrings that several names share are
  dropped. Both python tasks: top-level functions and methods of top-level classes, docstrings of 20..600
  characters, files that ast cannot parse skipped.
- `wiki_title_paragraph` (wiki; enwiki_gensim): 'Write the first paragraph of the Wikipedia article
  "Anarchism".' -> 'Anarchism is a political philosophy that advocates self-governed societies based on
  voluntary institutions. ...' (the title is the document's first line; the lead is one of the next six
  lines that has >= 80 characters, ends a sentence and names the title, preferring one that has the title
  as its subject, which passes over image captions; cut to ~600 characters at a sentence boundary;
  disambiguation pages skipped). At most one per article (106 articles).
- `bible_verse` (bible; kjv_bible): 'Quote Genesis 1:3 (KJV).' -> 'And God said, Let there be light: and
  there was light.' (a chapter starts with a '<Book> <chapter>' line; each verse is a '<n> <text>' line).
"""
import ast
import re
from typing import Callable, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple

DEFINITION_CHARS = 300
PARAGRAPH_CHARS = 600
DOCSTRING_CHARS = (20, 600)

# corpus source -> its shard under the corpora directory
SHARDS = {
    "wordnet": "reference_en/wordnet.jsonl.gz",
    "gcide": "reference_en/gcide.jsonl.gz",
    "foldoc": "reference_en/foldoc.jsonl.gz",
    "enwiki_gensim": "reference_en/enwiki_gensim.jsonl.gz",
    "manpages_en": "techdocs_en/manpages_en.jsonl.gz",
    "cpython311_stdlib": "code/cpython311_stdlib.jsonl.gz",
    "kjv_bible": "books_en/kjv_bible.jsonl.gz",
}
DICTIONARY_NAMES = {"wordnet": "WordNet 3.0", "gcide": "GCIDE (Webster 1913 and additions)", "foldoc": "FOLDOC"}

Doc = dict  # {"text", "source", "id"}
Sample = dict  # the output fields, plus "_check": the copied text that must occur in the document


def normalize(text: str) -> str:
    """Whitespace runs collapsed to one space: how copied text is compared with its document."""
    return " ".join(text.split())


def _sample(task: str, doc: Doc, entry: str, instruction: str, output: str, input: str = "",
            check: Optional[str] = None) -> Sample:
    return {"instruction": instruction, "input": input, "output": output, "task": task, "source": doc["source"],
            "entry": entry, "id": doc["id"], "_check": output if check is None else check}


_SENTENCE_END = re.compile(r"[.!?][\"')\]]*(?=\s|$)")
_CLAUSE_END = re.compile(r"[.!?;][\"')\]]*(?=\s|$)")
_ABBREVIATIONS = {"e.g.", "i.e.", "cf.", "vs.", "viz.", "etc.", "mr.", "mrs.", "dr.", "st.", "no.", "fig.",
                  "approx.", "ca.", "jr.", "sr.", "inc.", "ltd.", "co.", "vol.", "esp.", "obs."}


def _is_boundary(text: str, end: int) -> bool:
    """Whether a match of a boundary pattern ending at `end` ends a sentence: not after an abbreviation or an
    initial ('e.g.', 'J.', 'U.S.'), and not followed by a lower-case word."""
    token = text[:end].split()[-1].strip("\"')]").casefold()
    if token in _ABBREVIATIONS or re.fullmatch(r"(?:\w\.)+", token):
        return False
    rest = text[end:].lstrip()
    return not rest or not rest[0].islower()


def clip(text: str, limit: int, boundary: re.Pattern = _SENTENCE_END) -> str:
    """`text` if it fits in `limit` characters, else its longest prefix that ends at a boundary and fits, else
    its shortest prefix that ends at one (else all of it); a trailing ';' or ',' is dropped."""
    if len(text) <= limit:
        return text
    ends = [m.end() for m in boundary.finditer(text) if m.group()[0] == ";" or _is_boundary(text, m.end())]
    fitting = [e for e in ends if e <= limit]
    cut = fitting[-1] if fitting else next(iter(ends), len(text))
    return text[:cut].rstrip(";, ")


def _mentions(text: str, word: str) -> bool:
    return re.search(r"(?<!\w)" + re.escape(word.casefold()) + r"(?!\w)", text.casefold()) is not None


# ----------------------------------------------------------------------------------------- dictionaries

_WN_SENSE = re.compile(r"^(?:(?:n|v|adj|adv)\s+)?\d+:\s")
_WN_TAGS = re.compile(r"\s*\[(?:syn|ant|also|see):.*$", re.S)


def wordnet_entries(text: str) -> Iterator[Tuple[str, List[str]]]:
    """(headword, senses) per entry: a headword line at column 0, then indented sense lines ('n 1: ...',
    '2: ...'), each sense's wrapped lines joined with one space."""
    for block in re.split(r"\n\s*\n", text):
        lines = block.split("\n")
        if not lines[0] or lines[0][0].isspace() or len(lines) < 2:
            continue
        senses: List[str] = []
        for line in lines[1:]:
            stripped = line.strip()
            if _WN_SENSE.match(stripped) or not senses:
                senses.append(stripped)
            else:
                senses[-1] += " " + stripped
        yield lines[0].strip(), senses


def wordnet_gloss(sense: str) -> str:
    """The definition of one sense: no 'n 1:' label, examples ('; "...'), or [syn: ...] lists."""
    gloss = _WN_TAGS.sub("", re.sub(r"^(?:(?:n|v|adj|adv)\s+)?\d+:\s*", "", sense))
    return re.split(r';\s*"', gloss)[0].strip().rstrip(";")


def wordnet_synonyms(sense: str) -> List[str]:
    m = re.search(r"\[syn:\s*([^\]]*)\]", sense)
    return [s.strip() for s in m.group(1).split(",")] if m else []


_GCIDE_MARKER = re.compile(r"^\s*\[[^\]]*\]\s*$")  # [1913 Webster], [WordNet 1.5], [PJC]
_GCIDE_SOURCE_TAIL = re.compile(r"\s*\[(?:[^\]]*(?:Webster|WordNet|PJC|Century)[^\]]*)\]\s*$")
_GCIDE_SECTION = re.compile(r"^\s+(?:Syn|Note|Usage|Example|Examples):")


def gcide_entries(text: str) -> Iterator[Tuple[str, str]]:
    """(headword, first sense) per entry. An entry starts with a column-0 line after a blank line holding
    'Word \\Pro*nun"ci*a`tion\\, pos. [etymology]'; the header runs on over column-0 lines and, while its
    brackets are open, indented ones. The first sense is the body up to a blank line, a source marker line
    ([1913 Webster]), a Syn:/Note: block or the next numbered sense, without its '1.' label."""
    lines = text.split("\n")
    i, n = 0, len(lines)
    while i < n:
        line = lines[i]
        if not line or line[0].isspace() or "\\" not in line or (i and lines[i - 1].strip()):
            i += 1
            continue
        headword = line.split("\\", 1)[0].strip().rstrip(",")
        header = line
        i += 1
        while i < n and lines[i] and not lines[i][0].isspace():
            header += " " + lines[i]
            i += 1
        while i < n and lines[i].strip() and (header.count("[") > header.count("]")
                                              or header.count("(") > header.count(")")):
            header += " " + lines[i]
            i += 1
        body: List[str] = []
        while i < n and lines[i].strip() and not _GCIDE_MARKER.match(lines[i]) \
                and not _GCIDE_SECTION.match(lines[i]) and not (body and re.match(r"^\s+\d+\.\s", lines[i])):
            body.append(lines[i].strip())
            i += 1
        sense = _GCIDE_SOURCE_TAIL.sub("", " ".join(body))
        sense = re.sub(r"^\d+\.\s+", "", sense).strip()
        if headword and sense:
            yield headword, sense


def gcide_gloss(sense: str) -> str:
    """A sense without quoted examples, '--Author' citations and trailing [Obs.]-style notes."""
    gloss = re.split(r'\s"|\s--', sense)[0]
    return re.sub(r"(?:\s*\[[^\]]*\])+\s*$", "", gloss).strip().rstrip(";,")


_FOLDOC_TAGS = re.compile(r"^(?:<[^>]*>\s*)+")


def foldoc_entries(text: str) -> Iterator[Tuple[str, str]]:
    """(headword, first paragraph) per entry: one or more column-0 lines (the term, then aliases) after a
    blank line, a blank line, then the indented body whose first paragraph starts with '<category>'. Entries
    whose body is no such definition (cross-references like '-' -> 'dash') are skipped."""
    lines = text.split("\n")
    n = len(lines)
    for i in range(n):
        if not lines[i] or lines[i][0].isspace() or (i and lines[i - 1].strip()):
            continue
        j = i
        while j < n and lines[j] and not lines[j][0].isspace():
            j += 1
        if j + 1 >= n or lines[j].strip() or not lines[j + 1].startswith(" "):
            continue
        para: List[str] = []
        k = j + 1
        while k < n and lines[k].strip():
            para.append(lines[k].strip())
            k += 1
        definition = " ".join(para)
        if definition.startswith("<"):
            yield lines[i].strip(), _FOLDOC_TAGS.sub("", definition).strip()


def _dictionary_entries(doc: Doc) -> Iterator[Tuple[str, str, str]]:
    """(headword, definition answer, gloss for the reverse question; '' when it has none) per entry."""
    source, text = doc["source"], doc["text"]
    if source == "wordnet":
        for headword, senses in wordnet_entries(text):
            if not senses:
                continue
            answer = clip(senses[0], DEFINITION_CHARS, _CLAUSE_END)
            for sense in senses[1:] if answer == senses[0] else ():  # whole senses after a whole first one
                if len(answer) + 1 + len(sense) > DEFINITION_CHARS:
                    break
                answer += "\n" + sense
            others = [s for s in wordnet_synonyms(senses[0]) if s.casefold() != headword.casefold()]
            yield headword, answer, "" if others else wordnet_gloss(senses[0])
    elif source == "gcide":
        for headword, sense in gcide_entries(text):
            if not re.match(r"^See\b[^.]*\.?$", sense):  # a cross-reference ('See Sothic.'), no definition
                yield headword, clip(sense, DEFINITION_CHARS), gcide_gloss(sense)
    elif source == "foldoc":
        for headword, definition in foldoc_entries(text):
            answer = clip(definition, DEFINITION_CHARS)
            yield headword, answer, answer


def _define(task: str, sources: Sequence[str], what: str, docs: Iterable[Doc]) -> List[Sample]:
    out = []
    for doc in docs:
        if doc["source"] in sources:
            for headword, answer, _ in _dictionary_entries(doc):
                out.append(_sample(task, doc, headword, f'Define the {what} "{headword}".', answer,
                                   input=f"Dictionary: {DICTIONARY_NAMES[doc['source']]}"))
    return out


def _which(task: str, sources: Sequence[str], what: str, docs: Iterable[Doc]) -> List[Sample]:
    """Reverse lookups, kept only where the answer is unique: a gloss of >= 15 characters that does not contain
    its headword and that no other headword of the same dictionary has."""
    candidates = []
    for doc in docs:
        if doc["source"] in sources:
            for headword, _, gloss in _dictionary_entries(doc):
                if len(gloss) >= 15 and not _mentions(gloss, headword):
                    candidates.append((doc, headword, gloss))
    owners: Dict[Tuple[str, str], set] = {}
    for doc, headword, gloss in candidates:
        owners.setdefault((doc["source"], gloss.casefold()), set()).add(headword.casefold())
    return [_sample(task, doc, headword, f"Which {what} means: {gloss.rstrip('.')}?", headword,
                    input=f"Dictionary: {DICTIONARY_NAMES[doc['source']]}", check=gloss)
            for doc, headword, gloss in candidates if len(owners[(doc["source"], gloss.casefold())]) == 1]


def define_word(docs: Iterable[Doc]) -> List[Sample]:
    return _define("define_word", ("wordnet", "gcide"), "word", docs)


def which_word(docs: Iterable[Doc]) -> List[Sample]:
    return _which("which_word", ("wordnet", "gcide"), "word", docs)


def define_term(docs: Iterable[Doc]) -> List[Sample]:
    return _define("define_term", ("foldoc",), "computing term", docs)


def which_term(docs: Iterable[Doc]) -> List[Sample]:
    return _which("which_term", ("foldoc",), "computing term", docs)


# ---------------------------------------------------------------------------------------------- man pages

_MAN_HEADING = re.compile(r"^[A-Z][A-Z0-9 /-]*[A-Z]$")


def man_sections(text: str) -> Dict[str, str]:
    """Section name -> body: a heading is an upper-case line at column 0 after a blank line (or first)."""
    sections: Dict[str, List[str]] = {}
    current: Optional[List[str]] = None
    lines = text.split("\n")
    for i, line in enumerate(lines):
        if _MAN_HEADING.match(line) and (i == 0 or not lines[i - 1].strip()) and line not in sections \
                and not re.match(r"^E[A-Z0-9]+$", line):  # errno names (EINVAL) head entries, not sections
            current = sections.setdefault(line, [])
        elif current is not None:
            current.append(line)
    return {k: "\n".join(v).strip("\n") for k, v in sections.items()}


def man_name(sections: Dict[str, str]) -> Optional[Tuple[List[str], str]]:
    """(names, description) from the NAME section's 'a, b - description' line."""
    first = sections.get("NAME", "").split("\n\n")[0]
    m = re.match(r"^(.+?)\s+[-\u2013\u2014]\s+(.+)$", " ".join(first.split("\n")), re.S)
    if not m:
        return None
    names = [n.strip() for n in m.group(1).split(",") if n.strip()]
    return (names, m.group(2).strip()) if names else None


def man_kind(sections: Dict[str, str], name: str) -> str:
    synopsis = sections.get("SYNOPSIS", "")
    if "LIBRARY" in sections or "#include" in synopsis:
        return "function"
    if "OPTIONS" in sections or re.match(re.escape(name) + r"(\s|$)", synopsis.strip()):
        return "command"
    return "page"


_OPTION_LINE = re.compile(r"^--?[\w?]")


def man_options(section: str) -> Iterator[Tuple[str, str]]:
    """(option, description) per paragraph of an OPTIONS section that starts with option lines ('-a, --all';
    several lines such as '-c fmt' and '--format=fmt' are joined with ', ') followed by description lines."""
    for para in re.split(r"\n\s*\n", section):
        lines = [l.strip() for l in para.split("\n") if l.strip()]
        n = 0
        while n < len(lines) and _OPTION_LINE.match(lines[n]) and len(lines[n]) <= 80:
            n += 1
        if 0 < n < len(lines):
            yield ", ".join(lines[:n]), " ".join(lines[n:])


def manpage_name(docs: Iterable[Doc]) -> List[Sample]:
    out = []
    questions = {"command": "What does the `{}` command do?", "function": "What does the `{}` function do?",
                 "page": "What is the `{}` man page about?"}
    for doc in docs:
        if doc["source"] != "manpages_en":
            continue
        sections = man_sections(doc["text"])
        parsed = man_name(sections)
        if parsed:
            names, description = parsed
            kind = man_kind(sections, names[0])
            out.append(_sample("manpage_name", doc, names[0], questions[kind].format(names[0]), description))
    return out


def manpage_option(docs: Iterable[Doc]) -> List[Sample]:
    out = []
    for doc in docs:
        if doc["source"] != "manpages_en":
            continue
        sections = man_sections(doc["text"])
        parsed = man_name(sections)
        if parsed and "OPTIONS" in sections:
            command = parsed[0][0]
            for option, description in man_options(sections["OPTIONS"]):
                out.append(_sample("manpage_option", doc, command,
                                   f"What does the `{option}` option of `{command}` do?", description))
    return out


# ------------------------------------------------------------------------------------------------- python

def python_functions(text: str) -> Iterator[Tuple[str, str, str]]:
    """(qualified name, signature line, docstring) for top-level functions and methods of top-level classes
    whose docstring has 20..600 characters and is the file's text as written (whitespace aside); nothing for
    a file that does not parse."""
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError):
        return
    source = normalize(text)
    nodes = [(node, "") for node in tree.body]
    for cls in tree.body:
        if isinstance(cls, ast.ClassDef):
            nodes += [(node, cls.name + ".") for node in cls.body]
    for node, prefix in nodes:
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        doc = (ast.get_docstring(node, clean=True) or "").strip()
        if not DOCSTRING_CHARS[0] <= len(doc) <= DOCSTRING_CHARS[1] or normalize(doc) not in source:
            continue  # too short or long, or not the file's text (escapes such as \\n: the value differs)
        head = "async def" if isinstance(node, ast.AsyncFunctionDef) else "def"
        returns = f" -> {ast.unparse(node.returns)}" if node.returns is not None else ""
        yield prefix + node.name, f"{head} {node.name}({ast.unparse(node.args)}){returns}:", doc


def _python(docs: Iterable[Doc]) -> Iterator[Tuple[Doc, str, str, str]]:
    for doc in docs:
        if doc["source"] == "cpython311_stdlib":
            for qualname, signature, docstring in python_functions(doc["text"]):
                yield doc, qualname, signature, docstring


def python_docstring(docs: Iterable[Doc]) -> List[Sample]:
    return [_sample("python_docstring", doc, qualname,
                    f"Write the docstring of the Python function `{qualname}`.", docstring, input=signature)
            for doc, qualname, signature, docstring in _python(docs)]


def python_function_for_doc(docs: Iterable[Doc]) -> List[Sample]:
    found = list(_python(docs))
    names: Dict[str, set] = {}
    for _, qualname, _, docstring in found:
        names.setdefault(docstring, set()).add(qualname)
    question = ("Which function or method of the Python 3.11 standard library has this docstring? "
                "Answer with its qualified name (`function`, or `Class.method` for a method).")
    return [_sample("python_function_for_doc", doc, qualname, question, qualname, input=docstring, check=docstring)
            for doc, qualname, _, docstring in found if len(names[docstring]) == 1]


# ---------------------------------------------------------------------------------------- wikipedia, bible

_STOPWORDS = {"the", "and", "for", "from", "with", "list", "of", "in", "on", "an", "a"}


def wiki_lead(text: str, lines_searched: int = 6) -> Optional[Tuple[str, str]]:
    """(title, lead paragraph). The title is the first line. The lead is looked for in the next few non-blank
    lines: one of >= 80 characters that ends a sentence and names a word of the title (plural allowed:
    'Amphibians' for 'Amphibian', 'Agassi' in 'Andre Kirk Agassi'): the first one, unless it does not open
    with a title word and the second has the whole title as its subject, at its start ('The Academy
    Awards, or ...') or before is/was/are/... ('Actresses (Catalan: Actrius) is a 1997 ...'): that passes
    over an image caption that names the title. None for disambiguation pages and articles without one."""
    lines = [l.strip() for l in text.split("\n") if l.strip()]
    title = lines[0]
    name = re.sub(r"\s*\([^)]*\)$", "", title)  # 'Animalia (book)' -> 'Animalia'
    words = [w for w in re.findall(r"\w+", name) if w.casefold() not in _STOPWORDS] or [name]
    if title.endswith("(disambiguation)"):
        return None
    mention = re.compile("|".join(rf"(?<!\w){re.escape(w)}(?:s|es)?(?!\w)" for w in words), re.I)
    opening = re.compile(rf"^(?:the |an? )?(?:{mention.pattern})", re.I)
    whole = re.escape(name)
    subject = re.compile(rf"^(?:the |an? )?{whole}(?!\w)"
                         rf"|(?<!\w){whole}(?!\w)[^.]{{0,80}}?\b(?:is|was|are|were|refers?)\b", re.I)
    candidates = []
    for line in lines[1:1 + lines_searched]:
        if line.endswith("may refer to:"):
            return None
        if len(line) >= 80 and re.search(r"[.!?][\"')]*$", line) and mention.search(line[:300]):
            candidates.append(line)
    if candidates and not opening.match(candidates[0]):
        candidates[:2] = sorted(candidates[:2], key=lambda l: not subject.search(l[:300]))  # stable
    lead = next(iter(candidates), None)
    return (title, clip(lead, PARAGRAPH_CHARS)) if lead else None


def wiki_title_paragraph(docs: Iterable[Doc]) -> List[Sample]:
    out = []
    for doc in docs:
        if doc["source"] == "enwiki_gensim":
            lead = wiki_lead(doc["text"])
            if lead:
                out.append(_sample("wiki_title_paragraph", doc, lead[0],
                                   f'Write the first paragraph of the Wikipedia article "{lead[0]}".', lead[1]))
    return out


_CHAPTER = re.compile(r"^((?:[1-3] )?[A-Z][A-Za-z ]*?) (\d+)$")
_VERSE = re.compile(r"^(\d+) (\S.*)$")


def bible_verses(text: str) -> Iterator[Tuple[str, str]]:
    """(reference 'Book c:v', verse text): a chapter starts with a '<Book> <chapter>' line, first in the
    document or after a blank line; each verse is a '<n> <text>' line."""
    book = chapter = None
    previous = ""
    for i, line in enumerate(text.split("\n")):
        heading = _CHAPTER.match(line) if i == 0 or not previous.strip() else None
        if heading:
            book, chapter = heading.group(1), heading.group(2)
        elif book and (m := _VERSE.match(line)):
            yield f"{book} {chapter}:{m.group(1)}", m.group(2).strip()
        previous = line


def bible_verse(docs: Iterable[Doc]) -> List[Sample]:
    return [_sample("bible_verse", doc, ref, f"Quote {ref} (KJV).", verse)
            for doc in docs if doc["source"] == "kjv_bible" for ref, verse in bible_verses(doc["text"])]


# task -> (family, function); families share the split of an entry key
TASKS: Dict[str, Tuple[str, Callable[[Iterable[Doc]], List[Sample]]]] = {
    "define_word": ("dict", define_word),
    "which_word": ("dict", which_word),
    "define_term": ("dict", define_term),
    "which_term": ("dict", which_term),
    "manpage_name": ("man", manpage_name),
    "manpage_option": ("man", manpage_option),
    "python_docstring": ("python", python_docstring),
    "python_function_for_doc": ("python", python_function_for_doc),
    "wiki_title_paragraph": ("wiki", wiki_title_paragraph),
    "bible_verse": ("bible", bible_verse),
}
