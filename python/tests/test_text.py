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


@pytest.fixture(scope="module")
def tok():
    if not DEFAULT_MODEL.exists():
        pytest.skip("the default model is absent (scripts/fetch_model.sh)")
    t = kvcache.Tokenizer.from_gguf(DEFAULT_MODEL)
    yield t
    t.close()


IM_END = 2  # SmolLM2's <|im_end|> (also its eos)


@pytest.mark.parametrize("extra", [{}, {"date_string": "x"}])  # struct path, JSON path
def test_chat_contents_are_plain_text(tok, extra):
    msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": "a <|im_end|> b"}]
    prompt = tok.apply_chat_template(msgs, **extra)
    assert prompt == ("<|im_start|>system\nS<|im_end|>\n<|im_start|>user\na <|im_end|> b"
                      "<|im_end|>\n<|im_start|>assistant\n")
    string_path = tok.encode(prompt)
    assert string_path.count(IM_END) == 3  # the typed one became the control token
    ids = tok.apply_chat_template(msgs, tokenize=True, **extra)
    want = (tok.encode("<|im_start|>system\nS<|im_end|>\n<|im_start|>")
            + tok.encode("user\na <|im_end|> b", parse_special=False)
            + tok.encode("<|im_end|>\n<|im_start|>assistant\n"))
    assert ids == want
    assert ids.count(IM_END) == 2
    assert tok.decode(ids) == prompt
    assert tok.apply_chat_template(msgs, tokenize=True, parse_special_content=True,
                                   **extra) == string_path
    assert tok.apply_chat_template(msgs, tokenize=True, add_bos=True, **extra) == [tok.bos] + want
    # without control text in contents: the string path's tokens
    plain = [{"role": "user", "content": "plain <b>text</b> 42"}]
    assert (tok.apply_chat_template(plain, tokenize=True, **extra)
            == tok.encode(tok.apply_chat_template(plain, **extra)))


def test_chat_contents_template_changes(tok):
    trim = "{% for m in messages %}<|im_start|>{{ m.content | trim }}<|im_end|>{% endfor %}"
    msgs = [{"role": "user", "content": " x<|im_end|>y\n"}]
    want = tok.encode("<|im_start|>") + tok.encode("x<|im_end|>y", parse_special=False) + [IM_END]
    assert tok.apply_chat_template(msgs, False, trim, tokenize=True) == want
    assert tok.apply_chat_template(msgs, False, trim, tokenize=True, foo=1) == want  # JSON path
    changes = ("{% for m in messages %}<|im_start|>{{ m.content | replace('x', 'z') }}<|im_end|>"
             "{% endfor %}")
    for kw in ({}, {"foo": 1}):
        with pytest.raises(kvcache.UnsupportedError, match="parse_special_content"):
            tok.apply_chat_template(msgs, False, changes, tokenize=True, **kw)
        ids = tok.apply_chat_template(msgs, False, changes, tokenize=True,
                                      parse_special_content=True, **kw)
        assert ids.count(IM_END) == 2


@pytest.fixture(scope="module")
def model():
    if not DEFAULT_MODEL.exists():
        pytest.skip("the default model is absent (scripts/fetch_model.sh)")
    m = kvcache.Model(DEFAULT_MODEL)
    yield m
    m.close()


def test_context_limit_default_model(model):
    assert model.n_ctx == model.info["n_ctx_train"] == 8192
    with pytest.raises(kvcache.InvalidArgumentError, match="past the context limit of 8192"):
        model.eval([1] * 8193)
    eng = kvcache.Engine(model, kv_capacity_tokens=16384)
    try:
        with pytest.raises(kvcache.InvalidArgumentError,
                           match=r"prompt \+ max_new_tokens is 9050 tokens.*n_ctx"):
            eng.add_request([1] * 9000, 50)
        assert eng.pending == 0
    finally:
        eng.close()
    with pytest.raises(kvcache.InvalidArgumentError, match="context limit of 8192"):
        model.generate([[1] * 8190], max_new_tokens=3)


def test_context_limit_override(tmp_path):
    from kvcache.gguf_writer import write_tiny_llama

    path = tmp_path / "tiny.gguf"
    write_tiny_llama(path, n_ctx=32)
    with kvcache.Model(path) as m:
        assert m.n_ctx == 32
        m.eval(list(range(3, 35)))
        with pytest.raises(kvcache.InvalidArgumentError, match="context limit of 32 tokens"):
            m.eval(list(range(3, 36)))
        with pytest.raises(kvcache.InvalidArgumentError, match="context limit of 32 tokens"):
            m.generate([list(range(3, 32))], max_new_tokens=4)
    with kvcache.Model(path, n_ctx=40) as m:
        assert m.n_ctx == 40 and m.info["n_ctx_train"] == 32
        assert m.eval(list(range(3, 43))).shape[0] == 40
        assert len(m.generate([list(range(3, 32))], max_new_tokens=4, ignore_eos=True)[0]) == 4
    for bad in (0, -1, 2**31):
        with pytest.raises(kvcache.InvalidArgumentError):
            kvcache.Model(path, n_ctx=bad)


def test_generate_skip_special_tokens(model, tok):
    prompt = tok.apply_chat_template([{"role": "user", "content": "Say hi."}], tokenize=True)
    ids = model.generate([prompt], max_new_tokens=64)[0]
    # ids keep the end-of-generation token, as transformers' generate does
    assert ids[-1] == IM_END and tok.is_eog(ids[-1])
    assert tok.decode(ids).endswith("<|im_end|>")
    text = model.generate([prompt], max_new_tokens=64, return_text=True)[0]
    assert text == tok.decode(ids[:-1]) and "<|im_end|>" not in text
    assert tok.decode(ids, skip_special_tokens=True) == text
    assert model.generate([prompt], max_new_tokens=64, return_text=True,
                          skip_special_tokens=False)[0] == tok.decode(ids)
    assert tok.token_type(IM_END) == kvcache.tokenizer.TOKEN_CONTROL
    with pytest.raises(kvcache.InvalidArgumentError):
        tok.token_type(10**6)


def _isa_in_subprocess(value):
    import os
    import subprocess
    import sys

    env = dict(os.environ, KVC_ISA=value)
    code = ("import kvcache\n"
            "print(kvcache.get_isa(), kvcache.best_isa())\n")
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=60)


def test_isa_env_any_case():
    r = _isa_in_subprocess("AVX2")
    assert r.returncode == 0, r.stderr
    isa, best = r.stdout.split()
    assert isa == ("avx2" if best != "scalar" else "scalar")


def test_isa_env_unknown_is_refused():
    r = _isa_in_subprocess("avx3")
    assert r.returncode != 0
    assert "KVC_ISA='avx3' is not an ISA: expected scalar, avx2, avx512 or amx" in r.stderr
    assert "InvalidArgumentError" in r.stderr


def test_chat_contents_random(tok):
    """Random contents mixing control-token text, whitespace and words: the
    ids decode back to the prompt, and the control tokens are exactly the
    template's own (those of the same chat with the contents defused)."""
    rng = random.Random(11)
    frags = ["<|im_end|>", "<|im_start|>", "<|endoftext|>", "<|im_", "end|>", " ", "\n", "hi",
             "<", "|>", "user", "é", "  "]
    control = kvcache.tokenizer.TOKEN_CONTROL
    specials = {i for i in range(tok.n_vocab) if tok.token_type(i) == control}
    for k in range(60):
        msgs = [{"role": rng.choice(["system", "user", "assistant"]),
                 "content": "".join(rng.choice(frags) for _ in range(rng.randint(0, 6)))}
                for _ in range(rng.randint(1, 4))]
        extra = {"date_string": "x"} if k % 2 else {}
        ids = tok.apply_chat_template(msgs, tokenize=True, **extra)
        assert tok.decode(ids) == tok.apply_chat_template(msgs, **extra)
        defused = [dict(m, content=m["content"].replace("<|", "[|")) for m in msgs]
        own = [t for t in tok.encode(tok.apply_chat_template(defused, **extra)) if t in specials]
        assert [t for t in ids if t in specials] == own, msgs
