"""What the layers above share about scripts: the Unicode ranges of CJK text, written without spaces between words,
so that word-based measures (MinHash shingles in data/minhash.py, ROUGE-L in evaluation/tasks.py) take each of its
characters as a word, and the Chinese builders can tell Chinese text (builders/chat_zh.py)."""

CJK = "\u2e80-\u2fdf\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff"  # radicals, kana, CJK ideographs
