"""An independent, deliberately simple byte-level BPE tokenizer: the test
oracle for kvcache's C tokenizer.

Written from the published descriptions, not from the C code:
  * GPT-2's byte-to-unicode table and merge loop (openai/gpt-2 encoder.py:
    repeatedly merge the lowest-ranked adjacent pair, every occurrence left
    to right, until no ranked pair is left);
  * the pre-tokenizer regexes, run with the `regex` package exactly as
    written in the models' tokenizer.json files / llama.cpp's pre-type table.
    Several regexes apply in sequence, each to the pieces the previous one
    produced; text a regex does not match stays a piece of its own;
  * special tokens split the text first (leftmost, longest match);
  * a byte whose GPT-2 character is not in the vocabulary (SmolLM2 lacks 21,
    e.g. 0xFF) becomes the unknown token, as a BPE model with unk_token does.

Text is a Python str; invalid UTF-8 bytes travel as lone surrogates
U+DC80..U+DCFF ("surrogateescape"), which no regex class matches except
[^\\s\\p{L}\\p{N}], and which encode back to their original bytes.
"""

from __future__ import annotations

import regex

GPT2 = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
LLAMA3 = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"""
          r"""| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+""")
QWEN2 = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"""
         r"""| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+""")

# tokenizer.ggml.pre -> (regexes applied in order, ignore_merges)
PRE_TOKENIZERS = {
    "gpt2": ([GPT2], False),
    "smollm": ([r"\p{N}", GPT2], False),  # HF: Digits(individual_digits) + ByteLevel
    "llama-bpe": ([LLAMA3], True),  # Llama 3's tokenizer.json has ignore_merges
    "llama3": ([LLAMA3], True),
    "qwen2": ([QWEN2], False),
}

CONTROL, USER_DEFINED = 3, 4


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's table: printable Latin-1 bytes map to themselves, the other 68
    bytes to chr(256), chr(257), ... in byte order."""
    keep = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
            + list(range(ord("®"), ord("ÿ") + 1)))
    table = {b: chr(b) for b in keep}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


BYTE_ENCODER = bytes_to_unicode()
BYTE_DECODER = {v: k for k, v in BYTE_ENCODER.items()}


def split_pieces(pattern: str, text: str) -> list[str]:
    """Matches of pattern, plus the unmatched stretches between them."""
    out, pos = [], 0
    for m in regex.finditer(pattern, text):
        if m.start() > pos:
            out.append(text[pos:m.start()])
        if m.end() > m.start():
            out.append(m.group())
        pos = m.end()
    if pos < len(text):
        out.append(text[pos:])
    return out


class ReferenceBPE:
    def __init__(self, tokens, merges, token_types=None, pre="gpt2", unk=None):
        self.tokens = list(tokens)
        self.vocab = {}
        for i, t in enumerate(self.tokens):
            self.vocab.setdefault(t, i)
        self.ranks = {}
        for r, m in enumerate(merges):
            a, b = m.split(" ", 1)
            self.ranks.setdefault((a, b), r)
        self.types = list(token_types) if token_types is not None else [1] * len(self.tokens)
        self.regexes, self.ignore_merges = PRE_TOKENIZERS[pre]
        self.unk = unk  # id for a byte that has no token (None: such a byte is an error)
        self.cache = {}

    def specials(self, parse_special: bool) -> list[str]:
        kinds = (CONTROL, USER_DEFINED) if parse_special else (USER_DEFINED,)
        return [t for t, k in zip(self.tokens, self.types) if k in kinds and t]

    def bpe(self, word: str) -> list[int]:
        if word in self.cache:
            return self.cache[word]
        if self.ignore_merges and word in self.vocab:
            return [self.vocab[word]]
        parts = list(word)
        while len(parts) > 1:
            best = min(range(len(parts) - 1),
                       key=lambda i: self.ranks.get((parts[i], parts[i + 1]), float("inf")))
            pair = (parts[best], parts[best + 1])
            if pair not in self.ranks:
                break
            merged, i = [], 0
            while i < len(parts):
                if i + 1 < len(parts) and (parts[i], parts[i + 1]) == pair:
                    merged.append(parts[i] + parts[i + 1])
                    i += 2
                else:
                    merged.append(parts[i])
                    i += 1
            parts = merged
        ids = [self.vocab[p] if p in self.vocab or self.unk is None else self.unk for p in parts]
        self.cache[word] = ids
        return ids

    def encode_plain(self, text: str) -> list[int]:
        pieces = [text] if text else []
        for pattern in self.regexes:
            pieces = [q for p in pieces for q in split_pieces(pattern, p)]
        out = []
        for p in pieces:
            raw = p.encode("utf-8", "surrogateescape")
            out += self.bpe("".join(BYTE_ENCODER[b] for b in raw))
        return out

    def encode(self, text: str, parse_special: bool = True) -> list[int]:
        specials = sorted(self.specials(parse_special), key=len, reverse=True)
        if not specials:
            return self.encode_plain(text)
        pattern = "|".join(regex.escape(s) for s in specials)  # longest alternative first
        out, pos = [], 0
        for m in regex.finditer(pattern, text):
            out += self.encode_plain(text[pos:m.start()])
            out.append(self.vocab[m.group()])
            pos = m.end()
        return out + self.encode_plain(text[pos:])

    def decode_bytes(self, ids) -> bytes:
        out = bytearray()
        for i in ids:
            t = self.tokens[i]
            if self.types[i] in (CONTROL, USER_DEFINED):
                out += t.encode()
            else:
                out += bytes(BYTE_DECODER[ch] for ch in t)
        return bytes(out)
