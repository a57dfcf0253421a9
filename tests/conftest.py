"""Shared test setup: 4 fake CPU devices (set before jax is imported anywhere), CPU as
the default device for the CPU suite, the `gpu` marker, a per-test seeded `rng`, and
builders of small random inputs (numpy arrays, so the reference sees the very
values the library gets)."""

import os

_FLAG = "--xla_force_host_platform_device_count=4"
if _FLAG not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _FLAG).strip()

# GPU runs under pytest-xdist (`-n 12`) share one GPU, and JAX's default has each process
# preallocate 75 % of its memory: on an H100 (2026-11-27) a `-n 12` subset failed every
# test that way and passed allocating on demand (the whole tests/gpu too, at -n 14).
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import types  # noqa: E402
import zlib  # noqa: E402

import jax  # noqa: E402
import ml_dtypes  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

NP_DTYPES = {"float32": np.dtype(np.float32), "float16": np.dtype(np.float16),
             "bfloat16": np.dtype(ml_dtypes.bfloat16),
             "float8_e4m3fn": np.dtype(ml_dtypes.float8_e4m3fn),
             "float8_e5m2": np.dtype(ml_dtypes.float8_e5m2), "uint8": np.dtype(np.uint8)}
FLOAT_DTYPES = ("float32", "float16", "bfloat16")


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA device through JAX (skipped without)")
    config.addinivalue_line("markers", "slow: long-running case")


def gpu_devices():
    """JAX's CUDA devices, or [] when this jax has no GPU backend or no GPU."""
    try:
        return jax.devices("gpu")
    except Exception:  # RuntimeError: unknown backend / no devices
        return []


def pytest_collection_modifyitems(config, items):
    gpu_dir = os.path.join(os.path.dirname(os.path.abspath(__file__)), "gpu") + os.sep
    for item in items:
        if str(item.fspath).startswith(gpu_dir):
            item.add_marker(pytest.mark.gpu)


def pytest_runtest_setup(item):
    # The torch GPU tests gate themselves on torch.cuda (a machine may have a CUDA
    # torch beside a CPU-only jax); every other GPU test needs jax's CUDA backend.
    if (item.get_closest_marker("gpu") is not None and "torch" not in item.fspath.basename
            and not gpu_devices()):
        pytest.skip("no CUDA device visible to jax")


@pytest.fixture(autouse=True)
def _cpu_by_default(request):
    """The CPU suite runs on the Host platform even where a GPU is present."""
    if request.node.get_closest_marker("gpu") is not None:
        yield
        return
    with jax.default_device(jax.devices("cpu")[0]):
        yield


@pytest.fixture
def gpu_device():
    devices = gpu_devices()
    if not devices:
        pytest.skip("no CUDA device visible to jax")
    return devices[0]


@pytest.fixture
def rng(request):
    """A fresh generator per test, seeded from the test's id (reproducible)."""
    return np.random.default_rng(zlib.crc32(request.node.nodeid.encode()))


# ------------------------------------------------------------------ input builders
def cu_seqlens(lengths) -> np.ndarray:
    return np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)]).astype(np.int32)


def np_dtype(dtype) -> np.dtype:
    """'bfloat16' -> ml_dtypes.bfloat16 etc.; numpy/ml_dtypes dtypes pass through."""
    return NP_DTYPES[dtype] if isinstance(dtype, str) else np.dtype(dtype)


def random_array(rng, shape, dtype, scale=1.0) -> np.ndarray:
    """Standard normal values (never zeros) in `dtype` (an ml_dtypes dtype for bf16/fp8)."""
    return (rng.standard_normal(shape) * scale).astype(np_dtype(dtype))


def varlen_inputs(rng, dtype, lens_q, lens_k, heads=4, heads_k=2, head_dim=32, pad_q=0, pad_k=0):
    """Packed q (total_q + pad_q, H, D), k/v (total_k + pad_k, Hk, D) and cu_seqlens."""
    cu_q, cu_k = cu_seqlens(lens_q), cu_seqlens(lens_k)
    q = random_array(rng, (int(cu_q[-1]) + pad_q, heads, head_dim), dtype)
    k = random_array(rng, (int(cu_k[-1]) + pad_k, heads_k, head_dim), dtype)
    v = random_array(rng, (int(cu_k[-1]) + pad_k, heads_k, head_dim), dtype)
    return q, k, v, cu_q, cu_k


def paged_kv(rng, dtype, lens_k, block_size, heads_k=2, head_dim=32, spare_blocks=3,
             extra_table_cols=1):
    """A paged cache holding len(lens_k) sequences in shuffled blocks (plus spare
    blocks of unrelated values), and a block table whose entries past each
    sequence's last block point at other (spare) blocks."""
    need = [-(-int(n) // block_size) for n in lens_k]
    num_blocks = sum(need) + spare_blocks
    cols = max(need + [1]) + extra_table_cols
    perm = rng.permutation(num_blocks).astype(np.int32)
    table = np.empty((len(lens_k), cols), np.int32)
    start = 0
    for b, n in enumerate(need):
        table[b, :n] = perm[start:start + n]
        start += n
        table[b, n:] = rng.choice(perm[sum(need):] if spare_blocks else perm, cols - n)
    k = random_array(rng, (num_blocks, block_size, heads_k, head_dim), dtype)
    v = random_array(rng, (num_blocks, block_size, heads_k, head_dim), dtype)
    return k, v, table


def fp8_cache(rng, shape, dtype_name, scale=2.0):
    """Random finite fp8 values (a float8 array) of magnitude about `scale`."""
    return (rng.standard_normal(shape) * scale).astype(NP_DTYPES[dtype_name])


def random_bits(rng, shape, dtype_name, finite=False):
    """Arbitrary bit patterns (NaNs and infs included, unless `finite`) to poison a
    cache with."""
    dt = NP_DTYPES[dtype_name]
    out = rng.integers(0, 256, size=tuple(shape) + (dt.itemsize,), dtype=np.uint8) \
        .view(dt).reshape(shape)
    if finite and dt.kind != "u":
        bad = ~np.isfinite(out.astype(np.float32))
        out[bad] = rng.standard_normal(int(bad.sum())).astype(dt)
    return out


def alibi(rng, *shape) -> np.ndarray:
    return rng.uniform(0.05, 1.0, shape).astype(np.float32)


def decode_step_tokens(rng, tables, seq_lens, block_size, heads, heads_k, dim):
    """One decode step of a batch with one query token per sequence: the slots of each
    sequence's newest token (position seq_len - 1, written this step), its new bf16 K
    and V, the queries and query_start_loc. Returns (slots, new_k, new_v, query, qsl)."""
    seqs = len(seq_lens)
    slots = np.array([tables[s, (n - 1) // block_size] * block_size + (n - 1) % block_size
                      for s, n in enumerate(seq_lens)], np.int32)
    new_k = random_array(rng, (seqs, heads_k, dim), "bfloat16")
    new_v = random_array(rng, (seqs, heads_k, dim), "bfloat16")
    query = random_array(rng, (seqs, heads, dim), "bfloat16")
    return slots, new_k, new_v, query, np.arange(seqs + 1, dtype=np.int32)


def f32(x) -> np.ndarray:
    """A float32 device scalar value as numpy (what the scales are)."""
    return np.asarray(x, np.float32)


@pytest.fixture(scope="session")
def mk():
    """The builders above, for tests (a session fixture, so hypothesis can use it)."""
    return types.SimpleNamespace(
        cu_seqlens=cu_seqlens, np_dtype=np_dtype, random_array=random_array, varlen_inputs=varlen_inputs,
        paged_kv=paged_kv, fp8_cache=fp8_cache, random_bits=random_bits, alibi=alibi, f32=f32,
        decode_step_tokens=decode_step_tokens,
        NP_DTYPES=NP_DTYPES, FLOAT_DTYPES=FLOAT_DTYPES)
