"""Text in, text out: streaming UTF-8 (kvcache.Utf8Stream against Python's
own incremental decoder), chat message contents as plain text, the context
limit, and skip_special_tokens in Model.generate."""

from __future__ import annotations

import codecs
import random
from pathlib import Path

import pytest

import kvcache

REPO = Path(__file__).resolve().parents[2]
DEFAULT_MODEL = REPO / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"

# bytes that make every kind of sequence: ASCII, leads of 2/3/4-byte
# sequences (with their restricted second bytes), continuations, never-valid
_ALPHABET = bytes([0x41, 0x00, 0x7F, 0xC2, 0xC3, 0xDF, 0xC0, 0xC1, 0xE0, 0xE2, 0xED, 0xEF, 0xF0,
                   0xF4, 0xF5, 0xFF, 0x80, 0x8F, 0x90, 0x9F, 0xA0, 0xBF])


def _stream(chunks) -> str:
    s = kvcache.Utf8Stream()
    return "".join(s.feed(c) for c in chunks) + s.flush()


def test_utf8_stream_matches_python_decoder():
    rng = random.Random(5)
    for _ in range(3000):
        data = bytes(rng.choice(_ALPHABET) for _ in range(rng.randint(0, 12)))
        cuts = sorted(rng.randint(0, len(data)) for _ in range(rng.randint(0, 4)))
        chunks = [data[a:b] for a, b in zip([0] + cuts, cuts + [len(data)])]
        want = data.decode("utf-8", "replace")
        assert _stream(chunks) == want, (data, cuts)
        # piece by piece: never behind Python's incremental decoder (which
        # holds some tails it could already reject, e.g. b"\xed\xbf")
        py = codecs.getincrementaldecoder("utf-8")("replace")
        s = kvcache.Utf8Stream()
        got = ref = ""
        for c in chunks:
            got += s.feed(c)
            ref += py.decode(c)
            assert want.startswith(got) and got.startswith(ref), (data, cuts)
        assert got + s.flush() == want


def test_utf8_stream_holds_incomplete_emoji():
    s = kvcache.Utf8Stream()
    e = "🎉".encode()
    assert [s.feed(e[i:i + 1]) for i in range(4)] == ["", "", "", "🎉"]
    assert s.feed(e[:2]) == ""
    assert s.flush() == "\ufffd"  # cut short at the end
    assert s.flush() == ""
    with pytest.raises(kvcache.InvalidArgumentError):
        s.feed("text")
