"""Per-shard execution of our ops under torch_xla SPMD (manual sharding).

A custom call has no sharding rule, so under GSPMD the partitioner would gather its
operands onto every device. Instead the frontend enters manual sharding for each
input (`enable_manual_sharding`, the shard each device holds), runs the op on the
local shards, and leaves it for each output (`disable_manual_sharding`), as torch_xla's
own `flash_attention(partition_spec=...)` does. The two transitions are autograd
functions, so gradients take the same route back through the ops' own backward."""

from __future__ import annotations

import math

import torch


def _xs():
    import torch_xla.distributed.spmd as xs

    return xs


def _mesh(mesh):
    import torch_xla.runtime as xr

    if not xr.is_spmd():
        raise RuntimeError("xla_attn: partition_spec needs torch_xla SPMD mode "
                           "(torch_xla.runtime.use_spmd()) before any XLA tensor is made")
    mesh = _xs().get_global_mesh() if mesh is None else mesh
    if mesh is None:
        raise ValueError("xla_attn: partition_spec needs a mesh (mesh=... or "
                         "torch_xla.distributed.spmd.set_global_mesh)")
    return mesh


def axis_size(mesh, axes) -> int:
    """Devices along one partition-spec entry (None, a mesh axis name or index, or a
    tuple of them)."""
    if axes is None:
        return 1
    if not isinstance(axes, tuple):
        axes = (axes,)
    names = list(mesh.axis_names) if mesh.axis_names else []
    return math.prod(mesh.mesh_shape[names.index(a) if isinstance(a, str) else a]
                     for a in axes)


class _ToLocal(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, spec, mesh):
        ctx.spec, ctx.mesh, ctx.shape = spec, mesh, x.shape
        # enable_manual_sharding annotates its input in place: give it a copy.
        return _xs().enable_manual_sharding(x.clone(), spec, mesh=mesh).global_tensor

    @staticmethod
    def backward(ctx, grad):
        full = _xs().disable_manual_sharding(grad, ctx.spec, ctx.shape, mesh=ctx.mesh)
        return full.global_tensor, None, None


class _ToFull(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, spec, shape, mesh):
        ctx.spec, ctx.mesh = spec, mesh
        return _xs().disable_manual_sharding(x, spec, shape, mesh=mesh).global_tensor

    @staticmethod
    def backward(ctx, grad):
        local = _xs().enable_manual_sharding(grad.clone(), ctx.spec, mesh=ctx.mesh)
        return local.global_tensor, None, None, None


def run(fn, inputs, in_specs, out_specs, mesh):
    """fn(*local inputs) on every device's shards; its outputs (a tuple) reassembled
    with out_specs. None inputs stay None."""
    mesh = _mesh(mesh)
    local = [None if x is None else _ToLocal.apply(x, tuple(spec), mesh)
             for x, spec in zip(inputs, in_specs)]
    outputs = fn(*local)
    full = []
    for out, spec in zip(outputs, out_specs):
        shape = torch.Size(d * axis_size(mesh, a) for d, a in zip(out.shape, spec))
        full.append(_ToFull.apply(out, tuple(spec), shape, mesh))
    return tuple(full)


def heads_axis(op: str, partition_spec, rank: int, heads_dim: int, allowed=()):
    """The mesh axes of the heads dimension of a `rank`-dim partition spec whose
    other dimensions must be unsharded (except those in `allowed`)."""
    spec = tuple(partition_spec)
    if len(spec) != rank:
        raise ValueError(f"{op}: partition_spec must have {rank} entries, got {spec!r}")
    for d, axes in enumerate(spec):
        if d != heads_dim and d not in allowed and axes is not None:
            raise ValueError(f"{op}: partition_spec may shard only the heads dimension "
                             f"({heads_dim}){' and ' + str(allowed) if allowed else ''}: "
                             f"sequences cannot be split across devices; got {spec!r}")
    return spec[heads_dim]


def check_heads(op: str, mesh, axes, num_heads: int, num_heads_k: int) -> None:
    n = axis_size(_mesh(mesh), axes)
    if num_heads % n or num_heads_k % n:
        raise ValueError(f"{op}: num_heads ({num_heads}) and num_heads_k ({num_heads_k}) must "
                         f"both be multiples of the {n} devices the heads are sharded over")
