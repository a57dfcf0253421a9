"""reshape_and_cache_flash on the Host platform, bit-exact against the reference:
every source dtype x cache format (float, float8 e4m3/e5m2, uint8 with a format),
int32 and int64 slots, -1 padding and out-of-range slots skipped, poisoned caches
(untouched slots keep their bits), saturation/NaN/inf/subnormals, and the write
proven in place under donation."""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import xla_attn
from xla_attn import jax as xj
from xla_attn.testing import reference as ref

# jax >= 0.8 has jax.enable_x64; 0.7.x only jax.experimental.enable_x64.
if hasattr(jax, "enable_x64"):
    enable_x64 = jax.enable_x64
else:
    from jax.experimental import enable_x64


SRC = ["float32", "float16", "bfloat16"]
# (cache storage dtype, kv_cache_dtype); None storage = the source dtype
FORMATS = [(None, "auto"), ("float8_e4m3fn", "fp8"), ("float8_e4m3fn", "fp8_e4m3"),
           ("float8_e5m2", "fp8_e5m2"), ("uint8", "fp8"), ("uint8", "fp8_e4m3"),
           ("uint8", "fp8_e5m2"), ("float8_e4m3fn", "auto"), ("float8_e5m2", "auto")]
FORMAT_IDS = [f"{c or 'same'}-{k}" for c, k in FORMATS]


def make_case(rng, mk, src, storage, num_tokens=12, num_blocks=5, block_size=16, heads_k=2,
              head_dim=32, slot_dtype=np.int32, specials=True):
    """Source tokens (large enough to saturate e4m3 after scaling, plus +-NaN, +-inf,
    subnormals and -0 when `specials`), caches full of random bits, and distinct
    slots mixed with -1, out-of-range and negative entries."""
    shape = (num_tokens, heads_k, head_dim)
    key = mk.random_array(rng, shape, src, scale=100.0)
    value = mk.random_array(rng, shape, src, scale=100.0)
    if specials:
        vals = np.array([np.nan, -np.nan, np.inf, -np.inf, 1e-6, -1e-6, -0.0, 3e-3, 1e5, -7e4, 448.0,
                         -57344.0, 0.3], np.float64)
        for arr in (key, value):
            flat = arr.reshape(-1)
            idx = rng.choice(flat.size, len(vals), replace=False)
            with np.errstate(over="ignore"):  # 1e5 is inf in float16: intended
                flat[idx] = vals.astype(arr.dtype)
    cache_dtype = storage or src
    cache_shape = (num_blocks, block_size, heads_k, head_dim)
    key_cache = mk.random_bits(rng, cache_shape, cache_dtype)
    value_cache = mk.random_bits(rng, cache_shape, cache_dtype)
    num_slots = num_blocks * block_size
    slots = rng.permutation(num_slots)[:num_tokens].astype(np.int64)
    if num_tokens >= 6:
        slots[[1, 4]] = -1                  # padding
        slots[2] = num_slots                # one past the end
        slots[5] = -5 if num_tokens > 6 else num_slots + 1000
    return dict(key=key, value=value, key_cache=key_cache, value_cache=value_cache,
                slot_mapping=slots.astype(slot_dtype))


def run(case, fn=None, **kw):
    fn = fn or xla_attn.reshape_and_cache_flash
    args = {n: jnp.asarray(x) for n, x in case.items()}
    extra = {n: (jnp.asarray(x) if isinstance(x, np.ndarray) else x) for n, x in kw.items()}
    kc, vc = fn(**args, **extra)
    assert kc.shape == case["key_cache"].shape and vc.shape == case["value_cache"].shape
    assert kc.dtype == case["key_cache"].dtype and vc.dtype == case["value_cache"].dtype
    return np.asarray(kc), np.asarray(vc)


def check(case, **kw):
    got = run(case, **kw)
    scales = {n: (1.0 if kw.get(n) is None else kw[n]) for n in ("k_scale", "v_scale")}
    want = ref.reshape_and_cache_flash_ref(**case, kv_cache_dtype=kw.get("kv_cache_dtype", "auto"),
                                           **scales)
    for name, g, w in zip(("key_cache", "value_cache"), got, want):
        try:
            ref.assert_bits_equal(g, w)
        except AssertionError as e:
            raise AssertionError(f"{name}: {e}") from None
    return got


def _scales(mk, storage):
    if storage is None:
        return {}
    return dict(k_scale=mk.f32(0.37), v_scale=mk.f32([2.5]))


@pytest.mark.parametrize("src", SRC)
@pytest.mark.parametrize("fmt", FORMATS, ids=FORMAT_IDS)
def test_write_int32_slots(rng, mk, src, fmt):
    storage, kv_cache_dtype = fmt
    case = make_case(rng, mk, src, storage)
    check(case, kv_cache_dtype=kv_cache_dtype, **_scales(mk, storage))


@pytest.mark.parametrize("src", SRC)
@pytest.mark.parametrize("fmt", FORMATS, ids=FORMAT_IDS)
def test_write_int64_slots(rng, mk, src, fmt):
    storage, kv_cache_dtype = fmt
    with enable_x64(True):
        case = make_case(rng, mk, src, storage, slot_dtype=np.int64)
        case["slot_mapping"][3] = 2 ** 40  # out of range only as a 64-bit value
        assert jnp.asarray(case["slot_mapping"]).dtype == jnp.int64
        check(case, kv_cache_dtype=kv_cache_dtype, **_scales(mk, storage))


def test_int64_slot_beyond_int32_is_skipped_not_wrapped(rng, mk):
    """2**32 + 3 must not land in slot 3."""
    with enable_x64(True):
        case = make_case(rng, mk, "float32", None, num_tokens=4, specials=False,
                         slot_dtype=np.int64)
        case["slot_mapping"] = np.array([2 ** 32 + 3, 7, -1, 2 ** 33], np.int64)
        kc, _ = check(case)
        np.testing.assert_array_equal(kc.reshape(-1, 2, 32)[3],
                                      case["key_cache"].reshape(-1, 2, 32)[3])


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("head_dim", [32, 64, 128, 256])
def test_layouts(rng, mk, block_size, head_dim):
    for storage, kv_cache_dtype in ((None, "auto"), ("uint8", "fp8")):
        case = make_case(rng, mk, "bfloat16", storage, num_tokens=9, num_blocks=3,
                         block_size=block_size, heads_k=4, head_dim=head_dim)
        check(case, kv_cache_dtype=kv_cache_dtype, **_scales(mk, storage))


@pytest.mark.parametrize("fmt", FORMATS[1:7], ids=FORMAT_IDS[1:7])
def test_fp8_default_scales(rng, mk, fmt):
    """No scales given: 1.0."""
    storage, kv_cache_dtype = fmt
    case = make_case(rng, mk, "bfloat16", storage)
    check(case, kv_cache_dtype=kv_cache_dtype)


def test_fp8_key_and_value_scales_differ(rng, mk):
    """k_scale quantizes keys and v_scale values (not the other way round)."""
    case = make_case(rng, mk, "float32", "float8_e4m3fn", specials=False)
    case["value"] = case["key"].copy()
    kc, vc = check(case, kv_cache_dtype="fp8", k_scale=mk.f32(0.5), v_scale=mk.f32(8.0))
    assert not np.array_equal(kc.view(np.uint8), vc.view(np.uint8))


def _quotients_at_fp8_midpoints(fmt, scale):
    """float32 sources x whose x / scale is exactly the midpoint of two neighbouring
    `fmt` values while x * RN(1 / scale) is one ulp off it: there division and
    multiplication by the reciprocal encode differently (round-half-even against the
    nearer neighbour)."""
    codes = np.arange(256, dtype=np.uint8).view(fmt).astype(np.float32)
    vals = np.unique(codes[np.isfinite(codes) & (codes > 0)])
    mids = ((vals[:-1].astype(np.float64) + vals[1:]) / 2).astype(np.float32)
    x = (mids * scale).astype(np.float32)
    quotient = (x / scale).astype(np.float32)
    by_reciprocal = (x * (np.float32(1) / scale)).astype(np.float32)
    differ = (quotient == mids) & (quotient.astype(fmt).view(np.uint8) !=
                                   by_reciprocal.astype(fmt).view(np.uint8))
    return x[differ]


@pytest.mark.parametrize("storage", ["float8_e4m3fn", "float8_e5m2"])
def test_fp8_quantizes_by_division_not_the_reciprocal(rng, mk, storage):
    """x / scale, rounded as IEEE single division (vLLM's formula), at the inputs where
    x * (1 / scale) would encode one fp8 step away; the CUDA kernel's reciprocal with
    its residual step (cache/write_portable.cuh) must match these bit for bit too."""
    scale = np.float32(15.25)  # 61-63 of the formats' ~125 midpoints tell them apart
    fmt = ref.FP8_DTYPES[storage]
    x = _quotients_at_fp8_midpoints(fmt, scale)
    assert len(x) >= 40, len(x)
    case = make_case(rng, mk, "float32", storage, num_tokens=8, heads_k=2, head_dim=8,
                     specials=False)
    case["slot_mapping"] = rng.permutation(80)[:8].astype(np.int32)
    for name in ("key", "value"):
        flat = np.resize(np.concatenate([x, -x]), case[name].size).astype(np.float32)
        case[name] = rng.permutation(flat).reshape(case[name].shape)
    kc, _ = check(case, kv_cache_dtype="auto", k_scale=mk.f32(scale), v_scale=mk.f32(scale))
    rows = kc.reshape(-1, 2, 8)[case["slot_mapping"]]
    by_reciprocal = (case["key"] * (np.float32(1) / scale)).astype(np.float32).astype(fmt)
    assert np.sum(rows.view(np.uint8) != by_reciprocal.view(np.uint8)) >= 40


def test_duplicate_slots_take_the_later_token_on_host(rng, mk):
    """Two tokens for one slot: the Host writes the later one's rows (a GPU writes them
    concurrently, so there the row is unspecified: docs/xla-targets.md)."""
    case = make_case(rng, mk, "bfloat16", None, num_tokens=6, specials=False)
    case["slot_mapping"] = np.array([9, 3, 9, -1, 3, 9], np.int32)
    kc, vc = check(case)
    for got, new in ((kc, case["key"]), (vc, case["value"])):
        rows = got.reshape(-1, *new.shape[1:])
        ref.assert_bits_equal(rows[9], new[5])
        ref.assert_bits_equal(rows[3], new[4])


def test_all_padding_changes_nothing(rng, mk):
    case = make_case(rng, mk, "float16", None, num_tokens=5, specials=False)
    case["slot_mapping"] = np.full(5, -1, np.int32)
    kc, vc = check(case)
    ref.assert_bits_equal(kc, case["key_cache"])
    ref.assert_bits_equal(vc, case["value_cache"])


def test_no_tokens(rng, mk):
    case = make_case(rng, mk, "bfloat16", None, num_tokens=0, specials=False)
    kc, _ = check(case)
    ref.assert_bits_equal(kc, case["key_cache"])


def test_inputs_keep_their_values_without_donation(rng, mk):
    """Functional semantics: with no donation, the caches passed in are unchanged
    (eager and under jit), and the results are new arrays."""
    case = make_case(rng, mk, "bfloat16", None)
    args = {n: jnp.asarray(x) for n, x in case.items()}
    for fn in (xla_attn.reshape_and_cache_flash, jax.jit(xj.reshape_and_cache_flash)):
        kc, vc = fn(**args)
        ref.assert_bits_equal(np.asarray(args["key_cache"]), case["key_cache"])
        ref.assert_bits_equal(np.asarray(args["value_cache"]), case["value_cache"])
        want = ref.reshape_and_cache_flash_ref(**case)
        ref.assert_bits_equal(np.asarray(kc), want[0])
        ref.assert_bits_equal(np.asarray(vc), want[1])


def test_chained_writes(rng, mk):
    """Decode-style: several steps, each writing into the previous step's cache."""
    case = make_case(rng, mk, "bfloat16", "uint8", num_tokens=3, specials=False)
    kc, vc = jnp.asarray(case["key_cache"]), jnp.asarray(case["value_cache"])
    want_k, want_v = case["key_cache"], case["value_cache"]
    step = jax.jit(functools.partial(xj.reshape_and_cache_flash, kv_cache_dtype="fp8"),
                   donate_argnums=(2, 3))
    for t in range(4):
        key = mk.random_array(rng, (3, 2, 32), "bfloat16")
        value = mk.random_array(rng, (3, 2, 32), "bfloat16")
        slots = np.array([t, 16 + t, -1], np.int32)
        kc, vc = step(jnp.asarray(key), jnp.asarray(value), kc, vc, jnp.asarray(slots),
                      k_scale=jnp.asarray(0.5, jnp.float32), v_scale=jnp.asarray(0.25, jnp.float32))
        want_k, want_v = ref.reshape_and_cache_flash_ref(key, value, want_k, want_v, slots, "fp8",
                                                         0.5, 0.25)
    ref.assert_bits_equal(np.asarray(kc), want_k)
    ref.assert_bits_equal(np.asarray(vc), want_v)


# ------------------------------------------------------------------ in place
_COPY = re.compile(r"=\s*(\w+)\[([\d,]*)\]\S*\s+(copy|copy-start)\(")


def _copies_of(hlo_text: str, shape) -> list[str]:
    dims = ",".join(str(d) for d in shape)
    return [line.strip() for line in hlo_text.splitlines()
            if (m := _COPY.search(line)) and m.group(2) == dims]


def _fresh(x):
    """A device buffer of x's own (not borrowed from a numpy array)."""
    return jax.device_put(jnp.array(x, copy=True))


@pytest.mark.parametrize("fmt", [(None, "auto"), ("float8_e4m3fn", "fp8"), ("uint8", "fp8_e5m2")],
                         ids=["same", "float8", "uint8"])
def test_write_is_in_place_under_donation(rng, mk, fmt):
    storage, kv_cache_dtype = fmt
    case = make_case(rng, mk, "bfloat16", storage, specials=False)
    scales = _scales(mk, storage)
    fn = jax.jit(functools.partial(xj.reshape_and_cache_flash, kv_cache_dtype=kv_cache_dtype),
                 donate_argnums=(2, 3))
    args = [jnp.asarray(case[n]) for n in ("key", "value", "key_cache", "value_cache",
                                           "slot_mapping")]
    jscales = {n: jnp.asarray(x) for n, x in scales.items()}
    text = fn.lower(*args, **jscales).compile().as_text()
    assert "input_output_alias" in text
    copies = _copies_of(text, case["key_cache"].shape)
    assert not copies, "the compiled program copies the cache:\n" + "\n".join(copies)

    args[2], args[3] = _fresh(case["key_cache"]), _fresh(case["value_cache"])
    pointers = [args[2].unsafe_buffer_pointer(), args[3].unsafe_buffer_pointer()]
    kc, vc = fn(*args, **jscales)
    assert [kc.unsafe_buffer_pointer(), vc.unsafe_buffer_pointer()] == pointers
    want = ref.reshape_and_cache_flash_ref(**case, kv_cache_dtype=kv_cache_dtype,
                                           **{n: scales.get(n, 1.0) for n in ("k_scale",
                                                                              "v_scale")})
    ref.assert_bits_equal(np.asarray(kc), want[0])
    ref.assert_bits_equal(np.asarray(vc), want[1])


def test_aliasing_is_declared_without_jit_donation(rng, mk):
    """The custom call itself aliases its results onto the cache operands."""
    case = make_case(rng, mk, "float16", None, specials=False)
    args = [jnp.asarray(case[n]) for n in ("key", "value", "key_cache", "value_cache",
                                           "slot_mapping")]
    text = jax.jit(xj.reshape_and_cache_flash).lower(*args).as_text()
    assert "output_operand_aliases" in text
    assert "xla_attn_reshape_and_cache_flash_v1" in text


def test_decode_step_moves_no_cache_copy(rng, mk):
    """A serving decode step in one jit — write the new tokens' K/V, then attend over
    the paged cache — with the caches donated: both caches are aliased through, no
    copy of either exists in the compiled program, the buffers are reused, and the
    attention sees the tokens just written."""
    num_blocks, block_size, heads, heads_k, dim, seqs = 12, 16, 4, 2, 32, 3
    shape = (num_blocks, block_size, heads_k, dim)
    kc = mk.random_array(rng, shape, "bfloat16")
    vc = mk.random_array(rng, shape, "bfloat16")
    tables = rng.permutation(num_blocks).astype(np.int32).reshape(seqs, 4)
    seq_lens = np.array([17, 40, 5], np.int32)
    # The newest token of each sequence (position seq_len - 1) is written this step.
    slots, new_k, new_v, query, qsl = mk.decode_step_tokens(rng, tables, seq_lens, block_size,
                                                            heads, heads_k, dim)

    def step(kc, vc, q, k, v, slots, seq_lens, tables, qsl):
        kc, vc = xj.reshape_and_cache_flash(k, v, kc, vc, slots)
        return kc, vc, xj.paged_attention(q, kc, vc, seq_lens, tables, qsl, 0.2)

    fn = jax.jit(step, donate_argnums=(0, 1))
    args = [_fresh(kc), _fresh(vc)] + [jnp.asarray(x) for x in
                                       (query, new_k, new_v, slots, seq_lens, tables, qsl)]
    text = fn.lower(*args).compile().as_text()
    assert "input_output_alias" in text
    copies = _copies_of(text, shape)
    assert not copies, "the decode step copies a cache:\n" + "\n".join(copies)

    pointers = [args[0].unsafe_buffer_pointer(), args[1].unsafe_buffer_pointer()]
    got_k, got_v, out = fn(*args)
    assert [got_k.unsafe_buffer_pointer(), got_v.unsafe_buffer_pointer()] == pointers
    want_k, want_v = ref.reshape_and_cache_flash_ref(new_k, new_v, kc, vc, slots)
    ref.assert_bits_equal(np.asarray(got_k), want_k)
    want = ref.paged_attention_ref(query, want_k, want_v, seq_lens, tables, qsl, 0.2)
    ref.assert_attention_close(out, want, "bfloat16")
