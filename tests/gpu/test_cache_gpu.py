"""reshape_and_cache_flash on the CUDA device through JAX, bit-exact against the
float64/NumPy reference: every source dtype x cache format (float, float8 e4m3/e5m2,
uint8 with a format), int32 and int64 slots, -1 padding and out-of-range slots,
poisoned caches, saturation/NaN/inf/subnormals, and the write in place under
donation. Skipped where jax sees no GPU."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import xla_attn
from xla_attn import jax as xj
from xla_attn.testing import reference as ref

pytestmark = pytest.mark.gpu

SRC = ["float32", "float16", "bfloat16"]
FORMATS = [(None, "auto"), ("float8_e4m3fn", "fp8"), ("float8_e4m3fn", "fp8_e4m3"),
           ("float8_e5m2", "fp8_e5m2"), ("uint8", "fp8"), ("uint8", "fp8_e4m3"),
           ("uint8", "fp8_e5m2"), ("float8_e4m3fn", "auto"), ("float8_e5m2", "auto")]
FORMAT_IDS = [f"{c or 'same'}-{k}" for c, k in FORMATS]
SHAPES = {"small": (12, 5, 16, 2, 32), "decode": (64, 40, 16, 8, 128),
          "prefill": (700, 64, 32, 4, 256), "odd": (37, 7, 16, 3, 40)}


def make_case(rng, mk, src, storage, num_tokens, num_blocks, block_size, heads_k, head_dim,
              slot_dtype):
    shape = (num_tokens, heads_k, head_dim)
    key = mk.random_array(rng, shape, src, scale=100.0)
    value = mk.random_array(rng, shape, src, scale=100.0)
    specials = np.array([np.nan, -np.nan, np.inf, -np.inf, 1e-6, -1e-6, -0.0, 3e-3, 1e5, -7e4, 448.0,
                         -57344.0, 0.3])
    for arr in (key, value):
        flat = arr.reshape(-1)
        with np.errstate(over="ignore"):  # 1e5 is inf in float16: intended
            flat[rng.choice(flat.size, len(specials), replace=False)] = specials.astype(arr.dtype)
    cache_shape = (num_blocks, block_size, heads_k, head_dim)
    key_cache = mk.random_bits(rng, cache_shape, storage or src)
    value_cache = mk.random_bits(rng, cache_shape, storage or src)
    num_slots = num_blocks * block_size
    slots = rng.permutation(num_slots)[:num_tokens].astype(np.int64)
    slots[rng.choice(num_tokens, num_tokens // 5, replace=False)] = -1
    slots[0] = num_slots          # out of range
    slots[1] = -3                 # negative, not -1
    if slot_dtype == np.int64:
        slots[2] = 2 ** 32 + 1    # would alias slot 1 if truncated to 32 bits
    return dict(key=key, value=value, key_cache=key_cache, value_cache=value_cache,
                slot_mapping=slots.astype(slot_dtype))


def run_and_check(case, device, kv_cache_dtype, scales, jit=False):
    put = lambda x: jax.device_put(jnp.asarray(x), device)
    args = {n: put(x) for n, x in case.items()}
    jscales = {n: put(np.asarray(x, np.float32)) for n, x in scales.items()}
    fn = xla_attn.reshape_and_cache_flash
    if jit:
        fn = jax.jit(functools.partial(xj.reshape_and_cache_flash, kv_cache_dtype=kv_cache_dtype),
                     donate_argnums=(2, 3))
        kc, vc = fn(args["key"], args["value"], args["key_cache"], args["value_cache"],
                    args["slot_mapping"], **jscales)
    else:
        kc, vc = fn(**args, kv_cache_dtype=kv_cache_dtype, **jscales)
    assert kc.devices() == {device}
    want = ref.reshape_and_cache_flash_ref(**case, kv_cache_dtype=kv_cache_dtype,
                                           **{n: scales.get(n, 1.0) for n in ("k_scale",
                                                                              "v_scale")})
    for name, g, w in zip(("key_cache", "value_cache"), (kc, vc), want):
        try:
            ref.assert_bits_equal(np.asarray(g), w)
        except AssertionError as e:
            raise AssertionError(f"{name}: {e}") from None


@pytest.mark.parametrize("src", SRC)
@pytest.mark.parametrize("fmt", FORMATS, ids=FORMAT_IDS)
@pytest.mark.parametrize("slot_dtype", [np.int32, np.int64], ids=["i32", "i64"])
@pytest.mark.parametrize("shape", ["small", "odd"])
def test_reshape_and_cache_flash_gpu(rng, mk, gpu_device, src, fmt, slot_dtype, shape):
    storage, kv_cache_dtype = fmt
    scales = {} if storage is None else dict(k_scale=0.37, v_scale=[2.5])
    with jax.enable_x64(slot_dtype == np.int64):
        case = make_case(rng, mk, src, storage, *SHAPES[shape], slot_dtype)
        run_and_check(case, gpu_device, kv_cache_dtype, scales)


@pytest.mark.parametrize("src", SRC)
@pytest.mark.parametrize("fmt", FORMATS[:2] + FORMATS[3:5] + FORMATS[6:7],
                         ids=FORMAT_IDS[:2] + FORMAT_IDS[3:5] + FORMAT_IDS[6:7])
@pytest.mark.parametrize("shape", ["decode", "prefill"])
def test_reshape_and_cache_flash_gpu_large_jit_donated(rng, mk, gpu_device, src, fmt, shape):
    storage, kv_cache_dtype = fmt
    scales = {} if storage is None else dict(k_scale=0.05, v_scale=3.0)
    case = make_case(rng, mk, src, storage, *SHAPES[shape], np.int32)
    run_and_check(case, gpu_device, kv_cache_dtype, scales, jit=True)


@pytest.mark.parametrize("fmt", [(None, "auto"), ("uint8", "fp8")], ids=["same", "uint8"])
def test_reshape_and_cache_flash_gpu_in_place(rng, mk, gpu_device, fmt):
    storage, kv_cache_dtype = fmt
    case = make_case(rng, mk, "bfloat16", storage, *SHAPES["decode"], np.int32)
    fn = jax.jit(functools.partial(xj.reshape_and_cache_flash, kv_cache_dtype=kv_cache_dtype),
                 donate_argnums=(2, 3))
    args = [jax.device_put(jnp.asarray(case[n]), gpu_device)
            for n in ("key", "value", "key_cache", "value_cache", "slot_mapping")]
    text = fn.lower(*args).compile().as_text()
    assert "input_output_alias" in text
    pointers = [args[2].unsafe_buffer_pointer(), args[3].unsafe_buffer_pointer()]
    kc, vc = fn(*args)
    assert [kc.unsafe_buffer_pointer(), vc.unsafe_buffer_pointer()] == pointers
    want = ref.reshape_and_cache_flash_ref(**case, kv_cache_dtype=kv_cache_dtype)
    ref.assert_bits_equal(np.asarray(kc), want[0])
    ref.assert_bits_equal(np.asarray(vc), want[1])


def test_reshape_and_cache_flash_gpu_matches_cpu(rng, mk, gpu_device):
    """The CUDA kernel and the Host implementation store the same bits."""
    case = make_case(rng, mk, "bfloat16", "uint8", *SHAPES["decode"], np.int32)
    outs = []
    for device in (gpu_device, jax.devices("cpu")[0]):
        args = {n: jax.device_put(jnp.asarray(x), device) for n, x in case.items()}
        outs.append([np.asarray(x) for x in xla_attn.reshape_and_cache_flash(
            **args, kv_cache_dtype="fp8", k_scale=jax.device_put(jnp.float32(0.2), device),
            v_scale=jax.device_put(jnp.float32(0.7), device))])
    for g, c in zip(*outs):
        ref.assert_bits_equal(g, c)


# Scales the kernel's hoisted-reciprocal division must round exactly like x / scale:
# ordinary ones, ones whose reciprocal is inexact, extremes where x / scale
# overflows or underflows, and the non-normal ones it divides for (0, subnormal, inf).
EDGE_SCALES = [3.0, 1 / 3, 0.1, 7.0, 0.37, 1e-30, 1e30, 1.5e-39, 0.0, np.inf]


@pytest.mark.parametrize("src", ["float32", "bfloat16"])
@pytest.mark.parametrize("fmt", [("float8_e4m3fn", "fp8"), ("float8_e5m2", "fp8_e5m2")],
                         ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("shape", ["small", "odd"])
def test_reshape_and_cache_flash_gpu_scales(rng, mk, gpu_device, src, fmt, shape):
    storage, kv_cache_dtype = fmt
    case = make_case(rng, mk, src, storage, *SHAPES[shape], np.int32)
    # inputs over the whole exponent range, so x / scale lands everywhere
    for name in ("key", "value"):
        x = case[name].astype(np.float32)
        x *= np.exp2(rng.integers(-60, 60, x.shape)).astype(np.float32)
        case[name] = x.astype(case[name].dtype)
    randoms = list(np.exp(rng.uniform(np.log(1e-4), np.log(1e4), 6)))
    for k_scale, v_scale in zip(EDGE_SCALES + randoms, reversed(EDGE_SCALES + randoms)):
        run_and_check(case, gpu_device, kv_cache_dtype, dict(k_scale=k_scale, v_scale=v_scale))
