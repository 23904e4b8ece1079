"""Model runtime (kvcache.Model / Engine) against an independent numpy llama
(llama_reference.py, weights dequantized by the `gguf` package), the cache
exactness of seed 001, and continuous batching.

Tolerances. For quantized weights (Q8_0/Q4_0/Q4_1/Q5_0/Q5_1/IQ4_NL) the C matrix kernels
quantize activations to int16 per 32-element block (an error of at most
amax/65534 per element; int8, as llama.cpp uses, flipped greedy tokens of the
default model); float weights use float32 products. Logits are compared as
max|c - ref| <= TOL * max|ref| with TOL = 2e-4 (float weights) or 1e-3
(quantized; measured 3-4e-5), 5e-3 on the default model (measured 3e-4), plus
agreement of the arg-max wherever the reference's top-2 margin exceeds 4x the
error.

KV storage types (every decode step compared, teacher-forced). Errors are
max|c - ref| over a step's logits divided by that step's logit range
(max - min of the reference row):
- tiny models against the numpy llama whose K/V take the same storage round
  trip (kvc_reference.quantize, group 8, float16 scales): measured < 5e-6
  (float weights) and <= 2.2e-4 (quantized weights) for every storage type;
  the TOL above applies. A decode kernel whose int8/int4 scales are 5% off
  (tried) gives 0.02-0.05. Coarse storage is the exception: K/V are ~1e-5
  (quantized weights) or ~1e-7 (float weights) off numpy's, so a value that
  close to a rounding boundary takes the other code (seen: a ratio 3.4e-5
  from 0.5, one value of 1,920 in layer 0) and everything after it moves.
  Over 40 generator seeds max|c - ref| / max|ref| reached 0.11% (int8) and
  1.1% (int4) with quantized weights, 0.031% (int4) and 0.035% (bfloat16)
  with float weights: checked at 5e-3, 3e-2, 2e-3 and 1e-3 (GRID_SIM_TOL).
- tiny models against float32 storage: measured float16 2e-4, bfloat16 1e-3,
  int8 3.3e-3, int4 5.4e-2 (max over steps); checked at 1e-3, 4e-3, 1e-2, 0.1,
  with the same arg-max at every step.
- the default model against float32 storage, 16 steps: measured max 5.6e-4
  (float16), 4.1e-3 (bfloat16), 1.25e-2 (int8; 6.5e-2 with the 5%-off scales),
  0.28 (int4: 4-bit keys move this model's attention a lot, and the numpy
  llama with the same int4 round trip is no closer, 0.26); checked at 2e-3,
  1e-2, 2.5e-2 and max 0.4 / mean 0.25 for int4; arg-max agreement measured
  16/16 except int4 14/16, required 16/16 and >= 12/16.
"""

from __future__ import annotations

import os
import struct
from pathlib import Path

import numpy as np
import pytest

import kvcache
from kvcache.model import Engine, Model

gguf = pytest.importorskip("gguf", reason="the gguf package (python/requirements.txt) reads the "
                                          "reference weights")
import kvc_reference  # noqa: E402
import skip_check  # noqa: E402
from llama_reference import LlamaReference  # noqa: E402

try:
    from kvcache.gguf_writer import write_tiny_llama
except ImportError:  # pragma: no cover - the writer ships with the package
    write_tiny_llama = None

REPO = Path(__file__).resolve().parents[2]
DEFAULT_MODEL = REPO / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"

FLOAT_TYPES = ("F32", "F16", "BF16")


def _tol(types):
    return 2e-4 if all(t in FLOAT_TYPES for t in types) else 1e-3


def _check_logits(c, ref, tol):
    c = np.asarray(c, np.float64)
    scale = np.abs(ref).max()
    err = np.abs(c - ref).max()
    assert err <= tol * scale, f"max |c - ref| = {err:.3g} > {tol} * {scale:.3g}"
    top2 = np.sort(ref, axis=-1)[..., -2:]
    clear = (top2[..., 1] - top2[..., 0]) > 4 * err
    assert np.array_equal(c.argmax(-1)[clear], ref.argmax(-1)[clear])


_ALL = ("token_embd", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up",
        "ffn_down", "output")


def _types(default, **over):
    d = {k: default for k in _ALL}
    d.update(over)
    return d


TINY_CONFIGS = {
    "f32": dict(weight_types=_types("F32"), tied_output=False, n_head=4, n_head_kv=4),
    "mixed_gqa": dict(weight_types=_types("Q4_1", attn_q="Q4_0", attn_k="Q8_0", attn_v="F16",
                                          ffn_down="BF16", token_embd="Q8_0", output="Q4_0"),
                      tied_output=False, n_head=4, n_head_kv=2),
    "tied_gqa": dict(weight_types=_types("Q4_1", token_embd="Q8_0"), tied_output=True,
                     n_head=6, n_head_kv=2),
    # Q5_0 / Q5_1 (what llama.cpp's Q4_K_M / Q5_K_M files use for matrices
    # whose input dimension is not a multiple of 256) and IQ4_NL; tied: the
    # output product reads the Q5_0 embedding
    "q5_iq4nl_tied": dict(weight_types=_types("Q5_1", attn_q="Q5_0", attn_v="Q5_0",
                                              ffn_down="Q5_0", attn_k="IQ4_NL",
                                              ffn_up="IQ4_NL", token_embd="Q5_0"),
                          tied_output=True, n_head=4, n_head_kv=2),
    "float_gqa": dict(weight_types=_types("F16", ffn_up="BF16", token_embd="F32"),
                      tied_output=True, n_head=4, n_head_kv=1),
    # the variants: qwen2 (q/k/v biases, NEOX rope), and a llama with every
    # bias, Llama 3.1's rope frequency factors and linear rope scaling
    "qwen2_gqa": dict(arch="qwen2", weight_types=_types("Q8_0", attn_q="Q4_0", ffn_up="F16"),
                      tied_output=True, n_head=4, n_head_kv=2),
    "llama31_gqa": dict(weight_types=_types("Q4_1", token_embd="Q8_0", attn_v="F16"),
                        tied_output=False, n_head=4, n_head_kv=2, rope_freqs=True,
                        rope_scaling=2.0, biases=("attn_q", "attn_k", "attn_v", "attn_output",
                                                  "ffn_gate", "ffn_up", "ffn_down")),
}


def _types_of(cfg):
    t = dict(cfg["weight_types"])
    if cfg["tied_output"]:
        t.pop("output")
    return set(t.values())


@pytest.fixture(scope="module", params=sorted(TINY_CONFIGS))
def tiny(request, tmp_path_factory):
    if write_tiny_llama is None:
        pytest.fail("kvcache.gguf_writer.write_tiny_llama is missing")
    cfg = TINY_CONFIGS[request.param]
    path = tmp_path_factory.mktemp("tiny") / f"tiny_{request.param}.gguf"
    write_tiny_llama(path, n_layer=2, n_embd=96 if cfg["n_head"] == 6 else 64, n_ff=128,
                     seed=7, **cfg)
    m = Model(path)
    yield request.param, cfg, m, LlamaReference(str(path))
    m.close()


def test_tiny_logits_match_numpy_reference(tiny):
    name, cfg, m, ref = tiny
    rng = np.random.default_rng(1)
    toks = rng.integers(0, m.n_vocab, size=37)
    want = ref.logits(toks)
    c = m.eval(toks, kv_dtype="float32", num_threads=2)
    _check_logits(c, want, _tol(_types_of(cfg)))
    # rows from 20 on through the decode kernel, as the engine generates
    c = m.eval(toks, kv_dtype="float32", num_threads=2, decode_from=20)
    _check_logits(c, want, _tol(_types_of(cfg)))
    with pytest.raises(kvcache.InvalidArgumentError, match="decode_from"):  # no int64 wrap
        m.eval(toks, kv_dtype="float32", decode_from=2**64 + 20)


def test_tiny_eval_threads_and_isas_agree(tiny):
    _, _, m, _ = tiny
    toks = np.arange(1, 30) % m.n_vocab
    base = m.eval(toks, num_threads=1)
    assert np.array_equal(base, m.eval(toks, num_threads=2))
    for isa in skip_check.isas_to_run("test_model.py::test_tiny_eval_threads_and_isas_agree"):
        with _isa(isa):
            other = m.eval(toks, num_threads=2)
        np.testing.assert_allclose(other, base, rtol=1e-3, atol=1e-3 * np.abs(base).max())


class _isa:
    def __init__(self, name):
        self.name = name

    def __enter__(self):
        self.old = kvcache.get_isa()
        kvcache.set_isa(self.name)

    def __exit__(self, *exc):
        kvcache.set_isa(self.old)


def _greedy_with_cache(m, prompt, n_new, kv_dtype, page_size=4):
    """Seed 001: prefill the prompt, then one token per step reusing the
    cached K/V (generated tokens through the decode kernel, as the engine
    does). Returns (tokens, logits per step)."""
    cache = m.new_cache(len(prompt) + n_new + page_size, kv_dtype=kv_dtype, page_size=page_size)
    seq, _ = cache.add_sequence(len(prompt))
    dec = [len(prompt)]
    lg = m.forward(cache, [seq], [0], [len(prompt)], prompt, decode_from=dec)[0]
    toks, logits = [], [lg]
    for _ in range(n_new):
        t = int(np.argmax(logits[-1]))
        toks.append(t)
        if len(toks) == n_new:
            break
        pos = len(prompt) + len(toks) - 1
        cache.append(seq, 1)
        logits.append(m.forward(cache, [seq], [pos], [1], [t], decode_from=dec)[0])
    return toks, np.array(logits)


def _greedy_recompute(m, prompt, n_new, decode_from=None):
    """Recomputes the whole sequence from scratch every step."""
    seq = list(prompt)
    toks, logits = [], []
    for _ in range(n_new):
        lg = m.eval(seq, kv_dtype="float32", decode_from=decode_from)[-1]
        logits.append(lg)
        t = int(np.argmax(lg))
        toks.append(t)
        seq.append(t)
    return toks, np.array(logits)


def _check_exact(m, prompt, n_new, page_size):
    a_tok, a_lg = _greedy_with_cache(m, prompt, n_new, "float32", page_size=page_size)
    # bitwise, against recomputation with the same kernel split (prompt rows
    # through prefill, generated rows through decode): every stage is
    # row-independent, so the cache changes nothing
    b_tok, b_lg = _greedy_recompute(m, prompt, n_new, decode_from=len(prompt))
    assert a_tok == b_tok
    assert np.array_equal(a_lg, b_lg)
    # and token for token against recomputation by prefill alone (the two
    # kernels sum in different orders: attention agrees to float32 rounding,
    # which the int16 activation rounding of quantized weights can amplify
    # to ~1e-4 of the logit range)
    c_tok, c_lg = _greedy_recompute(m, prompt, n_new)
    assert a_tok == c_tok
    np.testing.assert_allclose(a_lg, c_lg, rtol=0, atol=1e-3 * np.abs(c_lg).max())
    return a_tok, a_lg


def test_tiny_cache_is_exact_float32(tiny):
    _, _, m, _ = tiny
    _check_exact(m, [3, 1, 4, 1, 5, 9, 2, 6], 40, 16)  # eval pages hold 16 tokens too


def _storage_round_trip(kv_dtype, group=8):
    """K/V as the cache stores them (Model.new_cache: group 8, float16
    scales), from the spec's reference quantizer, for LlamaReference."""
    if kv_dtype in ("float16", "bfloat16"):
        dt = kvc_reference.F16 if kv_dtype == "float16" else kvc_reference.BF16
        return lambda x: np.asarray(x, np.float32).astype(dt).astype(np.float32)
    bits = {"int8": 8, "int4": 4}[kv_dtype]

    def f(x):
        q, s = kvc_reference.quantize(x, bits, group, kvc_reference.F16)
        return kvc_reference.dequantize(q, s, group, kvc_reference.F32)
    return f


def _step_errors(c, ref):
    """Per step (row): max|c - ref| / (max - min of the ref row), and whether
    the arg-max agrees."""
    c, ref = np.asarray(c, np.float64), np.asarray(ref, np.float64)
    err = np.abs(c - ref).max(-1) / (ref.max(-1) - ref.min(-1))
    return err, c.argmax(-1) == ref.argmax(-1)


# max|c - ref| / max|ref| allowed against the numpy llama's storage round
# trip where a rounding flip moves more than TOL allows, by (quantized
# weights, storage) (module docstring)
GRID_SIM_TOL = {(True, "int8"): 5e-3, (True, "int4"): 3e-2, (False, "int4"): 2e-3,
                (False, "bfloat16"): 1e-3}

# max error against float32 storage per step, relative to the logit range
# (measured 2e-4, 1e-3, 3.3e-3, 5.4e-2: module docstring)
TINY_STORAGE_TOL = {"float16": 1e-3, "bfloat16": 4e-3, "int8": 1e-2, "int4": 0.1}


@pytest.mark.parametrize("kv_dtype", sorted(TINY_STORAGE_TOL))
def test_tiny_cache_quantized_storage_close(tiny, kv_dtype):
    """Every decode step with K/V stored as kv_dtype, teacher-forced with the
    float32 run's tokens: against the numpy llama given the same storage
    round trip (tight: the kernels' scales and rounding), and against float32
    storage (what the format costs)."""
    name, cfg, m, ref = tiny
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    ref_tok, ref_lg = _greedy_with_cache(m, prompt, 8, "float32")
    cache = m.new_cache(32, kv_dtype=kv_dtype, page_size=4)
    seq, _ = cache.add_sequence(len(prompt) + len(ref_tok) - 1)
    allt = prompt + ref_tok[:-1]
    want = np.zeros(len(allt), np.uint8)
    want[len(prompt) - 1:] = 1
    lg = m.forward(cache, [seq], [0], [len(allt)], allt, want_logits=want,
                   decode_from=[len(prompt)])
    assert lg.shape == ref_lg.shape == (8, m.n_vocab)
    sim = ref.logits(allt, kv_store=_storage_round_trip(kv_dtype))[len(prompt) - 1:]
    types = _types_of(cfg)
    quantized_weights = not types <= set(FLOAT_TYPES)
    _check_logits(lg, sim, GRID_SIM_TOL.get((quantized_weights, kv_dtype), _tol(types)))
    err, same = _step_errors(lg, ref_lg)
    assert err.max() <= TINY_STORAGE_TOL[kv_dtype], (name, kv_dtype, err)
    # The arg-max may differ only at a near tie: where the float32 run's top
    # logit beats the chosen one by less than twice the step's error (a
    # random tiny model has such ties; int4 on llama31_gqa flips two).
    c64, r64 = np.asarray(lg, np.float64), np.asarray(ref_lg, np.float64)
    for i in np.flatnonzero(~same):
        margin = r64[i].max() - r64[i, c64[i].argmax()]
        assert margin <= 2 * np.abs(c64[i] - r64[i]).max(), (name, kv_dtype, i, margin)
    # int4 moves this random model's near ties often: 5 of 8 steps agreed for
    # 3 of 40 generator seeds (each miss a near tie, as checked above)
    assert same.mean() >= (0.5 if kv_dtype == "int4" else 0.75), (name, kv_dtype, same)


def test_tiny_batched_equals_alone(tiny):
    _, _, m, _ = tiny
    rng = np.random.default_rng(5)
    prompts = [list(rng.integers(0, m.n_vocab, size=n)) for n in (5, 17, 9, 30)]
    prompts.append(prompts[1][:12] + [1, 2])  # shares a prefix with prompt 1
    alone = [m.generate([p], 8, kv_dtype="float16", ignore_eos=True, page_size=4)[0]
             for p in prompts]
    together = m.generate(prompts, 8, kv_dtype="float16", ignore_eos=True, page_size=4,
                          max_step_tokens=16)
    assert together == alone
    # a cache too small for all at once: preemption by recomputation
    small = m.generate(prompts, 8, kv_dtype="float16", ignore_eos=True, page_size=4,
                       max_step_tokens=16, kv_capacity_tokens=48)
    assert small == alone


def test_engine_prefix_cache_and_preemption_stats(tiny):
    _, _, m, _ = tiny
    p = list(range(1, 41))
    eng = Engine(m, kv_dtype="float32", page_size=4, kv_capacity_tokens=64, max_step_tokens=8)
    a = eng.add_request(p, 4, ignore_eos=True)
    out_a = eng.run()[a]
    b = eng.add_request(p, 4, ignore_eos=True)
    out_b = eng.run()[b]
    assert out_a == out_b
    st = eng.stats()
    assert st["cached_tokens"] >= 36  # all full pages of the first 39 tokens
    assert st["prompt_tokens"] == 80
    eng.close()
    eng = Engine(m, kv_dtype="float32", page_size=4, kv_capacity_tokens=40, max_step_tokens=64,
                 enable_prefix_caching=False)
    ids = [eng.add_request(list(range(k, k + 12)), 8, ignore_eos=True) for k in (1, 2, 3)]
    out = eng.run()
    assert eng.stats()["preemptions"] > 0
    for k, i in zip((1, 2, 3), ids):
        assert out[i] == m.generate([list(range(k, k + 12))], 8, kv_dtype="float32",
                                    ignore_eos=True)[0]
    eng.close()


def test_model_errors(tmp_path):
    with pytest.raises(kvcache.KvcacheError):
        Model(tmp_path / "missing.gguf")
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\x03\x00\x00\x00" + b"\xff" * 8)
    with pytest.raises(kvcache.KvcacheError):
        Model(bad)


def test_read_into_memory_equals_mapped(tmp_path):
    """use_mmap=False (llama.cpp's --no-mmap) reads the file into memory of
    the model's own: the same logits, bit for bit; the same errors."""
    path = tmp_path / "tiny.gguf"
    write_tiny_llama(path, n_layer=2, seed=3)
    toks = np.arange(2, 30) % 64
    with Model(path) as a, Model(path, use_mmap=False) as b:
        np.testing.assert_array_equal(a.eval(toks, num_threads=2), b.eval(toks, num_threads=2))
    with pytest.raises(kvcache.KvcacheIOError, match="cannot open"):
        Model(tmp_path / "missing.gguf", use_mmap=False)
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\x03\x00\x00\x00" + b"\xff" * 8)
    with pytest.raises(kvcache.CorruptError):
        Model(bad, use_mmap=False)
    for wrong in (0, 1, "no", None):
        with pytest.raises(kvcache.InvalidArgumentError, match="use_mmap"):
            Model(path, use_mmap=wrong)


@pytest.mark.parametrize("count", [3, 2**30])
def test_corrupt_block_count_is_refused_before_allocating(tmp_path, count):
    """block_count past the tensors in the file is corrupt metadata, refused
    before the layer table (2^30 entries once meant a 250 GB calloc)."""
    path = tmp_path / "tiny.gguf"
    write_tiny_llama(path, n_layer=2)
    data = bytearray(path.read_bytes())
    key = b"llama.block_count"
    at = data.index(key) + len(key)
    assert struct.unpack_from("<II", data, at) == (4, 2)  # uint32 value 2
    struct.pack_into("<I", data, at + 4, count)
    path.write_bytes(bytes(data))
    with pytest.raises(kvcache.CorruptError, match="block_count"):
        Model(path)


def test_tiny_bad_inputs(tiny):
    _, _, m, _ = tiny
    with pytest.raises(kvcache.InvalidArgumentError):
        m.eval([0, m.n_vocab])
    with pytest.raises(kvcache.InvalidArgumentError):
        m.eval([0, 1], kv_dtype="float64")
    eng = Engine(m, kv_capacity_tokens=32)
    with pytest.raises(kvcache.InvalidArgumentError):
        eng.add_request(list(range(30)), 8)  # can never fit
    with pytest.raises(kvcache.InvalidArgumentError):
        eng.add_request([], 8)
    eng.close()


def test_sampling():
    lg = np.array([0.0, 3.0, 1.0, 3.0], np.float32)
    assert kvcache.model.sample(lg) == 1  # greedy: lowest id among ties
    assert kvcache.model.sample(lg, temperature=1.0, top_k=1) == 1
    counts = np.zeros(4, int)
    state = np.array([123], np.uint64)
    for _ in range(4000):
        counts[kvcache.model.sample(lg, temperature=1.0, state=state)] += 1
    p = np.exp(lg - lg.max())
    p /= p.sum()
    np.testing.assert_allclose(counts / 4000, p, atol=0.03)
    # top_p keeps the smallest prefix with mass >= p: here ids 1 and 3 only
    for _ in range(200):
        assert kvcache.model.sample(lg, temperature=1.0, top_p=0.8, state=state) in (1, 3)
    with pytest.raises(kvcache.InvalidArgumentError):
        kvcache.model.sample(lg, temperature=-1.0)
    # seeds are uint64: the full range is accepted, nothing outside it wraps
    kvcache.model.sample(lg, temperature=1.0, seed=2**64 - 1)
    for bad in (-1, 2**64):
        with pytest.raises(kvcache.InvalidArgumentError, match="seed"):
            kvcache.model.sample(lg, temperature=1.0, seed=bad)


# ---- the default model (downloaded by scripts/fetch_model.sh; CI fetches it) ----

needs_model = pytest.mark.skipif(not DEFAULT_MODEL.exists(),
                                 reason=f"the default model is absent ({DEFAULT_MODEL}): "
                                        "bash scripts/fetch_model.sh")


@pytest.fixture(scope="module")
def smol():
    m = Model(DEFAULT_MODEL)
    yield m
    m.close()


@needs_model
def test_default_model_logits_match_numpy_reference(smol):
    ref = LlamaReference(str(DEFAULT_MODEL), dtype=np.float32)
    toks = [1, 504, 3458, 282, 4649, 314, 30, 3]  # arbitrary in-vocabulary ids
    c = smol.eval(toks, num_threads=2)
    _check_logits(c, ref.logits(toks).astype(np.float64), 5e-3)


@needs_model
def test_default_model_cache_is_exact(smol):
    prompt = [1, 4093, 28, 2683, 314, 260, 3458, 30]
    _check_exact(smol, prompt, 8, 16)


def _decode_steps(m, prompt, n_steps, kv_dtype, forced=None, page_size=16):
    """The engine's way: prefill the prompt, then one forward per generated
    token through the decode kernel; tokens are the greedy ones, or `forced`
    (teacher forcing). Returns (tokens fed, logits (n_steps, n_vocab))."""
    cache = m.new_cache(len(prompt) + n_steps + page_size, kv_dtype=kv_dtype,
                        page_size=page_size)
    seq, _ = cache.add_sequence(len(prompt))
    dec = [len(prompt)]
    logits = [m.forward(cache, [seq], [0], [len(prompt)], prompt, decode_from=dec,
                        num_threads=2)[0]]
    toks = []
    for i in range(n_steps - 1):
        t = int(np.argmax(logits[-1])) if forced is None else forced[i]
        toks.append(t)
        cache.append(seq, 1)
        logits.append(m.forward(cache, [seq], [len(prompt) + i], [1], [t], decode_from=dec,
                                num_threads=2)[0])
    return toks, np.array(logits)


# default model, 16 decode steps against float32 storage (module docstring):
# (max error over steps, mean error over steps, arg-max agreements required)
SMOL_STORAGE_TOL = {"float16": (2e-3, 2e-3, 16), "bfloat16": (1e-2, 1e-2, 16),
                    "int8": (2.5e-2, 2.5e-2, 16), "int4": (0.4, 0.25, 12)}


@pytest.fixture(scope="module")
def smol_float32_steps(smol):
    tok = kvcache.Tokenizer.from_gguf(DEFAULT_MODEL)
    q = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = tok.encode(tok.apply_chat_template(q, add_generation_prompt=True))
    toks, lg = _decode_steps(smol, prompt, 16, "float32")
    assert "Paris" in tok.decode(toks)
    return prompt, toks, lg


@needs_model
@pytest.mark.parametrize("kv_dtype", sorted(SMOL_STORAGE_TOL))
def test_default_model_storage_every_decode_step(smol, smol_float32_steps, kv_dtype):
    """Every one of 16 decode steps with K/V stored as kv_dtype, fed the
    float32 run's tokens, against float32 storage."""
    prompt, toks, ref_lg = smol_float32_steps
    _, lg = _decode_steps(smol, prompt, 16, kv_dtype, forced=toks)
    err, same = _step_errors(lg, ref_lg)
    max_tol, mean_tol, n_same = SMOL_STORAGE_TOL[kv_dtype]
    assert err.max() <= max_tol and err.mean() <= mean_tol, (kv_dtype, np.round(err, 4))
    assert same.sum() >= n_same, (kv_dtype, same)


@needs_model
def test_default_model_answers_through_the_engine(smol):
    """End to end: chat template, tokenizer, batched engine with prefix
    caching and int8/float16 KV storage; greedy answers are deterministic."""
    tok = kvcache.Tokenizer.from_gguf(DEFAULT_MODEL)
    q = [{"role": "user", "content": "What is the capital of France?"}]
    p = tok.encode(tok.apply_chat_template(q, add_generation_prompt=True))
    for kv in ("float16", "int8"):
        outs = smol.generate([p, p, p[:-3]], 12, kv_dtype=kv, num_threads=2)
        assert outs[0] == outs[1]
        text = tok.decode(outs[0])
        assert "Paris" in text, (kv, text)
        assert outs[0][-1] == tok.eot or len(outs[0]) == 12


def test_objects_owning_c_handles_refuse_copy_and_pickle(tmp_path):
    """A copy or pickle would carry the raw pointer and free it twice (the
    copies once aborted with a double free or segfaulted)."""
    import copy
    import pickle

    from kvcache.gguf import GGUFFile

    path = tmp_path / "tiny.gguf"
    write_tiny_llama(path, n_layer=2)
    m = Model(path)
    objs = [m, Engine(m, kv_capacity_tokens=64), m.tokenizer, GGUFFile(path),
            kvcache.Tokenizer.from_gguf(path), kvcache.PagedKVCache(1, 1, 8, 4, num_pages=4),
            kvcache.BatchDecodeWithPagedKVCacheWrapper(), kvcache.BatchPrefillWithPagedKVCacheWrapper(),
            kvcache.BatchPrefillWithRaggedKVCacheWrapper(), kvcache.MultiLevelCascadeAttentionWrapper(2),
            kvcache.BatchMLAPagedAttentionWrapper()]
    for o in objs:
        for f in (copy.copy, copy.deepcopy, pickle.dumps):
            with pytest.raises(TypeError, match="cannot be copied or pickled"):
                f(o)
    assert objs[3].get("llama.block_count") == 2  # the originals still work
    assert objs[2].encode("hi") == objs[4].encode("hi")


def test_borrowed_tokenizer_and_engine_after_model_close(tmp_path):
    """Model.tokenizer borrows the model's tokenizer (Tokenizer(handle) is not
    public: it took ownership and freed the model's); an engine or borrowed
    tokenizer used after Model.close() raises instead of reading freed
    weights (once a segfault)."""
    path = tmp_path / "tiny.gguf"
    write_tiny_llama(path, n_layer=2)
    m = Model(path)
    with pytest.raises(TypeError, match="from_gguf"):
        kvcache.Tokenizer(m.tokenizer_handle)
    tok = m.tokenizer
    ids = tok.encode("hello")
    tok.close()  # detaches only
    assert m.tokenizer.encode("hello") == ids
    e = Engine(m, kv_capacity_tokens=64)
    e.add_request([1, 2, 3], 4)
    tok2 = m.tokenizer
    m.close()
    for call in (e.run, e.step, e.stats, lambda: e.add_request([1], 2), lambda: tok2.encode("x")):
        with pytest.raises(kvcache.InvalidArgumentError, match="closed"):
            call()
    e.close()
    with pytest.raises(kvcache.InvalidArgumentError, match="closed"):
        e.pending


def test_integer_arguments_are_not_truncated(tiny):
    """Token ids and counts beyond int32, floats and bools where integers are
    expected raise instead of wrapping (2**32 + 1 once ran as 1)."""
    _, _, m, _ = tiny
    E = kvcache.InvalidArgumentError
    for bad in (np.array([2**32 + 1, 2, 3]), [1.9, 2.2, 3.7]):
        with pytest.raises(E):
            m.eval(bad)
    eng = Engine(m, kv_capacity_tokens=64)
    with pytest.raises(E):
        eng.add_request(np.array([2**32 + 1]), 2)
    with pytest.raises(E):
        eng.add_request([1, 2], 2**32 + 2)
    with pytest.raises(E):
        eng.cancel(0.5)
    eng.close()
    for kw in ({"page_size": 2**32 + 16}, {"num_threads": 2**32 + 1}, {"max_running": 1.5}):
        with pytest.raises(E):
            Engine(m, **kw)
    with pytest.raises(E):
        Engine(None)
    from kvcache.model import sample
    with pytest.raises(E):
        sample(np.zeros((2, 8), np.float32))
    with pytest.raises(E):
        sample(np.zeros(8, np.float32), top_k=2**32 + 1)
    with pytest.raises(E):
        sample(np.zeros(8, np.float32), state=np.zeros(1, np.int64))
    assert sample(np.arange(8, dtype=np.float32), state=np.zeros(1, np.uint64)) == 7  # greedy
