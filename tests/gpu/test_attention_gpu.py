"""Flash attention (forward, backward, paged KV) and paged attention on the CUDA device
through JAX, for every kernel family the build has (XLA_ATTN_FORCE_FAMILY), against
the float64 reference: dtypes x head dims x features, padding, empty sequences,
split-KV. Skipped where jax sees no GPU."""

import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from xla_attn.testing import reference as ref  # noqa: E402
from xla_attn import _native  # noqa: E402
from xla_attn import jax as xj  # noqa: E402

pytestmark = pytest.mark.gpu

# "sm90,sm80": the Hopper forward where it takes the call (sm_90; not paged, not split),
# the sm80 kernels for the rest (the backward, paged K/V, split-KV, d <= 32).
FAMILIES = ["portable", "sm80", "sm90,sm80"]
DTYPES = ["float32", "float16", "bfloat16"]
HEAD_DIMS = [32, 64, 80, 128, 256]
FEATURES = {
    "plain": {},
    "causal": dict(causal=True),
    "window": dict(window_size=(13, 4)),
    "causal_window_softcap": dict(causal=True, window_size=(20, -1), softcap=3.0),
    # softcap alone: tiles every row sees whole (unmasked) with softcap, which no window
    # of the other features leaves in a 128-key tile
    "softcap": dict(softcap=3.0),
    "alibi": dict(causal=True, alibi="heads"),
    "alibi_batch": dict(alibi="batch"),
}


@pytest.fixture(params=FAMILIES)
def family(request, monkeypatch):
    monkeypatch.setenv("XLA_ATTN_FORCE_FAMILY", request.param)
    return request.param


@pytest.fixture(params=FAMILIES + ["auto", "decode,sm80"])
def paged_family(request, monkeypatch):
    """paged_attention's routes: forced onto one flash family (the decode kernels then
    stand aside); "auto": the best decode kernel for short query spans (on sm_90 the
    Hopper one) and the best flash family for the longer ones, as users get it;
    "decode,sm80": the sm_80 decode kernels (tensor-core and FMA) beside the sm80 flash
    forward, so that they are tested on sm_90 too."""
    if request.param == "auto":
        monkeypatch.delenv("XLA_ATTN_FORCE_FAMILY", raising=False)
    else:
        monkeypatch.setenv("XLA_ATTN_FORCE_FAMILY", request.param)
    return request.param


def _skip_outside(family, dtype="bfloat16"):
    """The sm80 family (tensor cores) has f16 and bf16 kernels only (and the fp8 forward
    on sm_89+, tested on its own): float32 and fp8 run on the portable family, which the
    "portable" param tests."""
    if "sm80" in family.split(",") and dtype not in ("float16", "bfloat16"):
        pytest.skip("sm80 family: f16/bf16 only (f32 and fp8 are portable's)")


def _is_sm90(device):
    return getattr(device, "compute_capability", "") == "9.0"


def _has_fp8_mma(device):
    """sm_89+: mma.sync takes e4m3 operands (the sm80 family's fp8 forward)."""
    return float(getattr(device, "compute_capability", "0")) >= 8.9


def _on(device, *arrays):
    return [None if a is None else jax.device_put(jnp.asarray(a), device) for a in arrays]


def _kwargs_on(device, kw):
    """Keyword arguments with their numpy arrays (ALiBi slopes) put on `device`."""
    return {key: (jax.device_put(val, device) if isinstance(val, np.ndarray) else val)
            for key, val in kw.items()}


def _feature_kwargs(rng, mk, name, heads, batch):
    kw = dict(FEATURES[name])
    which = kw.pop("alibi", None)
    if which == "heads":
        kw["alibi_slopes"] = mk.alibi(rng, heads)
    elif which == "batch":
        kw["alibi_slopes"] = mk.alibi(rng, batch, heads)
    return kw


@pytest.mark.parametrize("feature", list(FEATURES))
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_flash_forward(family, gpu_device, rng, mk, dtype, head_dim, feature):
    _skip_outside(family, dtype)
    lens_q, lens_k = [37, 1, 0, 70, 5], [50, 9, 4, 70, 3]
    q, k, v, cu_q, cu_k = mk.varlen_inputs(rng, dtype, lens_q, lens_k, heads=6, heads_k=2,
                                           head_dim=head_dim, pad_q=3)
    kw = _feature_kwargs(rng, mk, feature, 6, len(lens_q))
    exp_out, exp_lse = ref.flash_attn_varlen_ref(q, k, v, cu_q, cu_k, None, **kw)
    args = _on(gpu_device, q, k, v, cu_q, cu_k)
    kw_dev = _kwargs_on(gpu_device, kw)
    out, lse = jax.jit(lambda *a: xj.flash_attn_varlen(*a, max(lens_q), max(lens_k),
                                                       return_softmax_lse=True, **kw_dev))(*args)
    ref.assert_attention_close(out, exp_out, dtype, lse, exp_lse, valid_rows=int(cu_q[-1]))


@pytest.mark.parametrize("feature", ["plain", "causal", "window", "causal_window_softcap"])
@pytest.mark.parametrize("head_dim", [64, 96, 128, 256])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_flash_forward_long(family, gpu_device, rng, mk, dtype, head_dim, feature):
    """Several row blocks and key tiles per sequence (the sm80 family's blocks are 64 or
    128 rows, its tiles 32 or 64 keys): tile skipping, edge masks, row-block tails."""
    lens_q, lens_k = [300, 129, 1, 64], [300, 200, 333, 64]
    q, k, v, cu_q, cu_k = mk.varlen_inputs(rng, dtype, lens_q, lens_k, heads=4, heads_k=1,
                                           head_dim=head_dim, pad_q=5)
    kw = dict(FEATURES[feature])
    exp_out, exp_lse = ref.flash_attn_varlen_ref(q, k, v, cu_q, cu_k, None, **kw)
    out, lse = jax.jit(lambda *a: xj.flash_attn_varlen(*a, max(lens_q), max(lens_k),
                                                       return_softmax_lse=True, **kw))(
        *_on(gpu_device, q, k, v, cu_q, cu_k))
    ref.assert_attention_close(out, exp_out, dtype, lse, exp_lse, valid_rows=int(cu_q[-1]))


@pytest.fixture(params=["sms", "walk3", "items"])
def sm90_grid(request, monkeypatch):
    """The Hopper forward's grid: as the launcher plans it (the persistent walk at d64
    and d128 with one block an SM: these shapes have fewer row blocks than an H100 has
    SMs, one each), 3 blocks (XLA_ATTN_SM90_BLOCKS), each walking many row blocks of
    several sequences and heads, so that Q buffers, stage rings and ping-pong turns carry
    from one to the next, or one block an item (XLA_ATTN_SM90_BLOCKS=0: the kernels a
    call without a workspace takes, and d256's)."""
    if _one_launch_for_every_grid(request) and request.param != "items":
        pytest.skip("no walk in this build for these parameters (paged, or no walk kernel "
                    "of the dtype and head-dim bucket): every grid launches one block an "
                    "item, which the 'items' case runs")
    if request.param != "sms":
        monkeypatch.setenv("XLA_ATTN_SM90_BLOCKS", "3" if request.param == "walk3" else "0")
    return request.param


def _one_launch_for_every_grid(request):
    """Whether the test's parameters make the three grids one launch: where this build has
    no walk for the call, XLA_ATTN_SM90_BLOCKS changes nothing. Paged K/V never walks
    (test_flash_forward_paged_sm90, `block_size`); otherwise the dispatcher says, as the
    launcher asks it: a flash_fwd_tma_walk variant for the dtype (the fp8 test's is
    implied) and head dim (kernels/dispatch/variants.py, with sm90_tiles.h's has_walk:
    today d64 and d128)."""
    callspec = getattr(request.node, "callspec", None)
    params = callspec.params if callspec else {}
    if "block_size" in params:
        return True
    dtype = params.get("dtype", "float8_e4m3fn")
    try:
        _native.select_variant("flash_fwd_tma_walk", dtype, dtype, params.get("head_dim", 0), 90)
    except RuntimeError:
        return True
    return False


def _nan_tail_inputs(gpu_device, rng, mk, monkeypatch, dtype, head_dim, families,
                     needs=_is_sm90, why="the sm90 family runs on sm_90 only"):
    """Varlen inputs for the sm90 kernels' boxes (128-row Q, 64/128-key K/V) to read past
    each sequence: padding rows of q, k, v (and dO, the 4th array) hold NaN, as do the
    keys past seqused_k of sequence 1; GQA 3, several row blocks and key tiles. Skips
    where needs(device) is false; sets XLA_ATTN_FORCE_FAMILY to `families`."""
    if not needs(gpu_device):
        pytest.skip(why)
    monkeypatch.setenv("XLA_ATTN_FORCE_FAMILY", families)
    lens_q, lens_k = [300, 129, 1, 64, 0], [300, 200, 333, 64, 70]
    q, k, v, cu_q, cu_k = mk.varlen_inputs(rng, dtype, lens_q, lens_k, heads=6, heads_k=2,
                                           head_dim=head_dim, pad_q=7, pad_k=9)
    dout = mk.random_array(rng, q.shape, dtype)
    seqused = np.array([300, 150, 333, 64, 70], np.int32)
    nan = np.array(np.nan, q.dtype)
    q[int(cu_q[-1]):], dout[int(cu_q[-1]):] = nan, nan
    k[int(cu_k[-1]):], v[int(cu_k[-1]):] = nan, nan
    k[int(cu_k[1]) + 150:int(cu_k[2])] = nan  # keys past seqused_k of sequence 1
    v[int(cu_k[1]) + 150:int(cu_k[2])] = nan
    return (q, k, v, dout, cu_q, cu_k, seqused), (max(lens_q), max(lens_k))


@pytest.mark.parametrize("feature", ["plain", "causal", "window", "causal_window_softcap",
                                     "softcap", "alibi_batch"])
@pytest.mark.parametrize("head_dim", [64, 80, 128, 256])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_flash_forward_sm90_nan_tails(gpu_device, sm90_grid, rng, mk, monkeypatch, dtype,
                                     head_dim, feature):
    """The Hopper forward alone (XLA_ATTN_FORCE_FAMILY=sm90: a call it did not take would
    find no kernel): whole 128-row Q boxes and 64/128-key K/V boxes read past each
    sequence, into the next one and into padding rows holding NaN, as do keys past
    seqused_k; GQA 3, several row blocks and key tiles, head_dim 80 padded to 128."""
    (q, k, v, _, cu_q, cu_k, seqused), (max_q, max_k) = _nan_tail_inputs(
        gpu_device, rng, mk, monkeypatch, dtype, head_dim, "sm90")
    kw = _feature_kwargs(rng, mk, feature, 6, len(cu_q) - 1)
    exp_out, exp_lse = ref.flash_attn_varlen_ref(q, k, v, cu_q, cu_k, None, seqused_k=seqused,
                                                 **kw)
    args = _on(gpu_device, q, k, v, cu_q, cu_k, seqused)
    kw_dev = _kwargs_on(gpu_device, kw)
    out, lse = jax.jit(lambda q, k, v, cq, ck, su: xj.flash_attn_varlen(
        q, k, v, cq, ck, max_q, max_k, seqused_k=su, return_softmax_lse=True, **kw_dev))(*args)
    assert np.isfinite(np.asarray(out, np.float32)).all()
    ref.assert_attention_close(out, exp_out, dtype, lse, exp_lse, valid_rows=int(cu_q[-1]))


@pytest.mark.parametrize("count", [100, 140])
@pytest.mark.parametrize("causal", [False, True])
def test_flash_forward_sm90_many_sequences(gpu_device, sm90_grid, rng, mk, monkeypatch,
                                          causal, count):
    """The Hopper forward over many sequences of random lengths, a tenth of them empty
    and one of the longest length (about two thirds of the walk's items past their
    sequence's rows, claimed and skipped), against the float64 reference. 100 and 140
    sequences: the counts around 128 at which docs/tries' compact-items form of the walk
    changed its item order (2026-12-02-fwd-d128-varlen-compact-items.patch)."""
    if not _is_sm90(gpu_device):
        pytest.skip("the sm90 family runs on sm_90 only")
    monkeypatch.setenv("XLA_ATTN_FORCE_FAMILY", "sm90")
    lens = rng.integers(1, 400, count)
    lens[rng.choice(count, count // 10, replace=False)] = 0
    lens[rng.integers(count)] = 400
    q, k, v, cu_q, cu_k = mk.varlen_inputs(rng, "bfloat16", lens, lens, heads=2, heads_k=1,
                                           head_dim=128, pad_q=3)
    exp_out, exp_lse = ref.flash_attn_varlen_ref(q, k, v, cu_q, cu_k, None, causal=causal)
    out, lse = jax.jit(lambda *a: xj.flash_attn_varlen(*a, 400, 400, causal=causal,
                                                       return_softmax_lse=True))(
        *_on(gpu_device, q, k, v, cu_q, cu_k))
    ref.assert_attention_close(out, exp_out, "bfloat16", lse, exp_lse, valid_rows=int(cu_q[-1]))


def test_flash_forward_sm90_declines(gpu_device, rng, mk, monkeypatch):
    """A call the Hopper forward does not take (head_dim 100: rows the copy engine
    cannot stride) names the families it looked in rather than running anything."""
    if not _is_sm90(gpu_device):
        pytest.skip("the sm90 family runs on sm_90 only")
    monkeypatch.setenv("XLA_ATTN_FORCE_FAMILY", "sm90")
    q, k, v, cu_q, cu_k = mk.varlen_inputs(rng, "bfloat16", [8], [8], heads=2, heads_k=2,
                                           head_dim=100)
    with pytest.raises(Exception, match="XLA_ATTN_FORCE_FAMILY"):
        jax.block_until_ready(jax.jit(lambda *a: xj.flash_attn_varlen(*a, 8, 8))(
            *_on(gpu_device, q, k, v, cu_q, cu_k)))


@pytest.mark.parametrize("head_dim", [7, 20, 100, 250])
def test_flash_forward_unaligned_head_dim(family, gpu_device, rng, mk, head_dim):
    """Head dims that are not a multiple of 8 take the element-wise load and store path
    of the sm80 family (its 16-byte copies need 16-byte rows)."""
    lens_q, lens_k = [70, 3], [90, 3]
    q, k, v, cu_q, cu_k = mk.varlen_inputs(rng, "float16", lens_q, lens_k, heads=2, heads_k=2,
                                           head_dim=head_dim, pad_q=1)
    exp_out, exp_lse = ref.flash_attn_varlen_ref(q, k, v, cu_q, cu_k, None, causal=True)
    out, lse = jax.jit(lambda *a: xj.flash_attn_varlen(*a, 70, 90, causal=True,
                                                       return_softmax_lse=True))(
        *_on(gpu_device, q, k, v, cu_q, cu_k))
    ref.assert_attention_close(out, exp_out, "float16", lse, exp_lse, valid_rows=int(cu_q[-1]))


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_flash_forward_paged(family, gpu_device, rng, mk, dtype, block_size):
    lens_q, lens_k = [5, 1, 40], [77, 16, 40]
    q = mk.random_array(rng, (sum(lens_q) + 2, 8, 128), dtype)
    k, v, table = mk.paged_kv(rng, dtype, lens_k, block_size, heads_k=2, head_dim=128)
    cu_q, cu_k = mk.cu_seqlens(lens_q), mk.cu_seqlens(lens_k)
    seqused = np.array([70, 16, 33], np.int32)
    exp_out, exp_lse = ref.flash_attn_varlen_ref(q, k, v, cu_q, cu_k, None, causal=True,
                                                 seqused_k=seqused, block_table=table)
    args = _on(gpu_device, q, k, v, cu_q, cu_k, seqused, table)
    out, lse = jax.jit(lambda q, k, v, cq, ck, su, bt: xj.flash_attn_varlen(
        q, k, v, cq, ck, 40, 77, causal=True, seqused_k=su, block_table=bt,
        return_softmax_lse=True))(*args)
    ref.assert_attention_close(out, exp_out, dtype, lse, exp_lse, valid_rows=int(cu_q[-1]))


def _paged_nan_inputs(rng, mk, dtype, block_size, head_dim, lens_q, lens_k, seqused):
    """q (+2 padding rows of NaN), a paged cache whose spare blocks and slots past
    seqused_k hold NaN (the boxes read whole pages: only masks and zeroing hide them),
    the table, cu_seqlens."""
    q = mk.random_array(rng, (sum(lens_q) + 2, 8, head_dim), dtype)
    q[sum(lens_q):] = np.nan
    k, v, table = mk.paged_kv(rng, dtype, lens_k, block_size, heads_k=2, head_dim=head_dim)
    used_blocks = set()
    for b, n in enumerate(lens_k):
        pages = -(-n // block_size)
        used_blocks.update(int(x) for x in table[b, :pages])
        for key in range(int(seqused[b]), pages * block_size):
            blk, slot = table[b, key // block_size], key % block_size
            k[blk, slot], v[blk, slot] = np.nan, np.nan
    for blk in set(range(k.shape[0])) - used_blocks:
        k[blk], v[blk] = np.nan, np.nan
    return q, k, v, table, mk.cu_seqlens(lens_q), mk.cu_seqlens(lens_k)


@pytest.mark.parametrize("feature", ["causal", "window_softcap_alibi"])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("block_size", [8, 16, 48, 256])
@pytest.mark.parametrize("dtype", ["bfloat16", "float8_e4m3fn"])
def test_flash_forward_paged_sm90(gpu_device, sm90_grid, rng, mk, monkeypatch, dtype,
                                  block_size, head_dim, feature):
    """The Hopper forward over a block table alone (XLA_ATTN_FORCE_FAMILY=sm90): boxes of
    gcd(block_size, block_n) rows from shuffled pages (8: 16 boxes a 128-key tile; 48:
    16-row boxes; 256: whole 128-key tiles), several tiles a sequence, GQA 4, NaN in
    unrelated blocks, past seqused_k and in q's padding rows; bf16, and fp8 e4m3 with
    descales (P rounded to e4m3: FP8_P_BOUND)."""
    if not _is_sm90(gpu_device):
        pytest.skip("the sm90 family runs on sm_90 only")
    fp8 = dtype == "float8_e4m3fn"
    monkeypatch.setenv("XLA_ATTN_FORCE_FAMILY", "sm90")
    lens_q, lens_k = [5, 1, 200, 0], [300, 16, 333, 20]
    seqused = np.array([290, 16, 333, 20], np.int32)
    q, k, v, table, cu_q, cu_k = _paged_nan_inputs(rng, mk, dtype, block_size, head_dim,
                                                    lens_q, lens_k, seqused)
    kw = dict(causal=True)
    if feature == "window_softcap_alibi":
        kw = dict(window_size=(150, 3), softcap=4.0, alibi_slopes=mk.alibi(rng, 8))
    if fp8:
        kw.update(q_descale=np.float32(0.5), k_descale=np.float32(0.25),
                  v_descale=np.float32(2.0))
    exp_out, exp_lse = ref.flash_attn_varlen_ref(q, k, v, cu_q, cu_k, None, seqused_k=seqused,
                                                 block_table=table, **kw)
    kw_dev = _kwargs_on(gpu_device, kw)
    args = _on(gpu_device, q, k, v, cu_q, cu_k, seqused, table)
    out, lse = jax.jit(lambda q, k, v, cq, ck, su, bt: xj.flash_attn_varlen(
        q, k, v, cq, ck, max(lens_q), max(lens_k), seqused_k=su, block_table=bt,
        return_softmax_lse=True, **kw_dev))(*args)
    assert np.isfinite(np.asarray(out, np.float32)[:int(cu_q[-1])]).all()
    ref.assert_attention_close(out, exp_out, "fp8_p" if fp8 else "bfloat16", lse, exp_lse,
                               valid_rows=int(cu_q[-1]))


def test_flash_forward_paged_sm90_absent_pages(gpu_device, rng, mk, monkeypatch):
    """Block-table entries inside the sequences that name no block (-1, num_blocks, 2^30):
    the Hopper forward masks those keys (their boxes read as zeros past the cache) as the
    sm80 kernel does, so both families give the same result, finite, with no fault."""
    if not _is_sm90(gpu_device):
        pytest.skip("the sm90 family runs on sm_90 only")
    lens_q, lens_k = [40, 7], [300, 200]
    seqused = np.array(lens_k, np.int32)
    q, k, v, table, cu_q, cu_k = _paged_nan_inputs(rng, mk, "bfloat16", 16, 128, lens_q,
                                                    lens_k, seqused)
    table = table.copy()
    table[0, 3], table[0, 10], table[1, 0] = -1, k.shape[0], 1 << 30
    args = _on(gpu_device, q, k, v, cu_q, cu_k, seqused, table)
    outs = {}
    for families in ("sm90", "sm80"):
        monkeypatch.setenv("XLA_ATTN_FORCE_FAMILY", families)
        out, lse = jax.jit(lambda q, k, v, cq, ck, su, bt: xj.flash_attn_varlen(
            q, k, v, cq, ck, 40, 300, causal=True, seqused_k=su, block_table=bt,
            return_softmax_lse=True))(*args)
        outs[families] = (np.asarray(out, np.float32)[:47], np.asarray(lse)[:, :47])
    assert np.isfinite(outs["sm90"][0]).all()
    np.testing.assert_allclose(outs["sm90"][0], outs["sm80"][0], atol=2e-2, rtol=2e-2)
    np.testing.assert_allclose(outs["sm90"][1], outs["sm80"][1], atol=1e-3, rtol=1e-3)


def test_flash_forward_fp8(family, gpu_device, rng, mk):
    """fp8 e4m3 q, k, v with descales, bf16 out: the portable kernel (P in float32), and
    on sm_89+ the tensor-core ones (the sm80 family's mma.sync kernel, on sm_90 the
    Hopper one; P rounded to e4m3: FP8_P_BOUND)."""
    tensor_cores = "sm80" in family.split(",")
    if tensor_cores and not _has_fp8_mma(gpu_device):
        pytest.skip("the tensor-core fp8 forward needs sm_89+")
    lens = [33, 64]
    q, k, v, cu_q, cu_k = mk.varlen_inputs(rng, "float8_e4m3fn", lens, lens, heads=4, heads_k=4,
                                           head_dim=64)
    qd, kd, vd = (np.float32(s) for s in (0.5, 0.25, 2.0))
    exp_out, _ = ref.flash_attn_varlen_ref(q, k, v, cu_q, cu_k, None, causal=True, q_descale=qd,
                                           k_descale=kd, v_descale=vd)
    args = _on(gpu_device, q, k, v, cu_q, cu_k, qd, kd, vd)
    out = jax.jit(lambda q, k, v, cq, ck, a, b, c: xj.flash_attn_varlen(
        q, k, v, cq, ck, 64, 64, causal=True, q_descale=a, k_descale=b, v_descale=c))(*args)
    assert out.dtype == jnp.bfloat16
    ref.assert_attention_close(out, exp_out, "fp8_p" if tensor_cores else "bfloat16")


@pytest.mark.parametrize("v_tiles", ["pass", "transposes"])
@pytest.mark.parametrize("feature", ["plain", "causal", "window", "causal_window_softcap",
                                     "alibi_batch"])
@pytest.mark.parametrize("head_dim", [16, 64, 80, 128, 144, 256])
def test_flash_forward_fp8_sm90(gpu_device, sm90_grid, rng, mk, monkeypatch, record_property,
                                head_dim, feature, v_tiles):
    """The Hopper fp8 forward alone (XLA_ATTN_FORCE_FAMILY=sm90): e4m3 q, k, v with
    descales, bf16 out, head dims 16-256 in its d64 (16, 64), d128 (80, 128) and d256 (144,
    256: two column blocks a row, two consumer warpgroups at 240 registers) buckets
    (the d64 bucket's zero upper half read by no product), the NaN-tail layout of the 16-bit
    tests (boxes read past each sequence into NaN padding, keys past seqused_k NaN; the
    V^T tiles must zero them). Without a left window the one block an item kernels (d256
    always, d64 / d128 on the "items" grid) read V^T that a pass wrote into the workspace
    (v_tiles "pass": XLA_ATTN_SM90_VT=1, as the launcher takes it from 2048 rows at d256,
    4096 at d64 / d128), or transpose V themselves ("transposes": XLA_ATTN_SM90_VT=0; the
    walks and left windows always do). The error against the float64 reference is
    recorded per shape (junit property rel_error)."""
    if v_tiles == "transposes" and ((head_dim <= 128 and sm90_grid != "items") or
                                    feature in ("window", "causal_window_softcap")):
        pytest.skip("the producer transposes V here either way (v_tiles 'pass')")
    monkeypatch.setenv("XLA_ATTN_SM90_VT", "1" if v_tiles == "pass" else "0")
    (q, k, v, _, cu_q, cu_k, seqused), (max_q, max_k) = _nan_tail_inputs(
        gpu_device, rng, mk, monkeypatch, "float8_e4m3fn", head_dim, "sm90")
    kw = _feature_kwargs(rng, mk, feature, 6, len(cu_q) - 1)
    qd, kd, vd = (np.float32(s) for s in (0.5, 0.25, 2.0))
    exp_out, exp_lse = ref.flash_attn_varlen_ref(q, k, v, cu_q, cu_k, None, seqused_k=seqused,
                                                 q_descale=qd, k_descale=kd, v_descale=vd, **kw)
    args = _on(gpu_device, q, k, v, cu_q, cu_k, seqused, qd, kd, vd)
    kw_dev = _kwargs_on(gpu_device, kw)
    out, lse = jax.jit(lambda q, k, v, cq, ck, su, a, b, c: xj.flash_attn_varlen(
        q, k, v, cq, ck, max_q, max_k, seqused_k=su, q_descale=a, k_descale=b, v_descale=c,
        return_softmax_lse=True, **kw_dev))(*args)
    assert out.dtype == jnp.bfloat16
    assert np.isfinite(np.asarray(out, np.float32)).all()
    valid = int(cu_q[-1])
    record_property("rel_error", ref.rel_error(np.asarray(out)[:valid], exp_out[:valid]))
    ref.assert_attention_close(out, exp_out, "fp8_p", lse, exp_lse, valid_rows=valid)


@pytest.mark.parametrize("rows", ["long", "short"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype,head_dim", [("float8_e4m3fn", 64), ("float8_e4m3fn", 128),
                                            ("float8_e4m3fn", 256), ("bfloat16", 64),
                                            ("bfloat16", 128), ("float16", 256)])
def test_flash_forward_sm90_rising_scores(gpu_device, sm90_grid, rng, mk, monkeypatch, dtype,
                                          head_dim, causal, rows):
    """The Hopper forward where each key tile's scores pass the running max by more than
    2^8 (base 2): keys grow along the sequence in the queries' direction, so the softmax
    tried against the running max as it stands (fwd_sm90.cuh, softmax_at_running_max)
    must see that an exponent may pass its bound and compute the tile's S again. Several
    key tiles a sequence; "long" rows (2100 at fp8 and d64, else 1300) take fp8's one
    block an item kernel (past its walk's 2048 rows), "short" ones (1000) fp8's walk; d64
    takes three warpgroups at both (two only up to 256 masked rows: sm90_tiles.h,
    wide_d64); walk3 the walks everywhere, items the one block an item kernels (d256
    takes those always). Against the float64 reference."""
    if not _is_sm90(gpu_device):
        pytest.skip("the sm90 family runs on sm_90 only")
    monkeypatch.setenv("XLA_ATTN_FORCE_FAMILY", "sm90")
    fp8 = dtype == "float8_e4m3fn"
    # 16 heads and these rows: enough blocks that no split of the keys is planned (the
    # sm90 family takes none; with 4 heads, or 1300 rows at d64, the launcher planned one
    # and, forced to sm90, found no kernel)
    long_rows = 2100 if fp8 or head_dim == 64 else 1300
    lens = {"long": [long_rows, 200], "short": [1000, 700]}[rows]
    q, k, v, cu_q, cu_k = mk.varlen_inputs(rng, "float32", lens, lens, heads=16, heads_k=2,
                                           head_dim=head_dim)
    # q near all-ones, k near c * rise: scores rise by ~12 (base 2) a key tile (128 keys,
    # 16-bit d256 64): c sqrt(d) log2(e) = 12
    tile = 64 if head_dim > 128 and not fp8 else 128
    rise = np.concatenate([np.arange(n) / tile for n in lens])[:, None, None]
    c = 8.3 / np.sqrt(head_dim)
    q = (1.0 + 0.25 * q).astype(mk.np_dtype(dtype))
    k = (c * rise + 0.25 * k).astype(mk.np_dtype(dtype))
    v = v.astype(mk.np_dtype(dtype))
    scales = dict(q_descale=np.float32(1.0), k_descale=np.float32(1.0),
                  v_descale=np.float32(0.5)) if fp8 else {}
    exp_out, exp_lse = ref.flash_attn_varlen_ref(q, k, v, cu_q, cu_k, None, causal=causal,
                                                 **scales)
    args = _on(gpu_device, q, k, v, cu_q, cu_k, *scales.values())
    names = list(scales)
    out, lse = jax.jit(lambda q, k, v, cq, ck, *s: xj.flash_attn_varlen(
        q, k, v, cq, ck, max(lens), max(lens), causal=causal, return_softmax_lse=True,
        **dict(zip(names, s))))(*args)
    assert np.isfinite(np.asarray(out, np.float32)).all()
    ref.assert_attention_close(out, exp_out, "fp8_p" if fp8 else dtype, lse, exp_lse)


@pytest.mark.parametrize("offset", [0, 1, 64, -64, 21])
@pytest.mark.parametrize("dtype,head_dim", [("bfloat16", 64), ("bfloat16", 128),
                                            ("float16", 256), ("float8_e4m3fn", 64),
                                            ("float8_e4m3fn", 128), ("float8_e4m3fn", 256)])
def test_flash_forward_sm90_causal_diagonals(gpu_device, sm90_grid, rng, mk, monkeypatch,
                                            dtype, head_dim, offset):
    """The Hopper forward on causal rows whose last key tile a consumer warpgroup sees only
    part of: Lk = Lq (a block's first 64 rows see the diagonal tile's first half), Lk =
    Lq + 64 (one warpgroup sees none of its block's last tile, the other half of it), Lk
    = Lq - 64 (a sequence's first rows see no key), Lk = Lq + 1 (the first warpgroup's
    last row sees one key of the diagonal tile's second half, which a warp that skips
    that half's exponentials would lose: TileSoftmax::warp_sees_first_half), an odd
    offset; sequences ending inside a tile's first and second halves, one of a single
    tile. A warpgroup passes the tiles none of its rows sees at d64 (three warpgroups
    past 256 rows; fwd_sm90.cuh, warpgroup_tiles) and at fp8 (three warpgroups, 192-row
    blocks; in the walk each warpgroup's tile count comes from the item's record,
    fwd_sm90_walk.cuh), and at 16-bit d256 (64-key tiles, one block an item: its grids
    are one launch). Those walks put a sequence's partial 192-row block first
    (sm90_tiles.h, partial_block_first): 300, 1000 and 129 rows start with blocks of 108,
    40 and 129 rows, 384 with a whole one. Against the float64 reference, lse included."""
    if not _is_sm90(gpu_device):
        pytest.skip("the sm90 family runs on sm_90 only")
    monkeypatch.setenv("XLA_ATTN_FORCE_FAMILY", "sm90")
    fp8 = dtype == "float8_e4m3fn"
    lens_q = [256, 300, 64, 1000, 129, 384]
    lens_k = [max(1, n + offset) for n in lens_q]
    # 16 heads: enough blocks that no split of the keys is planned (the sm90 family
    # takes none; see test_flash_forward_sm90_rising_scores)
    q, k, v, cu_q, cu_k = mk.varlen_inputs(rng, dtype, lens_q, lens_k, heads=16,
                                           heads_k=4, head_dim=head_dim)
    scales = dict(q_descale=np.float32(0.5), k_descale=np.float32(0.25),
                  v_descale=np.float32(2.0)) if fp8 else {}
    exp_out, exp_lse = ref.flash_attn_varlen_ref(q, k, v, cu_q, cu_k, None, causal=True,
                                                 **scales)
    names = list(scales)
    out, lse = jax.jit(lambda q, k, v, cq, ck, *sc: xj.flash_attn_varlen(
        q, k, v, cq, ck, max(lens_q), max(lens_k), causal=True, return_softmax_lse=True,
        **dict(zip(names, sc))))(*_on(gpu_device, q, k, v, cu_q, cu_k, *scales.values()))
    assert np.isfinite(np.asarray(out, np.float32)).all()
    ref.assert_attention_close(out, exp_out, "fp8_p" if fp8 else dtype, lse, exp_lse)


_FP8_MMA = dict(families="sm80", needs=_has_fp8_mma,
                why="the sm80 family's fp8 forward needs sm_89+")


def _fp8_sm89_case(gpu_device, q, k, v, cu_q, cu_k, seqused=None, **kw):
    """Runs the fp8 forward (under XLA_ATTN_FORCE_FAMILY=sm80, the sm80 family's alone: a
    call it did not take would find no kernel) with descales (0.5, 0.25, 2), checks it
    against the float64 reference (FP8_P_BOUND) and returns the error on the valid rows."""
    qd, kd, vd = (np.float32(x) for x in (0.5, 0.25, 2.0))
    exp_out, exp_lse = ref.flash_attn_varlen_ref(q, k, v, cu_q, cu_k, None, seqused_k=seqused,
                                                 q_descale=qd, k_descale=kd, v_descale=vd, **kw)
    kw_dev = _kwargs_on(gpu_device, kw)
    args = _on(gpu_device, q, k, v, cu_q, cu_k, seqused, qd, kd, vd)
    max_q, max_k = int(max(np.diff(cu_q))), int(max(np.diff(cu_k)))
    out, lse = jax.jit(lambda q, k, v, cq, ck, su, a, b, c: xj.flash_attn_varlen(
        q, k, v, cq, ck, max_q, max_k, seqused_k=su, q_descale=a, k_descale=b, v_descale=c,
        return_softmax_lse=True, **kw_dev))(*args)
    assert out.dtype == jnp.bfloat16
    valid = int(cu_q[-1])
    assert np.isfinite(np.asarray(out, np.float32)).all()
    ref.assert_attention_close(out, exp_out, "fp8_p", lse, exp_lse, valid_rows=valid)
    return ref.rel_error(np.asarray(out)[:valid], exp_out[:valid])


@pytest.mark.parametrize("feature", list(FEATURES))
@pytest.mark.parametrize("head_dim", [16, 64, 80, 128, 192, 256])
def test_flash_forward_fp8_sm89(gpu_device, rng, mk, monkeypatch, record_property, head_dim,
                                feature):
    """The sm80 family's fp8 forward (mma.sync m16n8k32 e4m3, sm_89+): every bucket (64,
    128, 256; 16, 80 and 192 padded), each feature, on the NaN-tail inputs (GQA 3, several
    row blocks and key tiles; the tiles' zero fill must hide the NaN). The error against
    the float64 reference is recorded per shape (rel_error)."""
    (q, k, v, _, cu_q, cu_k, seqused), _ = _nan_tail_inputs(
        gpu_device, rng, mk, monkeypatch, "float8_e4m3fn", head_dim, **_FP8_MMA)
    kw = _feature_kwargs(rng, mk, feature, 6, len(cu_q) - 1)
    record_property("rel_error", _fp8_sm89_case(gpu_device, q, k, v, cu_q, cu_k, seqused, **kw))


@pytest.mark.parametrize("layout", ["paged16", "paged32_window", "split_kv"])
def test_flash_forward_fp8_sm89_paged_split(gpu_device, rng, mk, monkeypatch, record_property,
                                            layout):
    """The same kernel over a block table (the paged NaN inputs: shuffled pages, NaN in
    unrelated blocks, past seqused_k and in q's padding rows) and with split-KV partials
    merged (few rows, long keys)."""
    if not _FP8_MMA["needs"](gpu_device):
        pytest.skip(_FP8_MMA["why"])
    monkeypatch.setenv("XLA_ATTN_FORCE_FAMILY", _FP8_MMA["families"])
    if layout == "split_kv":
        q, k, v, cu_q, cu_k = mk.varlen_inputs(rng, "float8_e4m3fn", [1, 3], [20000, 9000],
                                               heads=2, heads_k=1, head_dim=128)
        err = _fp8_sm89_case(gpu_device, q, k, v, cu_q, cu_k, causal=True)
    else:
        seqused = np.array([70, 16, 33], np.int32)
        q, k, v, table, cu_q, cu_k = _paged_nan_inputs(
            rng, mk, "float8_e4m3fn", 16 if layout == "paged16" else 32, 128, [5, 1, 40],
            [77, 16, 40], seqused)
        kw = dict(causal=True, block_table=table)
        if layout == "paged32_window":
            kw.update(window_size=(20, -1), softcap=3.0)
        err = _fp8_sm89_case(gpu_device, q, k, v, cu_q, cu_k, seqused, **kw)
    record_property("rel_error", err)


@pytest.mark.parametrize("feature", ["plain", "causal", "causal_window_softcap", "alibi_batch"])
@pytest.mark.parametrize("head_dim", [32, 64, 128, 256])
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_flash_backward(family, gpu_device, rng, mk, dtype, head_dim, feature):
    _skip_outside(family, dtype)
    _check_backward(gpu_device, rng, mk, dtype, head_dim, feature, [29, 0, 48, 3], [40, 6, 48, 1],
                    heads=4, heads_k=2)


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("feature", ["causal", "causal_window_softcap", "alibi_batch"])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_flash_backward_through_softmax_lse(family, gpu_device, rng, mk, head_dim, feature,
                                            deterministic):
    """A loss on out and on softmax_lse: lse's cotangent rides the backward call as its
    dlse operand (D_i = dO_i . O_i - dlse_i: the delta kernel, or the deterministic dq
    kernel's own D), on each family's backward, against the float64 reference with the
    p_ij dlse_i term; rows without a key (lse = +inf) are kept out of the loss. The
    sequences span several row and key tiles."""
    dtype = "float32" if family == "portable" else "bfloat16"
    _skip_outside(family, dtype)
    lens_q, lens_k = [29, 0, 200, 3], [140, 6, 200, 1]
    q, k, v, cu_q, cu_k = mk.varlen_inputs(rng, dtype, lens_q, lens_k, heads=4, heads_k=2,
                                           head_dim=head_dim, pad_q=2, pad_k=3)
    dout = mk.random_array(rng, q.shape, dtype)
    kw = _feature_kwargs(rng, mk, feature, 4, len(lens_q))
    _, lse_ref = ref.flash_attn_varlen_ref(q, k, v, cu_q, cu_k, None, **kw)
    w = rng.standard_normal(lse_ref.shape)
    exp = ref.flash_attn_varlen_bwd_ref(dout, q, k, v, cu_q, cu_k, None, **kw,
                                        dlse=np.where(np.isfinite(lse_ref), w, 0.0))
    kw_dev = _kwargs_on(gpu_device, kw)

    def loss(q, k, v, cq, ck, do, w):
        out, lse = xj.flash_attn_varlen(q, k, v, cq, ck, max(lens_q), max(lens_k),
                                        return_softmax_lse=True, deterministic=deterministic,
                                        **kw_dev)
        return (jnp.sum(out.astype(jnp.float32) * do.astype(jnp.float32))
                + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0) * w))

    got = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(
        *_on(gpu_device, q, k, v, cu_q, cu_k, dout, w))
    for name, g, e in zip(("dq", "dk", "dv"), got, exp):
        err = ref.rel_error(g, e)
        assert err < ref.BOUNDS[dtype], f"{name}: {err:.3g}"


@pytest.mark.parametrize("feature", ["plain", "causal", "window", "causal_window_softcap", "alibi"])
@pytest.mark.parametrize("head_dim", [20, 64, 96, 100, 128, 200, 256])
def test_flash_backward_long(family, gpu_device, rng, mk, head_dim, feature):
    """Several 64-row and 64-key tiles per sequence (the sm80 backward's; at d256 32-row
    tiles in the paired kernel, 16-key tiles in the dq kernel), GQA 4, tile
    skipping and edge masks in both of its passes, head dims padded to a bucket and
    unaligned rows (20, 100, 200: element loads and stores)."""
    _check_backward(gpu_device, rng, mk, "bfloat16", head_dim, feature, [300, 129, 1, 64, 0],
                    [300, 200, 333, 64, 70], heads=4, heads_k=1)


@pytest.mark.parametrize("feature", ["plain", "causal_window_softcap", "alibi"])
@pytest.mark.parametrize("head_dim", [200, 256])
def test_flash_backward_d256_small_smem(gpu_device, rng, mk, monkeypatch, head_dim, feature):
    """d256 where a block may opt in to 99 KB of shared memory (sm_86/89): separate dV
    and dK blocks over 16-row tiles instead of the paired 8-warp kernel that sm_80 and
    sm_90 run (XLA_ATTN_SMEM_OPTIN caps what the launcher sees)."""
    monkeypatch.setenv("XLA_ATTN_FORCE_FAMILY", "sm80")
    monkeypatch.setenv("XLA_ATTN_SMEM_OPTIN", str(99 * 1024))
    _check_backward(gpu_device, rng, mk, "bfloat16", head_dim, feature, [300, 129, 1, 64, 0],
                    [300, 200, 333, 64, 70], heads=4, heads_k=1)


@pytest.mark.parametrize("feature", ["causal", "causal_window_softcap"])
@pytest.mark.parametrize("head_dim", [32, 100, 128, 256])
def test_flash_backward_deterministic(family, gpu_device, rng, mk, head_dim, feature):
    """deterministic=True (xla_attn_flash_bwd_v1, no workspace; torch_xla's): the sm80
    family's backward without atomics (a dq kernel instead of the f32 accumulator v2
    adds into), against the reference, bit-identical from run to run, dq's padding rows
    zero (GQA 4, several key blocks and row tiles)."""
    lens_q, lens_k = [300, 129, 1, 64, 0], [300, 200, 333, 64, 70]
    q, k, v, cu_q, cu_k = mk.varlen_inputs(rng, "bfloat16", lens_q, lens_k, heads=4, heads_k=1,
                                           head_dim=head_dim, pad_q=2, pad_k=3)
    dout = mk.random_array(rng, q.shape, "bfloat16")
    kw = dict(FEATURES[feature])
    exp = ref.flash_attn_varlen_bwd_ref(dout, q, k, v, cu_q, cu_k, None, **kw)
    mq, mkv = max(lens_q), max(lens_k)
    grads = jax.jit(lambda q, k, v, cq, ck, do: jax.vjp(
        lambda q, k, v: xj.flash_attn_varlen(q, k, v, cq, ck, mq, mkv, deterministic=True, **kw),
        q, k, v)[1](do))
    args = _on(gpu_device, q, k, v, cu_q, cu_k, dout)
    text = grads.lower(*args).as_text()
    assert "xla_attn_flash_bwd_v1" in text and "xla_attn_flash_bwd_v2" not in text
    first, again = grads(*args), grads(*args)
    for name, g, g2, e in zip(("dq", "dk", "dv"), first, again, exp):
        assert ref.rel_error(g, e) < ref.BOUNDS["bfloat16"], name
        assert np.array_equal(np.asarray(g), np.asarray(g2)), f"{name} differs between runs"
    assert np.all(np.asarray(first[0], np.float64)[cu_q[-1]:] == 0)


def _assert_grads_close(got, exp, dtype):
    """(dq, dk, dv) each within BOUNDS[dtype] of the float64 reference."""
    for name, g, e in zip(("dq", "dk", "dv"), got, exp):
        err = ref.rel_error(g, e)
        assert err < ref.BOUNDS[dtype], f"{name}: {err:.3g}"


def _check_backward(device, rng, mk, dtype, head_dim, feature, lens_q, lens_k, heads, heads_k):
    q, k, v, cu_q, cu_k = mk.varlen_inputs(rng, dtype, lens_q, lens_k, heads=heads,
                                           heads_k=heads_k, head_dim=head_dim, pad_q=2, pad_k=3)
    dout = mk.random_array(rng, q.shape, dtype)
    kw = _feature_kwargs(rng, mk, feature, heads, len(lens_q))
    exp = ref.flash_attn_varlen_bwd_ref(dout, q, k, v, cu_q, cu_k, None, **kw)
    kw_dev = _kwargs_on(device, kw)

    def grads(q, k, v, cq, ck, do):
        f = lambda q, k, v: xj.flash_attn_varlen(q, k, v, cq, ck, max(lens_q),  # noqa: E731
                                                 max(lens_k), **kw_dev)
        return jax.vjp(f, q, k, v)[1](do)

    got = jax.jit(grads)(*_on(device, q, k, v, cu_q, cu_k, dout))
    _assert_grads_close(got, exp, dtype)
    # Padding rows of dq and keys outside every sequence: exactly zero.
    assert np.all(np.asarray(got[0], np.float64)[cu_q[-1]:] == 0)
    assert np.all(np.asarray(got[1], np.float64)[cu_k[-1]:] == 0)
    assert np.all(np.asarray(got[2], np.float64)[cu_k[-1]:] == 0)


@pytest.mark.parametrize("feature", ["plain", "causal", "causal_window_softcap", "alibi_batch"])
@pytest.mark.parametrize("head_dim", [32, 64, 128, 256])
@pytest.mark.parametrize("shape", [(3, 200, 333), (2, 333, 130), (2, 256, 256)],
                         ids=["sq<sk", "sq>sk", "whole tiles"])
def test_flash_dense(family, gpu_device, rng, mk, shape, head_dim, feature):
    """The dense layout (B, S, H, D), which the varlen kernels take as sequences of S
    rows (the offsets 0, S, 2S, ...; jax.py, _dense_cu): forward, lse and gradients
    against the float64 reference; partial last tiles, Sq != Sk, GQA, per-sequence
    ALiBi. The outputs are XLA's buffers, which this test cannot fill: a first call on
    NaN inputs of the same shapes leaves NaN in the buffers its allocator hands the
    second call, so that rows a kernel skips show."""
    b, sq, sk = shape
    dtype, heads, heads_k = "bfloat16", 4, 2
    q = mk.random_array(rng, (b, sq, heads, head_dim), dtype)
    k = mk.random_array(rng, (b, sk, heads_k, head_dim), dtype)
    v = mk.random_array(rng, (b, sk, heads_k, head_dim), dtype)
    dout = mk.random_array(rng, q.shape, dtype)
    kw = _feature_kwargs(rng, mk, feature, heads, b)
    want, want_lse = ref.flash_attn_ref(q, k, v, None, **kw)
    want_grads = ref.flash_attn_bwd_ref(dout, q, k, v, None, **kw)
    kw_dev = _kwargs_on(gpu_device, kw)

    def run(q, k, v, do):
        f = lambda q, k, v: xj.flash_attn(q, k, v, return_softmax_lse=True, **kw_dev)  # noqa: E731
        (out, lse), pull = jax.vjp(f, q, k, v)
        return out, lse, pull((do, jnp.zeros_like(lse)))

    step = jax.jit(run)
    nan = lambda x: np.full(x.shape, np.nan, x.dtype)  # noqa: E731
    jax.block_until_ready(step(*_on(gpu_device, nan(q), nan(k), nan(v), nan(dout))))
    out, lse, grads = step(*_on(gpu_device, q, k, v, dout))
    flat = lambda x: np.asarray(x).reshape(b * sq, heads, head_dim)  # noqa: E731
    heads_major = lambda x: np.asarray(x).transpose(1, 0, 2).reshape(heads, b * sq)  # noqa: E731
    ref.assert_attention_close(flat(out), flat(want), dtype, heads_major(lse),
                               heads_major(want_lse))
    _assert_grads_close(grads, want_grads, dtype)


@pytest.mark.parametrize("feature", ["plain", "causal", "window", "causal_window_softcap",
                                     "alibi_batch"])
@pytest.mark.parametrize("head_dim", [48, 64, 80, 128, 160, 256])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_flash_backward_sm90_nan_tails(gpu_device, rng, mk, monkeypatch, dtype, head_dim,
                                       feature):
    """The Hopper dk/dv kernels (with sm80's delta and dq-convert around them): Q / dO
    boxes of 64 rows and K / V boxes of 128 keys (d256: 64) read into the next sequence
    and into padding rows holding NaN, as do keys past seqused_k; GQA 3, several key
    blocks and row tiles, head_dims 48, 80 and 160 padded to 64, 128 and 256 (160: dQ's
    last accumulator chunks absent); dq, dk, dv against the float64 reference and
    exactly zero on padding rows."""
    (q, k, v, dout, cu_q, cu_k, seqused), (max_q, max_k) = _nan_tail_inputs(
        gpu_device, rng, mk, monkeypatch, dtype, head_dim, "sm90,sm80")
    kw = _feature_kwargs(rng, mk, feature, 6, len(cu_q) - 1)
    exp = ref.flash_attn_varlen_bwd_ref(dout, q, k, v, cu_q, cu_k, None, seqused_k=seqused, **kw)
    kw_dev = _kwargs_on(gpu_device, kw)

    def grads(q, k, v, cq, ck, su, do):
        f = lambda q, k, v: xj.flash_attn_varlen(q, k, v, cq, ck, max_q,  # noqa: E731
                                                 max_k, seqused_k=su, **kw_dev)
        return jax.vjp(f, q, k, v)[1](do)

    got = jax.jit(grads)(*_on(gpu_device, q, k, v, cu_q, cu_k, seqused, dout))
    for name, g, e in zip(("dq", "dk", "dv"), got, exp):
        g = np.asarray(g, np.float64)
        assert np.isfinite(g).all(), f"{name}: not finite"
        err = ref.rel_error(g, e)
        assert err < ref.BOUNDS[dtype], f"{name}: {err:.3g}"
    assert np.all(np.asarray(got[0], np.float64)[cu_q[-1]:] == 0)
    assert np.all(np.asarray(got[1], np.float64)[cu_k[-1]:] == 0)
    assert np.all(np.asarray(got[2], np.float64)[cu_k[-1]:] == 0)


@pytest.mark.parametrize("shape", ["g4-d128-bs16", "g8-d64-bs64", "g2-d256-bs32"])
@pytest.mark.parametrize("cache", ["bfloat16", "float16", "float8_e4m3fn", "float8_e5m2",
                                   "uint8-fp8_e4m3"])
def test_paged_attention_decode(paged_family, gpu_device, rng, mk, cache, shape):
    """Decode-sized query spans (1..4) beside a longer one (9 queries: past the decode
    kernel's span for every group here, so it takes the flash forward in "auto"), GQA
    groups 2/4/8 (the decode kernel's 4- and 8-row blocks), fp8 caches with scales."""
    group, dim, block_size = (int(x[1:]) if x[0] == "g" else int(x.lstrip("dbs"))
                              for x in shape.split("-"))
    qdtype = "float16" if cache == "float16" else "bfloat16"
    _skip_outside(paged_family if paged_family != "auto" else "portable",
                  qdtype if cache in ("bfloat16", "float16") else "float8_e4m3fn")
    heads_k = 2
    heads = group * heads_k
    seq_lens = np.array([300, 1, 64, 17, 999, 50], np.int32)
    q_lens = np.array([1, 1, 4, 9, 1, 2], np.int32)
    qsl = mk.cu_seqlens(q_lens)
    storage, fmt = (cache.split("-") + ["auto"])[:2]
    cache_dtype = "float8_e4m3fn" if storage == "uint8" else storage
    k, v, table = mk.paged_kv(rng, "float32", seq_lens, block_size, heads_k=heads_k, head_dim=dim)
    k, v = k.astype(mk.np_dtype(cache_dtype)), v.astype(mk.np_dtype(cache_dtype))
    if storage == "uint8":
        k, v = k.view(np.uint8), v.view(np.uint8)
    query = mk.random_array(rng, (int(qsl[-1]) + 3, heads, dim), qdtype)
    ks, vs = np.float32(0.5), np.float32(1.5)
    num_seqs = np.array(5, np.int32)  # the last row of the padded batch is not real
    exp = ref.paged_attention_ref(query, k, v, seq_lens, table, qsl, 0.1, sliding_window=200,
                                  soft_cap=20.0, k_scale=ks, v_scale=vs, num_seqs=num_seqs,
                                  kv_cache_dtype=fmt)
    args = _on(gpu_device, query, k, v, seq_lens, table, qsl, ks, vs, num_seqs)
    out = jax.jit(lambda q, k, v, sl, bt, qs, a, b, n: xj.paged_attention(
        q, k, v, sl, bt, qs, 0.1, sliding_window=200, soft_cap=20.0, k_scale=a, v_scale=b,
        num_seqs=n, kv_cache_dtype=fmt))(*args)
    ref.assert_attention_close(out, exp, qdtype, valid_rows=int(qsl[5]))


@pytest.mark.parametrize("feature", ["plain", "window_softcap", "fp8", "fp8_e5m2_d64"])
def test_paged_attention_decode_long_context(paged_family, gpu_device, rng, mk, feature):
    """Contexts long enough for the decode kernel to split the keys (and merge the
    partials), a GQA group of 4 over block size 16; a window that leaves splits empty;
    fp8 caches (their tiles converted in registers over a permuted head dim)."""
    heads, heads_k, dim, block_size = 8, 2, 64 if feature.endswith("d64") else 128, 16
    seq_lens = np.array([20000, 7000], np.int32)
    qsl = mk.cu_seqlens(np.array([1, 3], np.int32))
    k, v, table = mk.paged_kv(rng, "bfloat16", seq_lens, block_size, heads_k=heads_k,
                              head_dim=dim)
    query = mk.random_array(rng, (4, heads, dim), "bfloat16")
    kw = dict(sliding_window=3000, soft_cap=15.0) if feature == "window_softcap" else {}
    if feature.startswith("fp8"):
        _skip_outside(paged_family if paged_family != "auto" else "portable", "float8_e4m3fn")
        fp8 = "float8_e5m2" if "e5m2" in feature else "float8_e4m3fn"
        k = (k.astype(np.float32) * 3).astype(mk.np_dtype(fp8))
        v = (v.astype(np.float32) / 2).astype(mk.np_dtype(fp8))
        kw = dict(k_scale=np.float32(1 / 3), v_scale=np.float32(2.0))
    exp = ref.paged_attention_ref(query, k, v, seq_lens, table, qsl, 0.08, **kw)
    out = jax.jit(lambda q, k, v, sl, bt, qs: xj.paged_attention(q, k, v, sl, bt, qs, 0.08, **kw))(
        *_on(gpu_device, query, k, v, seq_lens, table, qsl))
    ref.assert_attention_close(out, exp, "bfloat16")


def _paged_case(rng, mk, cache, q_lens, seq_lens, heads=8, heads_k=2, dim=128, block_size=16):
    """query (+2 padding rows), a bf16 or fp8 (scaled) paged cache, tables, qsl."""
    qsl = mk.cu_seqlens(np.asarray(q_lens, np.int32))
    k, v, table = mk.paged_kv(rng, "float32", seq_lens, block_size, heads_k=heads_k, head_dim=dim)
    scales = {}
    if cache != "bfloat16":
        k, v = (k * 3).astype(mk.np_dtype(cache)), (v / 2).astype(mk.np_dtype(cache))
        scales = dict(k_scale=np.float32(1 / 3), v_scale=np.float32(2.0))
    else:
        k, v = k.astype(mk.np_dtype(cache)), v.astype(mk.np_dtype(cache))
    query = mk.random_array(rng, (int(qsl[-1]) + 2, heads, dim), "bfloat16")
    return query, k, v, np.asarray(seq_lens, np.int32), table, qsl, scales


def _paged_on(device, query, k, v, seq_lens, table, qsl, scales, **kw):
    """xla_attn.jax.paged_attention under jit on `device`; array keywords go as operands."""
    arrays = {n: x for n, x in {**scales, **kw}.items() if isinstance(x, np.ndarray | np.float32)}
    static = {n: x for n, x in kw.items() if n not in arrays}
    names = list(arrays)
    fn = jax.jit(lambda q, k, v, sl, bt, qs, *xs: xj.paged_attention(
        q, k, v, sl, bt, qs, 0.1, **dict(zip(names, xs)), **static))
    return np.asarray(fn(*_on(device, query, k, v, seq_lens, table, qsl,
                              *arrays.values())), np.float32)


PAGED_SPANS = {
    # (query counts, key counts): decode spans only (the decode kernels), and a
    # chunked-prefill mix whose 37- and 64-token spans (past the decode kernels' 4 for
    # a GQA group of 4) take the flash forward over the block table.
    "decode": ([1, 1, 1, 1, 1, 1], [300, 1, 64, 17, 999, 50]),
    "chunked_prefill": ([1, 37, 3, 1, 64, 2], [300, 80, 64, 17, 999, 50]),
}


@pytest.mark.parametrize("hint", [False, True], ids=["no_hint", "max_query_len"])
@pytest.mark.parametrize("spans", list(PAGED_SPANS))
@pytest.mark.parametrize("cache", ["bfloat16", "float8_e4m3fn"])
def test_paged_attention_alibi(paged_family, gpu_device, rng, mk, cache, spans, hint):
    """ALiBi slopes on every paged route (the decode kernels for short spans, the flash
    forward for long ones), with a window and a soft cap, bf16 and fp8 caches; with
    max_query_len the exact bound (1 on the decode batch: the decode kernel alone)."""
    _skip_outside(paged_family if paged_family != "auto" else "portable",
                  "bfloat16" if cache == "bfloat16" else "float8_e4m3fn")
    q_lens, seq_lens = PAGED_SPANS[spans]
    query, k, v, lens, table, qsl, scales = _paged_case(rng, mk, cache, q_lens, seq_lens)
    slopes = mk.alibi(rng, 8) / 8  # 0.006..0.125 a key: far keys still count
    num_seqs = np.array(5, np.int32)
    kw = dict(sliding_window=200, soft_cap=20.0, num_seqs=num_seqs, alibi_slopes=slopes)
    if hint:
        kw["max_query_len"] = max(q_lens)
    out = _paged_on(gpu_device, query, k, v, lens, table, qsl, scales, **kw)
    exp = ref.paged_attention_ref(query, k, v, lens, table, qsl, 0.1, sliding_window=200,
                                  soft_cap=20.0, num_seqs=num_seqs, alibi_slopes=slopes,
                                  **scales)
    ref.assert_attention_close(out, exp, "bfloat16", valid_rows=int(qsl[5]))
    assert np.all(out[qsl[5]:] == 0)  # the padded batch's rows past num_seqs
    plain = ref.paged_attention_ref(query, k, v, lens, table, qsl, 0.1, sliding_window=200,
                                    soft_cap=20.0, num_seqs=num_seqs, **scales)
    assert ref.rel_error(out[:qsl[5]], plain[:qsl[5]]) > 0.05  # the slopes were applied


def test_paged_attention_sm90_walk(gpu_device, rng, mk, monkeypatch):
    """paged_attention on the Hopper forward alone (XLA_ATTN_FORCE_FAMILY=sm90), its row
    blocks walked by 3 blocks (XLA_ATTN_SM90_BLOCKS): the chunked-prefill mix with
    num_seqs 5 of 6, whose rows past num_seqs the padding item's consumer threads zero
    while the producer walks on."""
    if not _is_sm90(gpu_device):
        pytest.skip("the sm90 family runs on sm_90 only")
    monkeypatch.setenv("XLA_ATTN_FORCE_FAMILY", "sm90")
    monkeypatch.setenv("XLA_ATTN_SM90_BLOCKS", "3")
    q_lens, seq_lens = PAGED_SPANS["chunked_prefill"]
    # 32 heads: 192 row blocks, enough for the launcher not to split the keys (which
    # the sm90 family does not do)
    query, k, v, lens, table, qsl, scales = _paged_case(rng, mk, "bfloat16", q_lens, seq_lens,
                                                        heads=32, heads_k=8)
    num_seqs = np.array(5, np.int32)
    out = _paged_on(gpu_device, query, k, v, lens, table, qsl, scales, num_seqs=num_seqs,
                    sliding_window=200)
    exp = ref.paged_attention_ref(query, k, v, lens, table, qsl, 0.1, num_seqs=num_seqs,
                                  sliding_window=200, **scales)
    ref.assert_attention_close(out, exp, "bfloat16", valid_rows=int(qsl[5]))
    assert np.all(out[qsl[5]:] == 0)


@pytest.mark.parametrize("dim", [128, 256], ids=["mma_d128", "fma_d256"])
@pytest.mark.parametrize("cache", ["bfloat16", "float8_e4m3fn"])
def test_paged_attention_max_query_len_one_is_the_decode_kernel_alone(gpu_device, rng, mk,
                                                                      monkeypatch, cache, dim):
    """A decode batch with max_query_len=1 launches the decode kernel only (no flash
    forward): the same bits as without the hint, where the flash forward runs too and
    finds nothing to do."""
    monkeypatch.delenv("XLA_ATTN_FORCE_FAMILY", raising=False)
    q_lens, seq_lens = PAGED_SPANS["decode"]
    query, k, v, lens, table, qsl, scales = _paged_case(rng, mk, cache, q_lens, seq_lens, dim=dim)
    slopes = mk.alibi(rng, 8) / 8
    hinted = _paged_on(gpu_device, query, k, v, lens, table, qsl, scales, alibi_slopes=slopes,
                       max_query_len=1)
    plain = _paged_on(gpu_device, query, k, v, lens, table, qsl, scales, alibi_slopes=slopes)
    np.testing.assert_array_equal(hinted, plain)
    exp = ref.paged_attention_ref(query, k, v, lens, table, qsl, 0.1, alibi_slopes=slopes,
                                  **scales)
    ref.assert_attention_close(hinted, exp, "bfloat16", valid_rows=int(qsl[-1]))


@pytest.mark.parametrize("dim", [128, 256], ids=["mma_d128", "fma_d256"])
@pytest.mark.parametrize("cache", ["bfloat16", "float8_e4m3fn"])
def test_paged_attention_wrong_max_query_len_gives_nan_rows(gpu_device, rng, mk, monkeypatch,
                                                            cache, dim):
    """A max_query_len within the decode kernels' span (so no flash forward runs) that a
    longer sequence breaks: that sequence's rows, and only they, are NaN; the others are
    right and padding rows 0."""
    monkeypatch.delenv("XLA_ATTN_FORCE_FAMILY", raising=False)
    q_lens, seq_lens = [1, 9, 2, 1], [40, 70, 33, 5]
    query, k, v, lens, table, qsl, scales = _paged_case(rng, mk, cache, q_lens, seq_lens, dim=dim)
    out = _paged_on(gpu_device, query, k, v, lens, table, qsl, scales, max_query_len=2)
    long_rows = np.zeros(out.shape[0], bool)
    long_rows[qsl[1]:qsl[2]] = True
    assert np.isnan(out[long_rows]).all()
    assert not np.isnan(out[~long_rows]).any()
    exp = ref.paged_attention_ref(query, k, v, lens, table, qsl, 0.1, **scales)
    ref.assert_attention_close(out[~long_rows], exp[~long_rows], "bfloat16")
    assert np.all(out[qsl[-1]:] == 0)


def _poison_tails(rng, mk, k, v, seq_lens, table, dtype_name):
    """NaN / inf bits in each sequence's last block past its end: slots a real cache has
    not written yet, which a kernel must not let into the result (0 * NaN)."""
    bs = k.shape[1]
    for s, n in enumerate(seq_lens):
        if n % bs:
            blk = table[s, (n - 1) // bs]
            for cache in (k, v):
                cache[blk, n % bs:] = mk.random_bits(rng, cache[blk, n % bs:].shape, dtype_name)


def _decode_cache(rng, mk, cache, seq_lens, block_size, heads_k, dim):
    """A paged K/V cache of dtype `cache` for seq_lens (fp8: values scaled into e4m3's
    range, with the k/v scales that undo it), NaN / inf bits in the unwritten slots."""
    k, v, table = mk.paged_kv(rng, "float32", seq_lens, block_size, heads_k=heads_k,
                              head_dim=dim)
    scales = {}
    if cache.startswith("float8"):
        k, v = (k * 3).astype(mk.np_dtype(cache)), (v / 2).astype(mk.np_dtype(cache))
        scales = dict(k_scale=np.float32(1 / 3), v_scale=np.float32(2.0))
    else:
        k, v = k.astype(mk.np_dtype(cache)), v.astype(mk.np_dtype(cache))
    _poison_tails(rng, mk, k, v, seq_lens, table, cache)
    return k, v, table, scales


@pytest.mark.parametrize("feature", ["plain", "window_softcap_alibi"])
@pytest.mark.parametrize("block_size", [16, 32, 128])
@pytest.mark.parametrize("dim", [64, 128])
@pytest.mark.parametrize("cache", ["bfloat16", "float16", "float8_e4m3fn", "float8_e5m2"])
def test_paged_attention_decode_tma(gpu_device, rng, mk, monkeypatch, cache, dim, block_size,
                                    feature):
    """The Hopper decode kernel (tiles landed by bulk tensor copies) on its own: forced
    onto its family with max_query_len=1, no other kernel may run, so a call it did not
    take fails. GQA groups of 4 and 8, contexts from 1 to 20000 keys (the long one split
    and merged), partial last tiles whose unwritten slots hold NaN / inf bits, a window
    that starts inside a tile, every cache format it covers. Rows under 256 bytes take the
    kernel that reads kv heads together where they group (2 and 4 kv heads: pairs of
    128-byte rows, fours of 64), the one-head kernel where they do not (3)."""
    if float(getattr(gpu_device, "compute_capability", "0")) < 9.0:
        pytest.skip("the Hopper decode kernel needs sm_90")
    monkeypatch.setenv("XLA_ATTN_FORCE_FAMILY", "decode_sm90")
    qdtype = "float16" if cache == "float16" else "bfloat16"
    for heads, heads_k in ((8, 2), (16, 2), (12, 3), (16, 4)):
        seq_lens = np.array([300, 1, 64, 17, 999, 20000, 45], np.int32)
        qsl = mk.cu_seqlens(np.ones(len(seq_lens), np.int32))
        k, v, table, scales = _decode_cache(rng, mk, cache, seq_lens, block_size, heads_k, dim)
        query = mk.random_array(rng, (len(seq_lens) + 2, heads, dim), qdtype)
        kw = {}
        if feature != "plain":
            kw = dict(sliding_window=203, soft_cap=20.0, alibi_slopes=mk.alibi(rng, heads) / 8)
        out = _paged_on(gpu_device, query, k, v, seq_lens, table, qsl, scales, max_query_len=1,
                        **kw)
        exp = ref.paged_attention_ref(query, k, v, seq_lens, table, qsl, 0.1, **scales, **kw)
        ref.assert_attention_close(out, exp, qdtype, valid_rows=len(seq_lens))
        assert np.all(out[len(seq_lens):] == 0)


@pytest.mark.parametrize("family_name, min_cc", [("decode_sm90", 9.0), ("decode", 8.0)])
@pytest.mark.parametrize("cache, dim, heads, heads_k", [
    ("float8_e4m3fn", 128, 16, 4), ("bfloat16", 64, 16, 4), ("float8_e5m2", 128, 16, 4),
    ("float8_e4m3fn", 64, 16, 8)])
def test_paged_attention_decode_heads_together_two_token_spans(gpu_device, rng, mk,
                                                               monkeypatch, cache, dim,
                                                               heads, heads_k, family_name,
                                                               min_cc):
    """The kernels that read kv heads together (Hopper TMA and sm_80 cp.async), with
    spans of up to 2 query tokens (2 heads x GQA 4 x 2 tokens, or 4 heads x GQA 2 x 2
    tokens: the m16 tile full): rows of every head and token land in their own places,
    the causal offset holds per token, and sequences with one token sit next to them.
    Splits (20000 keys) and NaN in unwritten slots included."""
    if float(getattr(gpu_device, "compute_capability", "0")) < min_cc:
        pytest.skip(f"the {family_name} decode kernels need sm_{int(min_cc * 10)}")
    monkeypatch.setenv("XLA_ATTN_FORCE_FAMILY", family_name)
    seq_lens = np.array([300, 2, 64, 20000, 45], np.int32)
    qsl = mk.cu_seqlens(np.array([2, 2, 1, 2, 1], np.int32))
    k, v, table, scales = _decode_cache(rng, mk, cache, seq_lens, 16, heads_k, dim)
    query = mk.random_array(rng, (int(qsl[-1]) + 2, heads, dim), "bfloat16")
    kw = dict(soft_cap=20.0, alibi_slopes=mk.alibi(rng, heads) / 8)
    out = _paged_on(gpu_device, query, k, v, seq_lens, table, qsl, scales, max_query_len=2, **kw)
    exp = ref.paged_attention_ref(query, k, v, seq_lens, table, qsl, 0.1, **scales, **kw)
    ref.assert_attention_close(out, exp, "bfloat16", valid_rows=int(qsl[-1]))
    assert np.all(out[int(qsl[-1]):] == 0)


def test_split_kv_long_context(family, gpu_device, rng, mk):
    """Few (row, head) blocks over long keys: the forward splits the keys across
    blocks and merges the partials (flash-decoding). Same result as the reference."""
    lens_q, lens_k = [1, 3], [20000, 9000]
    q, k, v, cu_q, cu_k = mk.varlen_inputs(rng, "bfloat16", lens_q, lens_k, heads=2, heads_k=1,
                                           head_dim=128)
    exp_out, exp_lse = ref.flash_attn_varlen_ref(q, k, v, cu_q, cu_k, None, causal=True)
    out, lse = jax.jit(lambda *a: xj.flash_attn_varlen(*a, 3, 20000, causal=True,
                                                       return_softmax_lse=True))(
        *_on(gpu_device, q, k, v, cu_q, cu_k))
    ref.assert_attention_close(out, exp_out, "bfloat16", lse, exp_lse)


def test_hostile_indices_stay_in_bounds(paged_family, gpu_device, rng, mk):
    """cu_seqlens and block tables are device data: garbage in them must not crash
    or read out of bounds (run under compute-sanitizer memcheck in the GPU pass)."""
    q, k, v, _, _ = mk.varlen_inputs(rng, "bfloat16", [8, 8], [8, 8], heads=2, heads_k=2,
                                     head_dim=64)
    cu_q = np.array([0, 2**31 - 1, -5], np.int32)
    cu_k = np.array([-(2**31), 7, 2**30], np.int32)
    out = jax.jit(lambda *a: xj.flash_attn_varlen(*a, 8, 8))(*_on(gpu_device, q, k, v, cu_q, cu_k))
    jax.block_until_ready(out)
    grads = jax.jit(lambda q, k, v, cq, ck: jax.grad(
        lambda q, k, v: xj.flash_attn_varlen(q, k, v, cq, ck, 8, 8).astype(jnp.float32).sum(),
        argnums=(0, 1, 2))(q, k, v))(*_on(gpu_device, q, k, v, cu_q, cu_k))
    jax.block_until_ready(grads)
    kc, vc, table = mk.paged_kv(rng, "bfloat16", [40], 16, heads_k=2, head_dim=64)
    table[0, :] = rng.choice(np.array([-1, 10**6, 2**31 - 1, 0], np.int32), table.shape[1])
    out = jax.jit(lambda q, kc, vc, sl, bt, qs: xj.paged_attention(q, kc, vc, sl, bt, qs, 0.1))(
        *_on(gpu_device, q[:4], kc, vc, np.array([2**31 - 1], np.int32), table,
             np.array([0, 2**30], np.int32)))
    assert np.isfinite(np.asarray(out, np.float32)).all()
