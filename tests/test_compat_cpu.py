"""The one native library (FFI API 0.1) registers and runs every op under whichever
jax is installed; CI runs this under the newest jax and under jax 0.7.2."""

import jax
import jax.numpy as jnp
import numpy as np

import xla_attn
from xla_attn import _native


def test_library_and_abi():
    info = _native.build_info()
    assert info["abi"] == _native.ABI_VERSION
    assert {"reshape_and_cache_flash_portable", "flash_fwd_portable"} <= {m["name"] for m in info["modules"]}
    archs = info["modules"][0]["archs"].split(";")
    assert len(archs) >= 1 and all(a.isdigit() for a in archs)


def test_every_target_runs_on_this_jax():
    rng = np.random.default_rng(3)
    q = jnp.asarray(rng.standard_normal((6, 2, 16)), jnp.float32)
    cu = jnp.array([0, 6], jnp.int32)
    out = jax.jit(lambda q: xla_attn.flash_attn_varlen(q, q, q, cu, cu, 6, 6, causal=True))(q)
    grad = jax.grad(lambda q: xla_attn.flash_attn_varlen(q, q, q, cu, cu, 6, 6).sum())(q)
    cache = jnp.asarray(rng.standard_normal((2, 4, 2, 16)), jnp.float32)
    paged = xla_attn.paged_attention(q[:2], cache, cache, jnp.array([5], jnp.int32),
                                     jnp.array([[1, 0]], jnp.int32), jnp.array([0, 2], jnp.int32),
                                     0.25)
    kc, _ = xla_attn.reshape_and_cache_flash(q[:1], q[:1], cache, cache, jnp.array([3], jnp.int32))
    for x in (out, grad, paged, kc):
        assert np.isfinite(np.asarray(x)).all()
    np.testing.assert_array_equal(np.asarray(kc).reshape(8, 2, 16)[3], np.asarray(q[0]))


def test_flash_fwd_workspace_holds_fp8_vt():
    """The forward's workspace, sized from shapes and K's dtype: fp8 d256 (non-paged) also
    holds V^T for the Hopper forward (a 1 KB offset, then heads_k x head_dim rows of
    total_k + 144 columns a sequence, rounded to 16: sm90_tiles.h, vt_workspace_bytes);
    so does fp8 d64 / d128 from 4096 rows; bf16, paged fp8 and shorter fp8 d128 rows ask
    for what the dtype-blind v1 asks for (split-KV partials, the walk's item counter)."""
    shape = dict(total_q=4096, batch=2, num_heads=8, max_seqlen_q=2048, max_seqlen_k=2048)
    size = lambda d, dt, paged=False: _native.flash_fwd_workspace_size(
        head_dim=d, k_shape=(4096, 2, d), kv_dtype=dt, paged=paged, **shape)
    vt_cols = (4096 + 144 * 2 + 16 + 15) // 16 * 16
    assert size(256, "float8_e4m3fn") == 1024 + 2 * 256 * vt_cols
    assert size(144, "float8_e4m3fn") == 1024 + 2 * 144 * vt_cols
    v1 = lambda d, rows=2048: _native.lib().xla_attn_flash_fwd_workspace_size(4096, 2, 8, d,
                                                                               rows, 2048)
    assert size(256, "float8_e4m3fn") > v1(256)
    # rows below 2048 (sm90_tiles.h, kVtMinRows): the forward transposes, no V^T
    shape["max_seqlen_q"] = 1024
    assert size(256, "float8_e4m3fn") == v1(256, 1024)
    shape["max_seqlen_q"] = 2048
    for d, dt, paged in ((256, "bfloat16", False), (256, "float8_e4m3fn", True),
                         (128, "float8_e4m3fn", False)):
        assert size(d, dt, paged) == v1(d), (d, dt, paged)
    # fp8 d64 / d128 from 4096 rows (kVtMinRowsNarrow: past their walks' 2048), on 16
    # heads (enough blocks that no split of the keys is planned)
    for rows in (4096, 2048):
        batch = 16384 // rows
        big = lambda d, paged=False: _native.flash_fwd_workspace_size(
            head_dim=d, k_shape=(16384, 16, d), kv_dtype="float8_e4m3fn", paged=paged,
            total_q=16384, batch=batch, num_heads=16, max_seqlen_q=rows, max_seqlen_k=rows)
        v1_big = lambda d: _native.lib().xla_attn_flash_fwd_workspace_size(
            16384, batch, 16, d, rows, rows)
        cols = (16384 + 144 * batch + 16 + 15) // 16 * 16
        for d in (64, 80, 128):
            want = 1024 + 16 * d * cols if rows == 4096 else v1_big(d)
            assert big(d) == want > 1024 * (rows == 4096), (rows, d)
            assert big(d, paged=True) == v1_big(d), (rows, d)
