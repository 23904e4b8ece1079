"""`kvcache perplexity` (tools/kvcache/cmd_perplexity.c) against the protocol
of llama-perplexity computed here in numpy: chunks of n_ctx tokens, the first
replaced by BOS where the vocabulary adds one, positions n_ctx/2 .. n_ctx-2
scored, ppl = exp(mean nll) +/- ppl * sqrt(var(nll) / (count - 1)).

Two references: the logits of Model.forward over a fresh cache of the same
dtype per chunk (the same kernels: the figures must agree to rounding of the
nll sums), and, for float32 KV on a float-weight tiny model, the independent
float64 numpy llama (llama_reference.py), within its logit tolerance.
"""

from __future__ import annotations

import json
import os
import pty
import subprocess
from pathlib import Path

import numpy as np
import pytest

import kvcache
from kvcache.model import Model

gguf = pytest.importorskip("gguf")
from kvcache.gguf_writer import write_tiny_llama  # noqa: E402
from llama_reference import LlamaReference  # noqa: E402
from cli_path import kvcache_cli  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
DEFAULT_MODEL = REPO / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"

TEXT = (
    "A key-value cache keeps the keys and values of every token a model has seen, so that "
    "each new token attends to the past without computing it again. Its size grows with the "
    "context and with the number of sequences served at once, and on long prompts it, not "
    "the weights, decides how many requests fit in memory. Storing the cache in eight or four "
    "bits with a scale per small group of elements halves or quarters that memory; the "
    "question is what it costs in quality. Perplexity answers it plainly: the model reads a "
    "text it has not been tuned on, and for each token we ask how surprised it was. A cache "
    "that loses information shows up as more surprise. The protocol matters as much as the "
    "number: the text is cut into windows, every window starts from an empty cache, and only "
    "the second half of each window is scored, so that every scored token has at least half "
    "a window of context behind it. Two implementations that agree on this protocol can be "
    "compared digit by digit; two that differ in it cannot be compared at all. The library "
    "under test pages its cache in blocks of sixteen tokens, shares full pages between "
    "sequences with the same prefix, and reads quantized pages with kernels that never widen "
    "the whole cache back to sixteen bits. "
)



def _run(*args, stderr=subprocess.PIPE):
    return subprocess.run([str(kvcache_cli()), "perplexity", *map(str, args)], stdout=subprocess.PIPE,
                          stderr=stderr, text=True, timeout=600)


def _json(*args) -> dict:
    r = _run(*args, "--json")
    assert r.returncode == 0, r.stderr
    assert r.stderr == ""  # no progress when stderr is not a terminal
    return json.loads(r.stdout)


def protocol(ids, n_ctx, bos, chunk_logits):
    """llama-perplexity's figures from chunk_logits(chunk) -> (n_ctx, n_vocab)."""
    n_chunks, first = len(ids) // n_ctx, n_ctx // 2
    nll = []
    for c in range(n_chunks):
        chunk = np.array(ids[c * n_ctx:(c + 1) * n_ctx], np.int64)
        if bos is not None:
            chunk[0] = bos
        lg = np.asarray(chunk_logits(chunk), np.float64)[first:n_ctx - 1]
        mx = lg.max(axis=1)
        lse = mx + np.log(np.exp(lg - mx[:, None]).sum(axis=1))
        nll.append(lse - lg[np.arange(lg.shape[0]), chunk[first + 1:]])
    nll = np.concatenate(nll)
    mean = nll.mean()
    ppl = np.exp(mean)
    se = ppl * np.sqrt(((nll * nll).mean() - mean * mean) / (nll.size - 1))
    return ppl, se, n_chunks, nll.size


def _forward_logits(m, kv_dtype, group):
    def f(chunk):
        cache = m.new_cache(chunk.size, kv_dtype=kv_dtype, enable_prefix_caching=False,
                            quant_group=group)
        try:
            seq, _ = cache.add_sequence(chunk.size)
            return m.forward(cache, [seq], [0], [chunk.size], chunk,
                             want_logits=np.ones(chunk.size, np.uint8), num_threads=2)
        finally:
            cache.close()
    return f


def _kv_bytes(info, bits, group):
    """K and V of every layer and KV head per token, float16 scales per group."""
    dh = info["head_dim"]
    per_head = dh * bits // 8 + (dh // group * 2 if group else 0)
    return info["n_layer"] * 2 * info["n_head_kv"] * per_head


@pytest.fixture(scope="module", params=[False, True], ids=["no_bos", "bos"])
def tiny(request, tmp_path_factory):
    d = tmp_path_factory.mktemp("ppl")
    path = d / "tiny.gguf"
    # head dim 32 (int8 group 32 fits); float weights: the float64 reference
    # then agrees to float32 rounding
    write_tiny_llama(path, n_layer=2, n_embd=128, n_head=4, n_head_kv=2, n_ff=128, seed=11,
                     attn_gain=4.0, tied_output=False, weight_types="F32",
                     add_bos=request.param)
    text = d / "text.txt"
    text.write_text(TEXT * 2)
    m = Model(path)
    bos = m.tokenizer.bos if request.param else None
    ids = m.tokenizer.encode(text.read_bytes(), add_bos=request.param, parse_special=False)
    yield path, text, m, ids, bos
    m.close()


def test_tiny_matches_float64_reference(tiny):
    path, text, m, ids, bos = tiny
    if bos is not None:
        assert ids[0] == bos  # the vocabulary's add_bos reached the tokenizer
    n_ctx = 48
    got = _json("-m", path, "-f", text, "-c", n_ctx, "--kv-dtype", "f32", "-t", 2)
    ref = LlamaReference(str(path))
    ppl, se, n_chunks, n_scored = protocol(ids, n_ctx, bos, ref.logits)
    assert n_chunks >= 8
    assert got["n_chunks"] == n_chunks and got["n_scored"] == n_scored
    assert n_scored == n_chunks * (n_ctx - 1 - n_ctx // 2)
    assert got["n_tokens"] == len(ids) and got["n_ctx"] == n_ctx
    # float32 logits against float64: measured 4e-9 relative in ppl, 6e-10 in
    # its standard error
    assert got["ppl"] == pytest.approx(ppl, rel=1e-6)
    assert got["ppl_stderr"] == pytest.approx(se, rel=1e-6)
    assert got["kv_dtype"] == "float32" and got["kv_group"] is None
    assert got["kv_bytes_per_token"] == _kv_bytes(m.info, 32, 0)


# (--kv-dtype, the Python kv_dtype, bits, group, n_ctx): int8/int4 name the
# compressed formats (chunks of 160 tokens complete K groups of 64), the
# per-token caches are int8-token/int4-token
PPL_CASES = [("float16", "float16", 16, 0, 40), ("bfloat16", "bfloat16", 16, 0, 40),
             ("int8-token", "int8", 8, 8, 40), ("int8-token", "int8", 8, 32, 40),
             ("int4-token", "int4", 4, 16, 40), ("int8", "kivi8", 8, 0, 160),
             ("int4", "kivi4", 4, 0, 160)]


@pytest.mark.parametrize("cli,kv_dtype,bits,group,n_ctx", PPL_CASES)
def test_tiny_matches_model_forward(tiny, cli, kv_dtype, bits, group, n_ctx):
    path, text, m, ids, bos = tiny
    args = ["-m", path, "-f", text, "-c", n_ctx, "--kv-dtype", cli, "-t", 2]
    if group:
        args += ["--kv-group", group]
    got = _json(*args)
    ppl, se, n_chunks, n_scored = protocol(ids, n_ctx, bos,
                                           _forward_logits(m, kv_dtype, group or 8))
    assert (got["n_chunks"], got["n_scored"]) == (n_chunks, n_scored)
    # the same logits: only the order of the nll sums differs
    assert got["ppl"] == pytest.approx(ppl, rel=1e-12)
    assert got["ppl_stderr"] == pytest.approx(se, rel=1e-9)
    assert got["kv_dtype"] == (kv_dtype + "-token" if cli.endswith("-token") else kv_dtype)
    assert got["kv_group"] == (group or None)
    if kv_dtype.startswith("kivi"):
        fmt = kvcache.KVFormat.member(kv_dtype, m.info["n_head_kv"], m.info["head_dim"], 16)
        assert got["kv_bytes_per_token"] == m.info["n_layer"] * fmt.page_bytes // 16
    else:
        assert got["kv_bytes_per_token"] == _kv_bytes(m.info, bits, group)


def test_tiny_batch_and_threads_do_not_change_the_result(tiny):
    path, text, *_ = tiny
    base = _json("-m", path, "-f", text, "-c", 64, "-t", 1)
    for extra in (["-b", 5], ["-b", 64], ["-b", 1000], ["-t", 2, "-b", 17]):
        assert _json("-m", path, "-f", text, "-c", 64, "-t", 1, *extra) == base
    # the compressed formats too: each query reads what a decode at its
    # position would, whatever the steps (chunks of 160 cross K groups)
    for kv in ("int8", "int4"):
        base = _json("-m", path, "-f", text, "-c", 160, "-t", 1, "--kv-dtype", kv)
        for extra in (["-b", 7], ["-b", 64], ["-t", 2, "-b", 100]):
            assert _json("-m", path, "-f", text, "-c", 160, "-t", 1, "--kv-dtype", kv,
                         *extra) == base


def test_tiny_text_from_standard_input(tiny):
    """-f - reads the text from standard input, as run and chat do."""
    path, text, *_ = tiny
    base = _json("-m", path, "-f", text, "-c", 64, "-t", 1)
    with open(text, "rb") as f:
        r = subprocess.run([str(kvcache_cli()), "perplexity", "-m", str(path), "-f", "-", "-c", "64",
                            "-t", "1", "--json"], stdin=f, stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout) == base


def test_tiny_standard_input_is_named(tiny):
    """Messages name -f - "standard input", not "-"."""
    path, *_ = tiny
    r = subprocess.run([str(kvcache_cli()), "perplexity", "-m", str(path), "-f", "-", "-c", "100"],
                       input=TEXT[:100], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                       text=True, timeout=600)
    assert r.returncode == 1, r.stderr
    assert "kvcache: perplexity: standard input has " in r.stderr, r.stderr
    assert "tokens; -c 100 needs at least 100" in r.stderr


def test_tiny_progress_only_on_a_terminal(tiny):
    path, text, *_ = tiny
    master, slave = pty.openpty()
    try:
        r = _run("-m", path, "-f", text, "-c", 32, "-t", 1, stderr=slave)
        os.close(slave)
        slave = -1
        err = b""
        while True:
            try:
                chunk = os.read(master, 4096)
            except OSError:  # EIO once the other side is closed and drained
                break
            if not chunk:
                break
            err += chunk
    finally:
        if slave >= 0:
            os.close(slave)
        os.close(master)
    assert r.returncode == 0
    assert b"\rperplexity: chunk 1/" in err
    assert r.stdout.startswith("perplexity: ")
    # the text output carries the same figures as --json
    got = _json("-m", path, "-f", text, "-c", 32, "-t", 1)
    lines = r.stdout.splitlines()
    assert lines[0] == f"perplexity: {got['ppl']:.4f} +/- {got['ppl_stderr']:.5f}"
    assert lines[1].startswith(f"scored:     {got['n_scored']} tokens: {got['n_chunks']} chunks")
    assert lines[2] == f"kv cache:   float16, {got['kv_bytes_per_token']} bytes/token"


def test_tiny_errors(tiny, tmp_path):
    path, text, m, _, bos = tiny
    short = tmp_path / "short.txt"
    short.write_text(TEXT[:100])
    empty = tmp_path / "empty.txt"
    empty.write_bytes(b"")
    n_short = len(m.tokenizer.encode(short.read_bytes(), add_bos=bos is not None,
                                     parse_special=False))
    assert n_short < 100
    cases = [  # (args, exit status, message)
        (["-f", tmp_path / "missing.txt"], 1, "cannot read"),
        (["-f", tmp_path], 1, "cannot read"),  # a directory
        (["-f", short, "-c", 100], 1, f"has {n_short} tokens; -c 100 needs at least 100"),
        (["-f", empty, "-c", 8], 1, "needs at least 8"),
        (["-f", text, "-c", "abc"], 2, "-c: expected"),
        (["-f", text, "-c", 0], 2, "-c: expected"),
        (["-f", text, "-c", 7], 2, "-c: expected"),
        (["-f", text, "-c", -64], 2, "-c: expected"),
        (["-f", text, "-c", ""], 2, "-c: expected"),
        (["-f", text, "-c", 512], 2, "the model's context is 256"),
        (["-f", text, "-b", 0], 2, "-b: expected"),
        (["-f", text, "--kv-dtype", "int3"], 2, "--kv-dtype: expected"),
        (["-f", text, "--kv-group", 32], 2, "--kv-group needs --kv-dtype int8-token or int4-token"),
        (["-f", text, "-c", 64, "--kv-dtype", "int8-token", "--kv-group", 3], 2, "--kv-group 3"),
        (["-f", text, "-c"], 2, "-c needs a value"),
        (["-f", text, "--cache"], 2, "unexpected argument '--cache'"),
        (["-f", text, "-c", "+64"], 2, "-c: expected an integer in [8, 1048576], got '+64'"),
        (["-f", text, "--ctx-size", " 64"], 2, "--ctx-size: expected an integer in [8, 1048576]"),
        (["-f", text, "-t", "0x2"], 2, "-t: expected an integer in [1, 256]"),
        ([], 2, "a text file is required"),
    ]
    for args, rc, msg in cases:
        r = _run("-m", path, *args)
        assert r.returncode == rc, (args, r.stderr)
        assert msg in r.stderr, (args, r.stderr)
        assert r.stdout == ""
    r = _run("-m", tmp_path / "nope.gguf", "-f", text)
    assert r.returncode == 1 and "cannot load" in r.stderr


def test_tiny_default_ctx_is_the_model_context(tiny):
    """Without -c, chunks are 1024 tokens or the whole context of a smaller
    model (the tiny one's 256), said on stderr unless -q; an explicit -c past
    it stays an error (test_tiny_errors)."""
    path, text, *_ = tiny
    r = _run("-m", path, "-f", text, "-t", 1, "--json")
    assert r.returncode == 0, r.stderr
    assert r.stderr == "kvcache: perplexity: chunks of 256 tokens, the model's context " \
                       "(-c to choose)\n"
    got = json.loads(r.stdout)
    assert got["n_ctx"] == 256
    assert got == _json("-m", path, "-f", text, "-t", 1, "-c", 256)
    r = _run("-m", path, "-f", text, "-t", 1, "--json", "-q")
    assert r.returncode == 0 and r.stderr == "" and json.loads(r.stdout) == got


def test_tiny_reader_gone(tiny):
    """A closed stdout is a write error (exit 1, said on stderr) once the model
    and cache are freed, not a death by SIGPIPE (-13)."""
    path, text, *_ = tiny
    r, w = os.pipe()
    os.close(r)
    try:
        p = subprocess.run([str(kvcache_cli()), "perplexity", "-m", str(path), "-f", str(text), "-c",
                            "64", "-t", "1"], stdout=w, stderr=subprocess.PIPE, text=True,
                           timeout=600)
    finally:
        os.close(w)
    assert p.returncode == 1, p.stderr
    assert "kvcache: perplexity: cannot write the output: Broken pipe" in p.stderr


def test_help_lists_the_command():
    r = subprocess.run([str(kvcache_cli()), "--help"], capture_output=True, text=True)
    assert r.returncode == 0 and "\n  perplexity " in r.stdout
    r = subprocess.run([str(kvcache_cli()), "help", "perplexity"], capture_output=True, text=True)
    assert r.returncode == 0 and r.stdout.startswith("usage: kvcache perplexity")


@pytest.mark.skipif(not DEFAULT_MODEL.exists(), reason="the default model is absent "
                    "(bash scripts/fetch_model.sh)")
def test_default_model(tmp_path):
    text = tmp_path / "text.txt"
    text.write_text(TEXT)
    m = Model(DEFAULT_MODEL)
    try:
        ids = m.tokenizer.encode(text.read_bytes(), parse_special=False)
        n_ctx = 128
        got = _json("-m", DEFAULT_MODEL, "-f", text, "-c", n_ctx, "-t", 2)
        ppl, se, n_chunks, n_scored = protocol(ids, n_ctx, None,
                                               _forward_logits(m, "float16", 8))
        info = m.info
    finally:
        m.close()
    assert n_chunks >= 2
    assert (got["n_chunks"], got["n_scored"]) == (n_chunks, n_scored)
    assert got["ppl"] == pytest.approx(ppl, rel=1e-12)
    assert got["ppl_stderr"] == pytest.approx(se, rel=1e-9)
    # measured 116 on this dense prose with 64-127 tokens of context (22 on the
    # GPL's opening); a broken forward pass gives thousands (uniform: 49152)
    assert 20 < got["ppl"] < 500
    # the table: float16 23,040 and int8 group 32 12,240 bytes per token
    assert got["kv_bytes_per_token"] == _kv_bytes(info, 16, 0) == 23040
    g32 = _json("-m", DEFAULT_MODEL, "-f", text, "-c", n_ctx, "-t", 2, "--kv-dtype",
                "int8-token", "--kv-group", 32)
    assert g32["kv_bytes_per_token"] == _kv_bytes(info, 8, 32) == 12240
    # an 8-bit cache costs little on this text; a broken one would not
    assert abs(np.log(g32["ppl"] / got["ppl"])) < 0.05
    # the compressed formats' bytes (KV_FORMATS.md section 5) and a small cost
    for kv, bpt, tol in (("int8", 12240, 0.01), ("int4", 6480, 0.05)):
        c = _json("-m", DEFAULT_MODEL, "-f", text, "-c", n_ctx, "-t", 2, "--kv-dtype", kv)
        assert c["kv_dtype"] == {"int8": "kivi8", "int4": "kivi4"}[kv]
        assert c["kv_bytes_per_token"] == bpt
        assert abs(np.log(c["ppl"] / got["ppl"])) < tol, (kv, c["ppl"], got["ppl"])
