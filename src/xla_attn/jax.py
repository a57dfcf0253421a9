"""JAX frontend: the ops as XLA FFI custom calls (cpu and CUDA), differentiable
flash attention through jax.custom_vjp, and an in-place (aliased) cache write.

Sharding. Under `jax.jit` with sharded inputs each op runs once per shard, with no
gather of its operands, when the heads (and, for `flash_attn`, the batch) are what is
sharded: a `jax.experimental.custom_partitioning` rule (a Shardy `sharding_rule`, and
the GSPMD callbacks when Shardy is off) keeps query heads, kv heads and the dense
batch split as given and everything else (tokens, head_dim, index arrays) whole. KV
heads are split with the query heads when the number of shards divides num_heads_k;
when instead num_heads_k divides it (MQA, or GQA with fewer kv heads than shards) kv
stays replicated and each shard reads its one kv head; other head counts are gathered.
`sharded` wraps an op in `jax.shard_map` for code that prefers explicit SPMD, and for
programs to `jax.export` (which cannot serialize custom_partitioning).

vmap. Flash attention folds the mapped axis into the heads (varlen) or the batch
(dense), so a vmapped call is one kernel launch; the other ops, and flash calls whose
index arrays are mapped too, run once per element (`jax.lax.map`), equal to a loop.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import math
from typing import Callable

import jax
from jax.custom_batching import custom_vmap
from jax.custom_derivatives import CustomVJPPrimal, SymbolicZero
from jax.experimental.custom_partitioning import custom_partitioning
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P
import numpy as np

from xla_attn import _native, _ops

__all__ = ["flash_attn_varlen", "flash_attn", "paged_attention", "reshape_and_cache_flash",
           "sharded"]


@functools.cache
def _register() -> None:
    for target, (host, cuda) in _native.HANDLERS.items():
        jax.ffi.register_ffi_target(target, _native.capsule(host), platform="cpu")
        jax.ffi.register_ffi_target(target, _native.capsule(cuda), platform="CUDA")


def _call(target: str, results, *operands, aliases=None, **attributes):
    _register()
    attrs = {k: (np.float32(v) if isinstance(v, float) else v) for k, v in attributes.items()}
    # vmap normally stops at _apply's rule; inside shard_map the calls come here directly.
    call = jax.ffi.ffi_call(target, results, vmap_method="sequential",
                            input_output_aliases=aliases)
    outputs = call(*operands, **attrs)
    # Inside shard_map a custom call's results vary along every mesh axis any operand
    # varies along; XLA's types do not say so by themselves.
    axes = frozenset().union(*(_vma(x) for x in operands))
    if not axes:
        return outputs
    if isinstance(outputs, (tuple, list)):
        return type(outputs)(_vary(o, axes) for o in outputs)
    return _vary(outputs, axes)


def _vma(x) -> frozenset:
    """Mesh axes along which x varies inside shard_map (empty outside it). jax 0.7-0.8
    call them `aval.vma`, later releases `aval.manual_axis_type.varying`."""
    if not hasattr(jax, "typeof"):
        return frozenset()
    aval = jax.typeof(x)
    mat = getattr(aval, "manual_axis_type", None)
    return frozenset(mat.varying if mat is not None else getattr(aval, "vma", ()))


def _vary(x, axes: frozenset):
    """x typed as varying along `axes` inside shard_map (a no-op elsewhere)."""
    missing = tuple(sorted(axes - _vma(x)))
    if not missing:
        return x
    if hasattr(jax.lax, "pcast"):
        return jax.lax.pcast(x, missing, to="varying")
    return jax.lax.pvary(x, missing)


def _cotangent(g, primal, axes: frozenset):
    """A cotangent computed per shard from operands varying along `axes`, for a
    primal varying along fewer: the primal is shared by those shards (e.g. k/v
    replicated across head shards in MQA/GQA), so its gradient is the sum."""
    extra = tuple(sorted(axes - _vma(primal)))
    return jax.lax.psum(g, extra) if extra else g


def _absent(dtype) -> jax.Array:
    """An optional operand that is not there: a zero-element buffer (docs/xla-targets.md)."""
    return jnp.zeros((0,), dtype)


def _or_absent(x, dtype):
    return _absent(dtype) if x is None else jnp.asarray(x)


def _maybe(x):
    return None if x is None else jnp.asarray(x)


# ---------------------------------------------------------------- which dims may be split
# One letter per dimension of each array argument or result, by op and argument name:
# H query heads, K kv heads (split together with H), B the batch of the dense layout,
# "." a dimension that stays whole on every shard (tokens, head_dim, blocks; index
# arrays are all "."). Several entries: one per rank the argument may have. vmap adds
# a leading digit (0, 1, ... by nesting depth) for each mapped axis it folds.
_DIMS = {
    "flash_attn_varlen": dict(q=".H.", k=(".K.", "..K."), v=(".K.", "..K."), dout=".H.",
                              out=".H.", softmax_lse="H.", dlse="H.",
                              alibi_slopes=("H", ".H")),
    "flash_attn": dict(q="B.H.", k="B.K.", v="B.K.", dout="B.H.", out="B.H.",
                       softmax_lse="BH.", dlse="BH.", alibi_slopes=("H", "BH")),
    "paged_attention": dict(query=".H.", key_cache="..K.", value_cache="..K.", out=".H.",
                            alibi_slopes="H"),
    "reshape_and_cache_flash": dict(key=".K.", value=".K.", key_cache="..K.",
                                    value_cache="..K."),
}


def _dims(family: str, name: str, ndim: int | None = None) -> str:
    """The letters of argument `name` of rank `ndim` (None: the only rank it has)."""
    known = _DIMS[family].get(name, ())
    known = (known,) if isinstance(known, str) else known
    for dims in known:
        if ndim is None or len(dims) == ndim:
            return dims
    return "." * ndim


@dataclasses.dataclass(frozen=True)
class _Op:
    """One custom call as the partitioner and vmap see it (hashable: it is the static
    argument of custom_partitioning). `impl(spec, *operands)` computes the results on
    whole arrays or on one shard's; None operands are absent."""

    impl: Callable
    spec: object
    operands: tuple  # the letters of each operand (None where the operand is absent)
    results: tuple   # the letters of each result
    heads: int       # num_heads (num_heads_k where no operand has query heads)
    heads_k: int
    lead: int        # the operand whose sharding is looked at first
    fold: str = ""   # letters vmap may fold a mapped axis into ("": loop instead)

    @property
    def head_letter(self) -> str:
        return "H" if any(d and "H" in d for d in self.operands) else "K"


def _op(family, impl, spec, names, operands, results, lead=0, fold="") -> _Op:
    dims = tuple(None if x is None else _dims(family, n, x.ndim)
                 for n, x in zip(names, operands))
    ranks = {n: x.ndim for n, x in zip(names, operands) if x is not None}
    sizes = {c: x.shape[i] for d, x in zip(dims, operands) if d for i, c in enumerate(d)}
    return _Op(impl, spec, dims, tuple(_dims(family, n, ranks.get(n)) for n in results),
               sizes.get("H", sizes.get("K")), sizes.get("K", 1), lead, fold)


def _apply(op: _Op, *operands):
    """op.impl on whole arrays: split per shard under jit, batched under vmap."""
    if any(_vma(x) for x in operands if x is not None):
        return op.impl(op.spec, *operands)  # inside shard_map: already one shard's arrays
    fn = custom_vmap(lambda *xs: _partitioned(op, *xs))
    fn.def_vmap(functools.partial(_vmap_rule, op))
    return fn(*operands)


# ---------------------------------------------------------------- partitioning
@dataclasses.dataclass(frozen=True)
class _Plan:
    """How one call is split: (letter, mesh axes) for each split letter, and whether kv
    heads are split with the query heads ("shard") or kept whole on every shard, each
    shard using its one kv head ("slice": num_heads_k divides the number of shards)."""

    split: tuple = ()
    kv: str = "shard"

    def axes(self, letter: str) -> tuple:
        return dict(self.split).get(letter, ())


def _axes(entry) -> tuple:
    return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def _size(mesh, axes: tuple) -> int:
    return math.prod(mesh.shape[a] for a in axes)


def _head_plan(heads: int, heads_k: int, axes: tuple, n: int, has_query_heads: bool):
    """(axes, kv mode) for splitting the heads n ways, or ((), "shard") when they
    cannot be: then the heads stay whole and XLA gathers them."""
    if not axes or heads % n:
        return (), "shard"
    if heads_k % n == 0:
        return axes, "shard"
    if has_query_heads and n % heads_k == 0:
        return axes, "slice"
    return (), "shard"


def _plan(op: _Op, mesh, arg_shapes) -> _Plan:
    """Split each letter as the first operand that has it split (the lead first: an
    operand computed in the program, like dout, may arrive replicated), where its
    size allows; a mesh axis serves one letter only."""
    order = [op.lead] + [i for i in range(len(op.operands)) if i != op.lead]
    head = op.head_letter
    letters = [head] + sorted({c for d in op.operands if d for c in d} - set(".HK"))
    split, used, kv = [], set(), "shard"
    for letter in letters:
        axes, size = _first_split(op, arg_shapes, order, letter)
        if used & set(axes):
            continue
        if letter == head:
            axes, kv = _head_plan(op.heads, op.heads_k, axes, _size(mesh, axes), head == "H")
        elif size % _size(mesh, axes):
            continue
        if axes:
            split.append((letter, axes))
            used.update(axes)
    if head == "H" and kv == "shard" and dict(split).get("H"):
        split.append(("K", dict(split)["H"]))
    return _Plan(tuple(split), kv)


def _first_split(op: _Op, arg_shapes, order, letter: str) -> tuple[tuple, int]:
    """(mesh axes, size) of dimension `letter` in the first operand that splits it."""
    for i in order:
        dims, shape = op.operands[i], arg_shapes[i]
        sharding = getattr(shape, "sharding", None)
        if not dims or letter not in dims or not isinstance(sharding, NamedSharding):
            continue
        d = dims.index(letter)
        axes = _axes((tuple(sharding.spec) + (None,) * len(dims))[d])
        if axes:
            return axes, shape.shape[d]
    return (), 0


def _spec(dims: str, plan: _Plan) -> P:
    def entry(c):
        axes = plan.axes(c)
        return None if not axes else axes[0] if len(axes) == 1 else axes
    return P(*(entry(c) for c in dims))


def _kv_head(plan: _Plan, mesh, heads_k: int):
    """The kv head of this shard when kv heads are fewer than the shards ("slice")."""
    heads = plan.axes("H")
    return jax.lax.axis_index(heads) // (_size(mesh, heads) // heads_k)


def _per_shard(op: _Op, plan: _Plan, mesh):
    """op.impl on one shard's operands; in "slice" mode it first takes this shard's kv
    head and afterwards sums kv results (gradients) over the shards sharing a head."""
    if plan.kv != "slice":
        return lambda *xs: op.impl(op.spec, *xs)

    def run(*xs):
        index = _kv_head(plan, mesh, op.heads_k) if op.heads_k > 1 else 0
        xs = [x if d is None or "K" not in d else
              jax.lax.dynamic_slice_in_dim(x, index, 1, d.index("K"))
              for x, d in zip(xs, op.operands)]
        results = op.impl(op.spec, *xs)
        return tuple(r if "K" not in d else _kv_sum(r, d.index("K"), index, op.heads_k, plan)
                     for r, d in zip(results, op.results))
    return run


def _kv_sum(r, axis: int, index, heads_k: int, plan: _Plan):
    if heads_k > 1:
        shape = r.shape[:axis] + (heads_k,) + r.shape[axis + 1:]
        r = jax.lax.dynamic_update_slice_in_dim(jnp.zeros(shape, r.dtype), r, index, axis)
    return jax.lax.psum(r, plan.axes("H"))


def _partition(op: _Op, mesh, arg_shapes, result_shape):
    plan = _plan(op, mesh, arg_shapes)
    args = tuple(None if d is None else NamedSharding(mesh, _spec(d, plan)) for d in op.operands)
    results = tuple(NamedSharding(mesh, _spec(d, plan)) for d in op.results)
    return mesh, _per_shard(op, plan, mesh), results, args


def _infer(op: _Op, mesh, arg_shapes, result_shape):
    plan = _plan(op, mesh, arg_shapes)
    return tuple(NamedSharding(mesh, _spec(d, plan)) for d in op.results)


def _rule(op: _Op, mesh, operand_types, result_types):
    """The Shardy sharding rule: H, K, B and vmap's digits are factors Shardy may split
    (query heads as the compound (k g) of kv heads and group, so both split alike),
    every other dimension a factor of its own that must stay whole. Shardy would have
    to cut a mesh axis into sub-axes to put it on k when k is smaller, so q and kv
    heads are tied only when every mesh axis divides num_heads_k; untied, kv keeps its
    sharding and the partition step decides."""
    group = op.heads // op.heads_k
    tied = op.heads_k > 1 and all(op.heads_k % s == 0 for s in mesh.shape.values())
    query = "k" if group == 1 else "(k g)" if tied else "h"
    whole = []

    def factor(c):
        if c == ".":
            whole.append(f"w{len(whole)}")
            return whole[-1]
        return {"H": query, "K": "k", "B": "b"}.get(c, f"v{c}")

    def factors(dims):
        return " ".join(factor(c) for c in dims)

    operands = ", ".join(factors(d) for d in op.operands if d is not None)
    results = ", ".join(factors(d) for d in op.results)
    extra = {"g": group} if query == "(k g)" else {}
    return f"{operands} -> {results}", dict(need_replication_factors=tuple(whole), **extra)


def _run(op: _Op, *operands):
    return op.impl(op.spec, *operands)


_partitioned = custom_partitioning(_run, static_argnums=(0,))
_partitioned.def_partition(_partition, infer_sharding_from_operands=_infer, sharding_rule=_rule)


# ---------------------------------------------------------------- vmap
def _vmap_rule(op: _Op, axis_size: int, in_batched, *operands):
    results = _fold(op, axis_size, in_batched, operands)
    if results is None:
        results = _sequential(op, in_batched, operands)
    return results, tuple(True for _ in results)


def _folds(op: _Op, dims) -> bool:
    return bool(dims) and any(c in op.fold for c in dims)


def _fold(op: _Op, n: int, in_batched, operands):
    """One call for the whole mapped axis, folded into the heads (H and K together:
    query head v*H + i then uses kv head v*Hk + i // group, the GQA map of element v)
    or into the dense batch; None when a mapped operand has no such dimension. The
    fold itself happens per shard (_folded_impl), so split heads stay split."""
    if not op.fold:
        return None
    if any(b and x is not None and not _folds(op, d)
           for x, b, d in zip(operands, in_batched, op.operands)):
        return None
    operands = [jnp.broadcast_to(x, (n,) + x.shape) if _folds(op, d) and not b else x
                for x, b, d in zip(operands, in_batched, op.operands)]
    digit = str(sum(c.isdigit() for c in op.results[0]))
    folded = dataclasses.replace(
        op, impl=_folded_impl, spec=op,
        operands=tuple(digit + d if _folds(op, d) else d for d in op.operands),
        results=tuple(digit + d for d in op.results))
    return _apply(folded, *operands)


def _folded_impl(op: _Op, *operands):
    """op on operands with a leading mapped axis, folded into op.fold's dimension as
    its major part."""
    n = next(x.shape[0] for x, d in zip(operands, op.operands) if _folds(op, d))
    target = lambda d: next(i for i, c in enumerate(d) if c in op.fold)  # noqa: E731
    operands = [_merge(x, target(d)) if _folds(op, d) else x
                for x, d in zip(operands, op.operands)]
    results = op.impl(op.spec, *operands)
    return tuple(_split(r, target(d), n) for r, d in zip(results, op.results))


def _merge(x, axis: int):
    """x (n, ...) with n folded into dimension `axis` of x[0], as its major part."""
    x = jnp.moveaxis(x, 0, axis)
    return x.reshape(x.shape[:axis] + (-1,) + x.shape[axis + 2:])


def _split(x, axis: int, n: int):
    x = x.reshape(x.shape[:axis] + (n, x.shape[axis] // n) + x.shape[axis + 1:])
    return jnp.moveaxis(x, axis, 0)


def _sequential(op: _Op, in_batched, operands):
    mapped = [i for i, (x, b) in enumerate(zip(operands, in_batched)) if x is not None and b]

    def one(xs):
        args = list(operands)
        for i, x in zip(mapped, xs):
            args[i] = x
        return _apply(op, *args)
    return jax.lax.map(one, tuple(operands[i] for i in mapped))


# ---------------------------------------------------------------- flash attention
_FWD = ("q", "k", "v", "cu_seqlens_q", "cu_seqlens_k", "seqused_k", "block_table",
        "alibi_slopes", "q_descale", "k_descale", "v_descale")
_BWD = ("dout", "q", "k", "v", "out", "softmax_lse", "cu_seqlens_q", "cu_seqlens_k",
        "seqused_k", "alibi_slopes", "dlse")


def _flash_fwd_impl(spec: _ops.FlashSpec, q, k, v, cu_q, cu_k, seqused_k=None,
                    block_table=None, alibi=None, q_descale=None, k_descale=None,
                    v_descale=None):
    total_q, num_heads, head_dim = q.shape
    workspace = _native.flash_fwd_workspace_size(
        total_q, cu_q.shape[0] - 1, num_heads, head_dim, spec.max_seqlen_q, spec.max_seqlen_k,
        k.shape, jnp.dtype(k.dtype).name, spec.paged)
    results = (jax.ShapeDtypeStruct(q.shape, jnp.dtype(spec.out_dtype)),
               jax.ShapeDtypeStruct((num_heads, total_q), jnp.float32),
               jax.ShapeDtypeStruct((workspace,), jnp.uint8))
    out, lse, _ = _call("xla_attn_flash_fwd_v1", results, q, k, v, cu_q, cu_k,
                        _or_absent(seqused_k, jnp.int32), _or_absent(block_table, jnp.int32),
                        _or_absent(alibi, jnp.float32), _or_absent(q_descale, jnp.float32),
                        _or_absent(k_descale, jnp.float32), _or_absent(v_descale, jnp.float32),
                        **spec.attributes())
    return out, lse


def _flash_bwd_impl(spec: _ops.FlashSpec, dout, q, k, v, out, lse, cu_q, cu_k, seqused_k=None,
                    alibi=None, dlse=None):
    """dq, dk, dv; `dlse` (softmax_lse's cotangent, or None) rides the same call (v3)."""
    results = tuple(jax.ShapeDtypeStruct(x.shape, x.dtype) for x in (q, k, v))
    operands = (dout.astype(q.dtype), q, k, v, out, lse, cu_q, cu_k,
                _or_absent(seqused_k, jnp.int32), _or_absent(alibi, jnp.float32))
    if spec.deterministic and dlse is None:  # v1: no workspace, no atomics
        return tuple(_call("xla_attn_flash_bwd_v1", results, *operands, **spec.attributes()))
    total_q, num_heads, head_dim = q.shape
    # a 0-byte workspace takes v2 / v3 onto v1's deterministic path
    workspace = 0 if spec.deterministic else _native.flash_bwd_workspace_size(
        total_q, cu_q.shape[0] - 1, num_heads, head_dim, q.dtype.name)
    results += (jax.ShapeDtypeStruct((workspace,), jnp.uint8),)
    extra = () if dlse is None else (jnp.asarray(dlse, jnp.float32),)  # v3: v2 + dlse
    dq, dk, dv, _ = _call("xla_attn_flash_bwd_v3" if extra else "xla_attn_flash_bwd_v2",
                          results, *operands, *extra, **spec.attributes())
    return dq, dk, dv


def _dense_cu(b: int, s: int):
    return jnp.arange(b + 1, dtype=jnp.int32) * s


def _dense_fwd_impl(spec, q, k, v, alibi=None):
    """The dense layout on the varlen kernel: (B, S, H, D) is B sequences of S tokens."""
    (b, sq, h, _), sk = q.shape, k.shape[1]
    flat = lambda x: x.reshape((-1,) + x.shape[2:])  # noqa: E731
    out, lse = _flash_fwd_impl(spec, flat(q), flat(k), flat(v), _dense_cu(b, sq),
                               _dense_cu(b, sk), alibi=alibi)
    return out.reshape(q.shape[:3] + out.shape[-1:]), lse.reshape(h, b, sq).transpose(1, 0, 2)


def _dense_bwd_impl(spec, dout, q, k, v, out, lse, alibi=None, dlse=None):
    (b, sq, h, _), sk = q.shape, k.shape[1]
    flat = lambda x: x.reshape((-1,) + x.shape[2:])  # noqa: E731
    heads_major = lambda x: x.transpose(1, 0, 2).reshape(h, b * sq)  # noqa: E731
    grads = _flash_bwd_impl(spec, flat(dout), flat(q), flat(k), flat(v), flat(out),
                            heads_major(lse), _dense_cu(b, sq), _dense_cu(b, sk), alibi=alibi,
                            dlse=None if dlse is None else heads_major(dlse))
    return tuple(g.reshape(x.shape) for g, x in zip(grads, (q, k, v)))


def _fwd_op(spec, dense: bool, operands) -> _Op:
    if dense:
        return _op("flash_attn", _dense_fwd_impl, spec, ("q", "k", "v", "alibi_slopes"),
                   operands, ("out", "softmax_lse"), fold="B")
    # A paged cache would be copied once per mapped element to fold it: loop instead.
    return _op("flash_attn_varlen", _flash_fwd_impl, spec, _FWD, operands,
               ("out", "softmax_lse"), fold="" if spec.paged else "HK")


def _bwd_op(spec, dense: bool, operands) -> _Op:
    if dense:
        names = ("dout", "q", "k", "v", "out", "softmax_lse", "alibi_slopes", "dlse")
        return _op("flash_attn", _dense_bwd_impl, spec, names, operands, ("q", "k", "v"),
                   fold="B")
    return _op("flash_attn_varlen", _flash_bwd_impl, spec, _BWD, operands, ("q", "k", "v"),
               fold="HK")


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _flash_diff(spec, dense, q, k, v, cu_q, cu_k, seqused_k, alibi):
    # the varlen forward's operands are _FWD: no block_table here (not differentiable)
    operands = (q, k, v) + ((alibi,) if dense else (cu_q, cu_k, seqused_k, None, alibi))
    return _apply(_fwd_op(spec, dense, operands), *operands)


def _flash_diff_fwd(spec, dense, *primals):
    # symbolic zeros (defvjp below): each primal comes wrapped, with whether it is perturbed
    primals = tuple(x.value if isinstance(x, CustomVJPPrimal) else x for x in primals)
    q, k, v, cu_q, cu_k, seqused_k, alibi = primals
    out, lse = _flash_diff(spec, dense, *primals)
    return (out, lse), (q, k, v, out, lse, cu_q, cu_k, seqused_k, alibi)


def _flash_diff_bwd(spec, dense, residuals, cotangents):
    q, k, v, out, lse, cu_q, cu_k, seqused_k, alibi = residuals
    dout, dlse = cotangents  # either may be a SymbolicZero: its output is not used
    if isinstance(dout, SymbolicZero) and isinstance(dlse, SymbolicZero):
        dq, dk, dv = (jnp.zeros(x.shape, x.dtype) for x in (q, k, v))
    else:
        # softmax_lse_i = log sum_j exp(s_ij): its cotangent adds p_ij dlse_i to dS_ij, which
        # the kernels take as D_i = dout_i . out_i - dlse_i, in the same call.
        if isinstance(dout, SymbolicZero):
            dout = jnp.zeros(q.shape, q.dtype)
        dlse = None if isinstance(dlse, SymbolicZero) else dlse
        operands = (dout, q, k, v, out, lse) + ((alibi, dlse) if dense else (
            cu_q, cu_k, seqused_k, alibi, dlse))
        dq, dk, dv = _first_order_only(_bwd_op(spec, dense, operands), *operands)
    axes = _vma(dq)
    return (_cotangent(dq, q, axes), _cotangent(dk, k, axes), _cotangent(dv, v, axes),
            None, None, None, None)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _first_order_only(op, *operands):
    """The backward's call, which has no derivative of its own: differentiating through it
    (grad of grad, a Hessian) raises this rule's error instead of the partitioner's."""
    return _apply(op, *operands)


def _first_order_only_fwd(op, *operands):
    return _apply(op, *operands), None


def _first_order_only_bwd(op, residuals, cotangents):
    raise NotImplementedError(
        "xla_attn: flash attention is differentiable once: its backward has no derivative "
        "(grad of grad, Hessians and forward-mode autodiff are not supported)")


_first_order_only.defvjp(_first_order_only_fwd, _first_order_only_bwd)

# symbolic zeros: a softmax_lse that no loss uses adds no operand to the backward
_flash_diff.defvjp(_flash_diff_fwd, _flash_diff_bwd, symbolic_zeros=True)


def flash_attn_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q=None, max_seqlen_k=None,
                      softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                      alibi_slopes=None, seqused_k=None, block_table=None,
                      return_softmax_lse=False, q_descale=None, k_descale=None, v_descale=None,
                      deterministic=False):
    """Flash attention over packed variable-length sequences (flash-attn's
    `flash_attn_varlen_func`). q `(total_q, H, D)`; k, v `(total_k, Hk, D)` or, with
    `block_table`, a paged cache `(num_blocks, block_size, Hk, D)`. Returns out like q
    (bf16 for fp8 q) and, if asked, softmax_lse `(H, total_q)` float32.
    max_seqlen_q / max_seqlen_k (default total_q / total_k) bound every sequence's query
    and key count, as in flash-attn: they size the GPU launch, so rows and keys past them
    are not computed there (the Host refuses such a call when it runs, naming the
    sequence; for the backward every cu_seqlens_k span counts, seqused_k or not). Offsets
    given as numpy arrays (built on the host, or closed over under jit) are checked against
    them, and for order, when the call is traced; device arrays are not read back to check.
    Differentiable in q, k, v when not paged and not fp8, through out and softmax_lse
    alike (one backward call either way). The backward adds dq up with
    float atomics (its last bits may vary from run to run, as flash-attn's);
    `deterministic=True` takes the slower backward without them (bit-identical runs).

    Sharded under `jax.jit`: runs per shard when the heads of q are split over mesh
    axes (k, v split alike, or replicated when num_heads_k divides the shard count);
    total_q and total_k must not be split (they are gathered if they are).
    vmap: the mapped axis is folded into the heads (one call) unless cu_seqlens,
    seqused_k or the descales are mapped, or the cache is paged: then one call per element."""
    spec = _ops.flash_varlen_spec(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                  softmax_scale, causal, window_size, softcap, alibi_slopes,
                                  seqused_k, block_table, q_descale, k_descale, v_descale,
                                  deterministic=deterministic)
    q, k, v, cu_q, cu_k = map(jnp.asarray, (q, k, v, cu_seqlens_q, cu_seqlens_k))
    if spec.paged or spec.out_dtype != q.dtype:
        operands = (q, k, v, cu_q, cu_k) + tuple(map(_maybe, (
            seqused_k, block_table, alibi_slopes, q_descale, k_descale, v_descale)))
        out, lse = _apply(_fwd_op(spec, False, operands), *operands)
    else:
        out, lse = _flash_diff(spec, False, q, k, v, cu_q, cu_k, _maybe(seqused_k),
                               _maybe(alibi_slopes))
    return (out, lse) if return_softmax_lse else out


def flash_attn(q, k, v, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
               alibi_slopes=None, return_softmax_lse=False, deterministic=False):
    """Dense-layout flash attention: q `(B, Sq, H, D)`, k and v `(B, Sk, Hk, D)` (the
    layout of `jax.nn.dot_product_attention`). softmax_lse is `(B, H, Sq)`.
    `deterministic` as in `flash_attn_varlen`.

    Sharded under `jax.jit`: runs per shard when the batch and/or the heads are split
    (kv heads as in `flash_attn_varlen`); Sq, Sk and D must not be split.
    vmap: the mapped axis is folded into the batch (one call)."""
    b, sq, sk = _ops.flash_dense_check(q, k, v)
    q, k, v = map(jnp.asarray, (q, k, v))
    flat = lambda x, s: jax.ShapeDtypeStruct((b * s,) + x.shape[2:], x.dtype)  # noqa: E731
    cu = jax.ShapeDtypeStruct((b + 1,), jnp.int32)
    spec = _ops.flash_varlen_spec(flat(q, sq), flat(k, sk), flat(v, sk), cu, cu, sq, sk,
                                  softmax_scale, causal, window_size, softcap, alibi_slopes,
                                  None, None, None, None, None, op="flash_attn",
                                  deterministic=deterministic)
    alibi = _maybe(alibi_slopes)
    if spec.out_dtype != q.dtype:  # fp8: forward only
        out, lse = _apply(_fwd_op(spec, True, (q, k, v, alibi)), q, k, v, alibi)
    else:
        out, lse = _flash_diff(spec, True, q, k, v, None, None, None, alibi)
    return (out, lse) if return_softmax_lse else out


# ---------------------------------------------------------------- paged attention
_PAGED = ("query", "key_cache", "value_cache", "seq_lens", "block_tables", "query_start_loc",
          "num_seqs", "k_scale", "v_scale", "alibi_slopes")


def _paged_impl(spec: _ops.PagedSpec, query, key_cache, value_cache, seq_lens, block_tables,
                query_start_loc, num_seqs=None, k_scale=None, v_scale=None, alibi=None):
    total_q, num_heads, head_dim = query.shape
    workspace = _native.paged_attention_workspace_size(
        total_q, seq_lens.shape[0], num_heads, head_dim, block_tables.shape[1], key_cache.shape[1],
        spec.max_query_len)
    results = (jax.ShapeDtypeStruct(query.shape, query.dtype),
               jax.ShapeDtypeStruct((workspace,), jnp.uint8))
    # v2 always; v1 stays registered for programs serialized before it existed.
    out, _ = _call("xla_attn_paged_attention_v2", results, query, key_cache, value_cache,
                   seq_lens, block_tables, query_start_loc, _or_absent(num_seqs, jnp.int32),
                   _or_absent(k_scale, jnp.float32), _or_absent(v_scale, jnp.float32),
                   _or_absent(alibi, jnp.float32), **spec.attributes())
    return (out,)


def paged_attention(query, key_cache, value_cache, seq_lens, block_tables, query_start_loc, scale,
                    sliding_window=None, soft_cap=None, k_scale=None, v_scale=None, num_seqs=None,
                    kv_cache_dtype="auto", alibi_slopes=None, max_query_len=None):
    """Attention of ragged query spans over a paged KV cache (decode and short
    prefill chunks). query `(total_q, H, D)`; caches `(num_blocks, block_size, Hk, D)`
    (float like query, float8, or uint8 with `kv_cache_dtype`); `num_seqs` an int32
    device scalar counting the real rows of a padded batch; `alibi_slopes` `(H,)`
    float32; `max_query_len` an int bounding every sequence's query count (vLLM's
    max_query_len: 1 for a decode batch, which then launches the decode kernel alone).

    Sharded under `jax.jit`: runs per shard when the query heads are split (the caches'
    kv heads split alike, or replicated when num_heads_k divides the shard count;
    alibi_slopes split with the query heads).
    vmap: one call per element (`jax.lax.map`)."""
    spec = _ops.paged_attention_spec(query, key_cache, value_cache, seq_lens, block_tables,
                                     query_start_loc, scale, sliding_window, soft_cap, k_scale,
                                     v_scale, num_seqs, kv_cache_dtype, alibi_slopes,
                                     max_query_len)
    operands = tuple(map(_maybe, (query, key_cache, value_cache, seq_lens, block_tables,
                                  query_start_loc, num_seqs, k_scale, v_scale, alibi_slopes)))
    (out,) = _apply(_op("paged_attention", _paged_impl, spec, _PAGED, operands, ("out",)),
                    *operands)
    return out


# ---------------------------------------------------------------- KV-cache write
_CACHE = ("key", "value", "key_cache", "value_cache", "slot_mapping", "k_scale", "v_scale")


def _cache_impl(fmt: str, key, value, key_cache, value_cache, slot_mapping, k_scale=None,
                v_scale=None):
    results = (jax.ShapeDtypeStruct(key_cache.shape, key_cache.dtype),
               jax.ShapeDtypeStruct(value_cache.shape, value_cache.dtype))
    return tuple(_call("xla_attn_reshape_and_cache_flash_v1", results, key, value, key_cache,
                       value_cache, slot_mapping, _or_absent(k_scale, jnp.float32),
                       _or_absent(v_scale, jnp.float32), aliases={2: 0, 3: 1},
                       kv_cache_dtype=fmt))


def reshape_and_cache_flash(key, value, key_cache, value_cache, slot_mapping,
                            kv_cache_dtype="auto", k_scale=None, v_scale=None):
    """Scatter `key`/`value` `(num_tokens, Hk, D)` into the paged caches at
    `slot_mapping` (slot -1 skipped); fp8 formats quantize as `x / scale`. Returns the
    updated `(key_cache, value_cache)`, aliased onto the inputs: under `jax.jit` with
    the caches donated the update happens in place. Each slot should appear once: on a
    GPU, tokens that share a slot are written concurrently (docs/xla-targets.md).

    Sharded under `jax.jit`: runs per shard, in place, when the caches' kv heads are
    split (key and value follow the caches).
    vmap: one call per element (`jax.lax.map`); the results are new arrays then."""
    fmt = _ops.reshape_and_cache_flash_spec(key, value, key_cache, value_cache, slot_mapping,
                                            kv_cache_dtype, k_scale, v_scale)
    operands = tuple(map(_maybe, (key, value, key_cache, value_cache, slot_mapping, k_scale,
                                  v_scale)))
    op = _op("reshape_and_cache_flash", _cache_impl, fmt, _CACHE, operands,
             ("key_cache", "value_cache"), lead=2)
    return _apply(op, *operands)


# ---------------------------------------------------------------- shard_map
_OPS = {"flash_attn_varlen": flash_attn_varlen, "flash_attn": flash_attn,
        "paged_attention": paged_attention, "reshape_and_cache_flash": reshape_and_cache_flash}


def sharded(op, mesh, *, head_axis=None, batch_axis=None):
    """`op` (one of the four ops of this module or of `xla_attn`) run per shard with
    `jax.shard_map` over `mesh`: same arguments, same results.

    head_axis: mesh axis name (or tuple of names) to split the heads over: q's heads,
        and k/v's (or the caches') kv heads when the axis size divides num_heads_k;
        when num_heads_k divides it instead, kv is replicated and each shard attends
        with its own kv head. Other head counts raise ValueError.
    batch_axis: mesh axis name(s) to split the batch of `flash_attn`'s dense layout over.
    Everything else (tokens, head_dim, cu_seqlens, block tables, slots, scales) is
    replicated. Inputs arrive in whatever sharding they have and jax moves them to
    these specs; the results come out split the same way.

        step = jax.jit(xla_attn.jax.sharded(xla_attn.paged_attention, mesh, head_axis="tp"))

    Under plain `jax.jit` the ops already run per shard (see the module docstring); this
    is for code that is written with shard_map."""
    name = getattr(op, "__name__", None)
    if name not in _OPS:
        raise TypeError(f"sharded: op must be one of {', '.join(_OPS)}, got {op!r}")
    if batch_axis is not None and name != "flash_attn":
        raise ValueError(f"sharded: batch_axis applies to flash_attn's dense layout, not {name}")
    target = _OPS[name]
    signature = inspect.signature(target)

    def call(*args, **kwargs):
        arguments = signature.bind(*args, **kwargs).arguments
        arrays = {n: jnp.asarray(x) for n, x in arguments.items() if hasattr(x, "shape")}
        static = {n: x for n, x in arguments.items() if n not in arrays}
        plan = _sharded_plan(name, mesh, arrays, _axes(head_axis), _axes(batch_axis))
        in_specs = tuple(_spec(_dims(name, n, x.ndim), plan) for n, x in arrays.items())

        def body(*xs):
            local = dict(zip(arrays, xs))
            if plan.kv == "slice":
                local = _own_kv_head(name, local, plan, mesh)
            return target(**static, **local)

        return jax.shard_map(body, mesh=mesh, in_specs=in_specs,
                             out_specs=_result_specs(name, static, plan))(*arrays.values())
    return functools.wraps(target)(call)


def _sharded_plan(name, mesh, arrays, heads: tuple, batch: tuple) -> _Plan:
    sizes = {c: x.shape[i] for n, x in arrays.items() for i, c in enumerate(_dims(name, n, x.ndim))}
    h, hk = sizes.get("H", sizes.get("K")), sizes.get("K", 1)
    n = _size(mesh, heads)
    axes, kv = _head_plan(h, hk, heads, n, "H" in sizes)
    if heads and not axes:
        raise ValueError(f"sharded: cannot split num_heads={h}, num_heads_k={hk} over {n} "
                         f"shards of {heads}: need num_heads % {n} == 0 and num_heads_k a "
                         f"multiple or a divisor of {n}")
    split = (("H", axes), ("K", axes if kv == "shard" else ()), ("B", batch))
    return _Plan(tuple((c, a) for c, a in split if a), kv)


def _own_kv_head(name, local: dict, plan: _Plan, mesh) -> dict:
    """This shard's kv head, from kv replicated on every shard ("slice" mode)."""
    dims = {n: _dims(name, n, x.ndim) for n, x in local.items()}
    hk = next(local[n].shape[d.index("K")] for n, d in dims.items() if "K" in d)
    if hk == 1:
        return local
    index = _kv_head(plan, mesh, hk)
    return {n: jax.lax.dynamic_slice_in_dim(x, index, 1, dims[n].index("K"))
            if "K" in dims[n] else x for n, x in local.items()}


def _result_specs(name, static: dict, plan: _Plan):
    if name == "reshape_and_cache_flash":
        return (_spec(_dims(name, "key_cache"), plan),) * 2
    out = _spec(_dims(name, "out"), plan)
    if static.get("return_softmax_lse"):
        return out, _spec(_dims(name, "softmax_lse"), plan)
    return out
