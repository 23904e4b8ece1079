"""The compressed KV formats kivi8/kivi4 (docs/KV_FORMATS.md) under the real
default model (SmolLM2-135M-Instruct Q4_1):

- teacher-forced arg-max agreement with float16 storage over the first 1,024
  tokens of Debian's GPL-3 followed by Apache-2.0 (the text of issue 29 and
  docs/BENCHMARKS.md's perplexity table): >= 99.5% for kivi8, >= 95% for
  kivi4;
- every query attends what a decode at its position would, so the logits do
  not depend on how the prompt is cut into steps (bitwise), also past the
  SIMD kernels' key chunks of 1,024 tokens (and the stored K/V neither);
- the engine's batched generation equals each request alone, token for token,
  with chunked prefill and prefix caching in play.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import kvcache
from kvcache import Model

REPO = Path(__file__).resolve().parents[2]
DEFAULT_MODEL = REPO / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
LICENSES = Path("/usr/share/common-licenses")

needs_model = pytest.mark.skipif(not DEFAULT_MODEL.exists(),
                                 reason=f"the default model is absent ({DEFAULT_MODEL}): "
                                        "bash scripts/fetch_model.sh")

N_TOKENS = 1024
# Issue 29's goals: 99.5% (int8) and 95% (int4). Measured on this text
# (first chunk; all 9 chunks in docs/BENCHMARKS.md): kivi8 99.8%, kivi4 96.3%
# (95.9% over the 9 chunks; 94.9% before kivi4 kept position 0 in float16).
AGREEMENT = {"kivi8": 0.995, "kivi4": 0.95}


@pytest.fixture(scope="module")
def smol():
    m = Model(DEFAULT_MODEL)
    yield m
    m.close()


@pytest.fixture(scope="module")
def text_ids(smol):
    # base-files ships these on every Debian/Ubuntu system
    text = (LICENSES / "GPL-3").read_text() + (LICENSES / "Apache-2.0").read_text()
    ids = smol.tokenizer.encode(text)
    assert len(ids) >= N_TOKENS
    return ids[:N_TOKENS]


def _logits(m, ids, kv_dtype, step):
    """Logits of every position, the prompt fed in steps of `step` rows."""
    n = len(ids)
    cache = m.new_cache(n + 16, kv_dtype=kv_dtype)
    seq, _ = cache.add_sequence(n)
    out = []
    for p in range(0, n, step):
        k = min(step, n - p)
        out.append(m.forward(cache, [seq], [p], [k], ids[p:p + k],
                             want_logits=np.ones(k, bool), num_threads=2))
    return np.concatenate(out)


@pytest.fixture(scope="module")
def float16_logits(smol, text_ids):
    return _logits(smol, text_ids, "float16", 512)


@needs_model
@pytest.mark.parametrize("fmt", sorted(AGREEMENT))
def test_argmax_agreement_with_float16(smol, text_ids, float16_logits, fmt):
    lg = _logits(smol, text_ids, fmt, 512)
    agree = float((lg.argmax(1) == float16_logits.argmax(1)).mean())
    assert agree >= AGREEMENT[fmt], (fmt, agree)
    # the same logits, bit for bit, however the prompt is cut into steps
    lg2 = _logits(smol, text_ids, fmt, 100)
    assert np.array_equal(lg, lg2), (fmt, float(np.abs(lg - lg2).max()))


@needs_model
@pytest.mark.parametrize("fmt", ["kivi8", "kivi4"])
def test_long_prompt_decode_equals_prefill(smol, fmt):
    # past 1,024 tokens the SIMD kernels split a query's keys in chunks: a
    # decode step (one row) and a prefill row must still get the same bits,
    # and so every layer's stored K/V the same bytes
    text = (LICENSES / "GPL-3").read_text() + (LICENSES / "Apache-2.0").read_text()
    ids = smol.tokenizer.encode(text)[:1100]
    n, tail = len(ids), 36
    runs = []
    for steps in ([600, n - 600], [n - tail] + [1] * tail):
        cache = smol.new_cache(n + 16, kv_dtype=fmt)
        seq, _ = cache.add_sequence(n)
        lg, p = [], 0
        for k in steps:
            lg.append(smol.forward(cache, [seq], [p], [k], ids[p:p + k],
                                   want_logits=np.ones(k, bool), num_threads=2))
            p += k
        pages = cache.page_table([seq])[1]
        full = n // cache.kv_group * cache.kv_group // cache.page_size  # complete K groups
        kv = [cache.kvfmt_pages(layer)[pages[:full]].copy() for layer in (1, 15, 29)]
        runs.append((np.concatenate(lg)[-tail:], kv))
        cache.check()
    assert np.array_equal(runs[0][0], runs[1][0]), float(np.abs(runs[0][0] - runs[1][0]).max())
    for a, b in zip(runs[0][1], runs[1][1]):
        assert np.array_equal(a, b)


@needs_model
@pytest.mark.parametrize("fmt", ["kivi8", "kivi4"])
def test_prefix_hit_computes_what_a_fresh_sequence_does(smol, text_ids, fmt):
    # b shares a's first 150 tokens: it reuses a's first two K groups (128
    # tokens) and, for kivi4, the sink row of position 0 kept with a's first
    # page; its logits equal those of b computed alone, bit for bit
    a, b = text_ids[:200], text_ids[:150] + text_ids[600:660]
    cache = smol.new_cache(1024, kv_dtype=fmt)
    sa, hit = cache.add_sequence(a)
    assert hit == 0
    smol.forward(cache, [sa], [0], [len(a)], a, num_threads=2)
    sb, hit = cache.add_sequence(b)
    assert hit == 128
    got = smol.forward(cache, [sb], [hit], [len(b) - hit], b[hit:],
                       want_logits=np.ones(len(b) - hit, bool), num_threads=2)
    fresh = smol.new_cache(1024, kv_dtype=fmt)
    sf, _ = fresh.add_sequence(len(b))
    want = smol.forward(fresh, [sf], [0], [len(b)], b, want_logits=np.ones(len(b), bool),
                        num_threads=2)[hit:]
    assert np.array_equal(got, want), float(np.abs(got - want).max())
    if fmt == "kivi4":  # the shared sink row is a's, and it is position 0's
        np.testing.assert_array_equal(cache.sink(sb, 7), cache.sink(sa, 7))
        np.testing.assert_array_equal(cache.sink(sb, 7), fresh.sink(sf, 7))
        assert cache.sink(sb, 7).any()
    cache.check()


@needs_model
@pytest.mark.parametrize("fmt", ["kivi8", "kivi4"])
def test_batched_equals_alone(smol, text_ids, fmt):
    # prompts crossing K groups (64 tokens), two sharing a 150-token prefix
    prompts = [text_ids[:150], text_ids[:150] + text_ids[300:340], text_ids[500:570],
               text_ids[700:720]]
    alone = [smol.generate([p], 10, kv_dtype=fmt, ignore_eos=True, num_threads=2)[0]
             for p in prompts]
    together = smol.generate(prompts, 10, kv_dtype=fmt, ignore_eos=True, num_threads=2,
                             max_step_tokens=64)
    assert together == alone


@needs_model
def test_compressed_cache_reports_its_format(smol):
    cache = smol.new_cache(256, kv_dtype="kivi4")
    assert cache.kv_format == "kivi4"
    assert cache.bytes_per_token == 6480  # 30 layers * (192 + 12 + 12), KV_FORMATS.md section 5
    with pytest.raises(kvcache.InvalidArgumentError, match="kivi8"):
        smol.new_cache(256, kv_dtype="kivi3")
