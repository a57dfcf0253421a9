"""PyTorch frontend: the ops as `torch.library` custom ops (`torch.ops.xla_attn.*`) whose
CPU and CUDA implementations fill the params structs and call the C ABI of the one
native library through ctypes (no torch C++ is compiled, so no torch version is baked
in). CPU tensors run the Host reference; CUDA tensors run on torch's current stream.

The ops have fake (meta) implementations, so they trace under `torch.compile` without
graph breaks; `flash_fwd` is differentiable through `flash_bwd`; the cache write
mutates the caches in place, as vLLM's `reshape_and_cache_flash` does.
The public functions mirror `xla_attn.jax` name for name and argument for argument."""

import functools
from typing import Optional

import torch
from torch import Tensor

from xla_attn import _capi, _ops, _torch_segments

__all__ = ["flash_attn_varlen", "flash_attn", "paged_attention", "reshape_and_cache_flash"]

_DEVICES = ("cpu", "cuda")
_FP8_E4M3 = "float8_e4m3fn"


def _eager_cached(spec):
    """Every eager call is checked here: the checks remembered by shape, dtype and value
    (_ops.cached); under torch.compile the plain checks, which dynamo traces (it cannot
    trace the cache's hash) and runs once a graph."""
    remembered = _ops.cached(spec)

    def check(*args, **kwargs):
        return (spec if torch.compiler.is_compiling() else remembered)(*args, **kwargs)
    return check


_flash_spec = _eager_cached(_ops.flash_varlen_spec)
_paged_spec = _eager_cached(_ops.paged_attention_spec)
_cache_spec = _eager_cached(_ops.reshape_and_cache_flash_spec)
_dense_check = _eager_cached(_ops.flash_dense_check)


# ---------------------------------------------------------------- plumbing
def _code(x: Tensor) -> int:
    return _dtype_code(x.dtype)


def _dtype_code(dtype: torch.dtype) -> int:  # (as _ops.dtype_name names a tensor's)
    return _capi.DTYPE_CODES[str(dtype).removeprefix("torch.")]


def _dense(x: Optional[Tensor]) -> Optional[Tensor]:
    """The native code takes dense row-major buffers."""
    return None if x is None else x.contiguous()


def _dense_all(*tensors) -> tuple:
    return tuple(map(_dense, tensors))


def _alibi_batch_stride(alibi: Optional[Tensor], batch: int, num_heads: int) -> int:
    """Per-sequence slopes `(batch, num_heads)` step num_heads a sequence; shared ones 0."""
    return num_heads if alibi is not None and alibi.dim() == 2 and batch > 1 else 0


def _same_device(op: str, device: torch.device, **tensors) -> None:
    for name, x in tensors.items():
        if x is not None and x.device != device:
            raise ValueError(f"{op}: {name} must be on {device} like the other inputs, "
                             f"got {x.device}")


def _launch(run, params, device: torch.device, workspace_bytes: Optional[int] = None) -> int:
    """Runs `params` on the Host, or on `device`'s current torch stream with a workspace
    of `workspace_bytes` (None: what the library asks for, which it sizes from the
    shapes alone, for the device's GPU) freed stream-ordered by torch's allocator.
    Returns the workspace's size (a plan keeps it)."""
    if device.type == "cpu":
        run(params, _capi.HOST)
        return 0
    if device.index is not None and device.index != torch.cuda.current_device():
        # (entered only where the device is not current already: 3.7 us a call on an
        # H200's host, an eighth of a planned call's)
        with torch.cuda.device(device):
            return _launch(run, params, device, workspace_bytes)
    size = _capi.workspace_size(params) if workspace_bytes is None else workspace_bytes
    workspace = None
    if size:
        workspace = torch.empty(size, dtype=torch.uint8, device=device)
        params.workspace, params.workspace_bytes = workspace.data_ptr(), size
    run(params, _capi.CUDA, _current_stream(device))
    del workspace
    return size


# torch's own raw-stream query (what torch.compile's generated code calls) where this torch
# has it: a plain int, without the torch.cuda.Stream object current_stream builds
_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def _current_stream(device: torch.device) -> int:
    """The raw handle of `device`'s current torch stream."""
    if _raw_stream is None:
        return torch.cuda.current_stream(device).cuda_stream
    return _raw_stream(device.index if device.index is not None else torch.cuda.current_device())


# ---------------------------------------------------------------- eager plans
class _Plan:
    """An op's work on one call signature past its checks, for the eager calls that
    repeat it (a serving or training loop calls each attention with the same shapes):
    the params struct filled but for the tensors' addresses, the outputs' shapes and
    dtypes, and the workspace's size (None: asked of the library on the first call).
    A call then copies the struct, sets its addresses, allocates its outputs and
    launches; the checks (raised on the call that made the plan) ran once. Host time a
    call, kernels stubbed out, on a CPU: docs/benchmarks.md 2026-12-03 (60)."""

    __slots__ = ("attributes", "backward", "fields", "outputs", "params", "run",
                 "workspace_bytes")

    def __init__(self, run, params, fields, outputs, workspace_bytes, attributes=()):
        self.run, self.params, self.fields = run, params, fields
        self.outputs, self.workspace_bytes = outputs, workspace_bytes
        # flash_fwd's: the checked attributes its backward takes (flash_bwd's after its
        # tensors), and the backward's own plan once one ran (_flash_backward)
        self.attributes, self.backward = attributes, None

    def __call__(self, device: torch.device, tensors) -> list:
        """Runs on `tensors`, one a field of `fields` in order (None: null); the fields
        past them are the outputs', made here and returned."""
        p = type(self.params).from_buffer_copy(self.params)
        outs = [torch.empty(shape, dtype=dtype, device=device) for shape, dtype in self.outputs]
        for name, x in zip(self.fields, (*tensors, *outs)):
            if x is not None:
                setattr(p, name, x.data_ptr())
        self.workspace_bytes = _launch(self.run, p, device, self.workspace_bytes)
        return outs


_plans: dict = {}  # call signature (_signature) -> _Plan
_MAX_PLANS = 256   # past it the plans start over (a workload's shapes number far fewer)


def _signature(op: str, tensors, values, differentiable=()):
    """The call's key in _plans, or None where it cannot take a plan: it is not one
    _direct may run (or asks for gradients), or a tensor is not contiguous (the plans
    take the addresses as they are). Tensors by shape, dtype and device; the other
    arguments by value and type (1, 1.0 and True are different calls to the checks)."""
    key = [op]
    for x in tensors:
        if x is None:
            key.append(None)
        elif type(x) is Tensor and x.is_contiguous() and (device := x.device).type in _DEVICES:
            key.append((x.shape, x.dtype, device))
        else:
            return None
    for v in values:
        key.append((type(v), tuple((type(e), e) for e in v) if type(v) is tuple else v))
    key = tuple(key)
    if not _direct((), differentiable):
        return None
    try:
        hash(key)
    except TypeError:  # e.g. a list argument: the checks say what they make of it
        return None
    return key


def _planned(op: str, tensors, values, differentiable=()):
    """(the call's signature, its plan): (None, None) where it cannot take one, (signature,
    None) where none is kept yet."""
    sig = _signature(op, tensors, values, differentiable)
    return sig, (_plans.get(sig) if sig is not None else None)


def _remember(signature, plan: _Plan) -> None:
    if signature is None:
        return
    if len(_plans) >= _MAX_PLANS:
        _plans.clear()
    _plans[signature] = plan


def _watching() -> bool:  # a torch without one of these (older than we test) never goes direct
    return True


_function_mode = getattr(torch._C, "_is_torch_function_mode_enabled", _watching)
_dispatch_modes = getattr(torch._C, "_len_torch_dispatch_stack", _watching)
_functorch = getattr(torch._C, "_are_functorch_transforms_active", _watching)
_profiling = getattr(getattr(torch._C, "_autograd", None), "_profiler_enabled", _watching)


def _grad_asked(tensors) -> bool:
    return torch.is_grad_enabled() and any(x.requires_grad for x in tensors)


def _direct(tensors, differentiable=()) -> bool:
    """Whether an eager call may run an op's implementation itself, past torch.library's
    dispatch (host time a call, kernels stubbed out, on a CPU: flash varlen 48 -> 29 us,
    paged decode 42 -> 22; on an H200's host, tools/bench_call_overhead.py's eager rows:
    104-197 -> 64-68, 96-125 -> 58-71): plain CPU or CUDA tensors, no gradient asked of
    `differentiable`, no torch.compile, torch function or dispatch mode, functorch
    transform or profiler. Anything else takes the custom op, which those see."""
    if (torch.compiler.is_compiling() or _function_mode() or _dispatch_modes() or _functorch()
            or _profiling()):
        return False
    if _grad_asked(differentiable):
        return False
    # (another device's tensors, torch_xla's, take the op: its kernel for their device)
    return all(x is None or (type(x) is Tensor and x.device.type in _DEVICES) for x in tensors)


def _dense_offsets(batch: int, seqlen: int, device: torch.device) -> Tensor:
    """cu_seqlens of `batch` rows of `seqlen` tokens, made once a shape and device in
    eager calls (a call's two arange launches and their multiplies gone), fresh while
    torch.compile traces or a CUDA graph is captured (a copy cannot run there)."""
    if torch.compiler.is_compiling() or (device.type == "cuda" and
                                         torch.cuda.is_current_stream_capturing()):
        return torch.arange(0, (batch + 1) * seqlen, seqlen, dtype=torch.int32, device=device)
    return _remembered_offsets(batch, seqlen, device)


def _dense_cu(batch: int, seqlen_q: int, seqlen_k: int, device: torch.device):
    """The dense layout's (cu_seqlens_q, cu_seqlens_k): one tensor where the lengths match."""
    cu_q = _dense_offsets(batch, seqlen_q, device)
    return cu_q, (cu_q if seqlen_k == seqlen_q else _dense_offsets(batch, seqlen_k, device))


@functools.lru_cache(maxsize=64)
def _remembered_offsets(batch: int, seqlen: int, device: torch.device) -> Tensor:
    # made on the host and copied synchronously: ready for any stream that reads it
    return torch.arange(0, (batch + 1) * seqlen, seqlen, dtype=torch.int32).to(device)


def _cache_code(op: str, cache: Tensor, kv_cache_dtype: str) -> int:
    """Storage format of a cache: its own dtype for "auto", else the fp8 format named
    (a uint8 cache, or a float8 cache of that very format)."""
    stored = _ops.dtype_name(cache)
    fmt = _ops.KV_CACHE_DTYPES.get(kv_cache_dtype)
    if fmt is None:
        raise ValueError(f"{op}: kv_cache_dtype must be one of "
                         f"{', '.join(map(repr, _ops.KV_CACHE_DTYPES))}, got {kv_cache_dtype!r}")
    if fmt == "auto":
        return _capi.DTYPE_CODES[stored]
    return _capi.DTYPE_CODES[_ops.FP8_FORMAT_DTYPE[fmt]]


# ---------------------------------------------------------------- flash attention ops
def _flash_out_dtype(q: Tensor) -> torch.dtype:
    return torch.bfloat16 if _ops.dtype_name(q) == _FP8_E4M3 else q.dtype


@torch.library.custom_op("xla_attn::flash_fwd", mutates_args=(), device_types=_DEVICES)
def _flash_fwd(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
               seqused_k: Optional[Tensor], block_table: Optional[Tensor],
               alibi_slopes: Optional[Tensor], q_descale: Optional[Tensor],
               k_descale: Optional[Tensor], v_descale: Optional[Tensor], softmax_scale: float,
               softcap: float, window_left: int, window_right: int, max_seqlen_q: int,
               max_seqlen_k: int, deterministic: bool = False) -> tuple[Tensor, Tensor]:
    # deterministic: for the backward (flash_bwd's), carried here for autograd
    _flash_spec(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                softmax_scale, False, (window_left, window_right), softcap,
                alibi_slopes, seqused_k, block_table, q_descale, k_descale, v_descale,
                op="xla_attn::flash_fwd")
    return _flash_fwd_run(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, block_table,
                          alibi_slopes, q_descale, k_descale, v_descale, softmax_scale, softcap,
                          window_left, window_right, max_seqlen_q, max_seqlen_k)


# flash_fwd's tensors in the order its runs take them, then its outputs
_FLASH_FWD_FIELDS = ("q", "k", "v", "cu_seqlens_q", "cu_seqlens_k", "seqused_k", "block_table",
                     "alibi_slopes", "q_descale", "k_descale", "v_descale", "out", "softmax_lse")


def _flash_fwd_run(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, block_table, alibi_slopes,
                   q_descale, k_descale, v_descale, softmax_scale, softcap, window_left,
                   window_right, max_seqlen_q, max_seqlen_k):
    """flash_fwd's work on checked arguments (the op's)."""
    plan = _flash_fwd_plan(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, block_table,
                           alibi_slopes, q_descale, k_descale, v_descale, softmax_scale,
                           softcap, window_left, window_right, max_seqlen_q, max_seqlen_k)
    return tuple(plan(q.device, _dense_all(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k,
                                           block_table, alibi_slopes, q_descale, k_descale,
                                           v_descale)))


def _flash_fwd_plan(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, block_table, alibi_slopes,
                    q_descale, k_descale, v_descale, softmax_scale, softcap, window_left,
                    window_right, max_seqlen_q, max_seqlen_k, deterministic=False) -> _Plan:
    """flash_fwd's plan for checked arguments (their devices checked here);
    `deterministic` rides along for its backward."""
    op = "xla_attn::flash_fwd"
    _same_device(op, q.device, k=k, v=v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                 seqused_k=seqused_k, block_table=block_table, alibi_slopes=alibi_slopes,
                 q_descale=q_descale, k_descale=k_descale, v_descale=v_descale)
    total_q, num_heads, head_dim = q.shape
    batch = cu_seqlens_q.shape[0] - 1
    out_dtype = _flash_out_dtype(q)
    p = _capi.FlashFwdParams().fill(
        total_q=total_q, batch=batch,
        num_heads=num_heads, num_heads_k=k.shape[-2], head_dim=head_dim,
        max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k,
        alibi_batch_stride=_alibi_batch_stride(alibi_slopes, batch, num_heads),
        window_left=window_left, window_right=window_right, softmax_scale=softmax_scale,
        softcap=softcap, q_dtype=_code(q), kv_dtype=_code(k),
        out_dtype=_dtype_code(out_dtype))
    if block_table is not None:
        p.fill(num_blocks=k.shape[0], block_size=k.shape[1],
               max_blocks_per_seq=block_table.shape[1],
               total_k=k.shape[0] * k.shape[1])
    else:
        p.fill(total_k=k.shape[0])
    return _Plan(_capi.flash_fwd, p, _FLASH_FWD_FIELDS,
                 ((q.shape, out_dtype), ((num_heads, total_q), torch.float32)), None,
                 attributes=(softmax_scale, softcap, window_left, window_right, max_seqlen_q,
                             max_seqlen_k, deterministic))


@_flash_fwd.register_fake
def _flash_fwd_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, block_table, alibi_slopes,
                    q_descale, k_descale, v_descale, softmax_scale, softcap, window_left,
                    window_right, max_seqlen_q, max_seqlen_k, deterministic=False):
    return (q.new_empty(q.shape, dtype=_flash_out_dtype(q)),
            q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32))


@torch.library.custom_op("xla_attn::flash_bwd", mutates_args=(), device_types=_DEVICES)
def _flash_bwd(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, softmax_lse: Tensor,
               cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, seqused_k: Optional[Tensor],
               alibi_slopes: Optional[Tensor], softmax_scale: float, softcap: float,
               window_left: int, window_right: int, max_seqlen_q: int,
               max_seqlen_k: int, deterministic: bool = False,
               dlse: Optional[Tensor] = None) -> tuple[Tensor, Tensor, Tensor]:
    # dlse: softmax_lse's cotangent (or None), taken by the same kernels (D_i - dlse_i)
    op = "xla_attn::flash_bwd"
    _flash_spec(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                softmax_scale, False, (window_left, window_right), softcap,
                alibi_slopes, seqused_k, None, None, None, None, op=op)
    c = _ops._Check(op)
    dtype = c.dtype("q", q, _ops.FLOAT_DTYPES)
    for name, x in (("dout", dout), ("out", out)):
        c.value(_ops.shape(x) == _ops.shape(q), f"{name} must have q's shape {_ops.shape(q)}, "
                                                f"got {_ops.shape(x)}")
        c.type(_ops.dtype_name(x) == dtype, f"{name} must have q's dtype {dtype}, "
                                            f"got {_ops.dtype_name(x)}")
    lse_shape = (q.shape[1], q.shape[0])
    c.value(_ops.shape(softmax_lse) == lse_shape, f"softmax_lse must have shape (num_heads, "
                                                  f"total_q) = {lse_shape}, "
                                                  f"got {_ops.shape(softmax_lse)}")
    c.dtype("softmax_lse", softmax_lse, ("float32",))
    if dlse is not None:
        c.value(_ops.shape(dlse) == lse_shape, f"dlse must have softmax_lse's shape {lse_shape}, "
                                               f"got {_ops.shape(dlse)}")
        c.dtype("dlse", dlse, ("float32",))
    _same_device(op, q.device, dout=dout, k=k, v=v, out=out, softmax_lse=softmax_lse,
                 cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, seqused_k=seqused_k,
                 alibi_slopes=alibi_slopes, dlse=dlse)
    return _flash_bwd_run(dout, q, k, v, out, softmax_lse, cu_seqlens_q, cu_seqlens_k, seqused_k,
                          alibi_slopes, softmax_scale, softcap, window_left, window_right,
                          max_seqlen_q, max_seqlen_k, deterministic, dlse)


# flash_bwd's tensors in the order its runs take them, then its outputs
_FLASH_BWD_FIELDS = ("dout", "q", "k", "v", "out", "softmax_lse", "cu_seqlens_q", "cu_seqlens_k",
                     "seqused_k", "alibi_slopes", "dlse", "dq", "dk", "dv")


def _flash_bwd_run(dout, q, k, v, out, softmax_lse, cu_seqlens_q, cu_seqlens_k, seqused_k,
                   alibi_slopes, softmax_scale, softcap, window_left, window_right, max_seqlen_q,
                   max_seqlen_k, deterministic, dlse, keep=None):
    """flash_bwd's work on checked arguments (the op's, or the eager backward's own); its
    plan kept as `keep`'s backward (the forward's plan) where given."""
    tensors = _dense_all(dout, q, k, v, out, softmax_lse, cu_seqlens_q, cu_seqlens_k, seqused_k,
                         alibi_slopes, dlse)
    total_q, num_heads, head_dim = q.shape
    batch = cu_seqlens_q.shape[0] - 1
    p = _capi.FlashBwdParams().fill(
        total_q=total_q, total_k=k.shape[0],
        batch=batch, num_heads=num_heads, num_heads_k=k.shape[1], head_dim=head_dim,
        max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k,
        alibi_batch_stride=_alibi_batch_stride(alibi_slopes, batch, num_heads),
        window_left=window_left, window_right=window_right, softmax_scale=softmax_scale,
        softcap=softcap, dtype=_code(q))
    # the workspace takes the tensor-core family onto its atomic-dQ path
    plan = _Plan(_capi.flash_bwd, p, _FLASH_BWD_FIELDS,
                 ((q.shape, q.dtype), (k.shape, k.dtype), (v.shape, v.dtype)),
                 0 if deterministic else None)
    if keep is not None:
        keep.backward = plan
    return tuple(plan(q.device, tensors))


@_flash_bwd.register_fake
def _flash_bwd_fake(dout, q, k, v, out, softmax_lse, cu_seqlens_q, cu_seqlens_k, seqused_k,
                    alibi_slopes, softmax_scale, softcap, window_left, window_right, max_seqlen_q,
                    max_seqlen_k, deterministic=False, dlse=None):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _flash_setup_context(ctx, inputs, output):
    (q, k, v, cu_q, cu_k, seqused_k, block_table, alibi, _, _, _, *attributes) = inputs
    out, lse = output
    ctx.set_materialize_grads(False)  # an output no loss uses arrives as None: no work for it
    ctx.unsupported = block_table is not None or _ops.dtype_name(q) == _FP8_E4M3
    ctx.attributes = tuple(attributes)
    ctx.save_for_backward(q, k, v, out, lse, cu_q, cu_k, seqused_k, alibi)


def _flash_backward(ctx, dout, dlse):
    if ctx.unsupported:
        raise NotImplementedError("flash_attn_varlen: gradients are not available with "
                                  "block_table (paged K/V) or float8_e4m3fn inputs")
    q, k, v, out, lse, cu_q, cu_k, seqused_k, alibi = ctx.saved_tensors
    if dout is None and dlse is None:
        grads = (torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v))
    else:  # softmax_lse's cotangent rides the same call (D_i = dout_i . out_i - dlse_i)
        dout = torch.zeros_like(q) if dout is None else dout.to(q.dtype)
        dlse = None if dlse is None else dlse.to(torch.float32)
        tensors = (dout, q, k, v, out, lse, cu_q, cu_k, seqused_k, alibi)
        args = (*tensors, *ctx.attributes, dlse)
        forward = getattr(ctx, "plan", None)  # the eager forward's (_FlashEager)
        if not _direct(tensors + (dlse,), differentiable=args[:5]):  # create_graph: the op
            grads = torch.ops.xla_attn.flash_bwd(*args)
        elif forward is not None and forward.backward is not None:
            grads = forward.backward(q.device, (_dense(dout), *tensors[1:], _dense(dlse)))
        else:
            grads = _flash_bwd_run(*args, keep=forward)
    return tuple(grads) + (None,) * 15


_flash_fwd.register_autograd(_flash_backward, setup_context=_flash_setup_context)


class _FlashEager(torch.autograd.Function):
    """Eager calls that want gradients, on plain tensors (_direct): the call's forward
    plan (flash_fwd's work) and flash_bwd's under an autograd.Function, as the custom
    op's autograd does; that path (torch.library's fill_defaults over the op's 18
    arguments, dispatch) cost ~2/3 of a fwd+bwd call's 480-570 us of host time (kernels
    stubbed out, a CPU: 160-250 us with this Function). The backward's plan is kept
    beside the forward's (_Plan.backward)."""

    @staticmethod
    def forward(ctx, plan, *tensors):
        output = tuple(plan(tensors[0].device, tensors))
        _flash_setup_context(ctx, tensors + plan.attributes, output)
        ctx.plan = plan
        return output

    @staticmethod
    def backward(ctx, dout, dlse):
        return (None,) + _flash_backward(ctx, dout, dlse)[:11]


# ---------------------------------------------------------------- paged attention op
@torch.library.custom_op("xla_attn::paged_attention", mutates_args=(), device_types=_DEVICES)
def _paged_attention(query: Tensor, key_cache: Tensor, value_cache: Tensor, seq_lens: Tensor,
                     block_tables: Tensor, query_start_loc: Tensor, num_seqs: Optional[Tensor],
                     k_scale: Optional[Tensor], v_scale: Optional[Tensor],
                     alibi_slopes: Optional[Tensor], scale: float, soft_cap: float,
                     sliding_window: int, kv_cache_dtype: str, max_query_len: int) -> Tensor:
    spec = _paged_spec(query, key_cache, value_cache, seq_lens, block_tables,
                       query_start_loc, scale,
                       sliding_window if sliding_window > 0 else None, soft_cap,
                       k_scale, v_scale, num_seqs, kv_cache_dtype, alibi_slopes,
                       max_query_len if max_query_len > 0 else None)
    return _paged_attention_run(spec, query, key_cache, value_cache, seq_lens, block_tables,
                                query_start_loc, num_seqs, k_scale, v_scale, alibi_slopes)


# paged_attention's tensors in the order its runs take them, then its output
_PAGED_FIELDS = ("query", "key_cache", "value_cache", "seq_lens", "block_tables",
                 "query_start_loc", "num_seqs", "k_scale", "v_scale", "alibi_slopes", "out")


def _paged_attention_run(spec, query, key_cache, value_cache, seq_lens, block_tables,
                         query_start_loc, num_seqs, k_scale, v_scale, alibi_slopes,
                         remember=None):
    """paged_attention's work on checked arguments and their spec; its plan kept under
    `remember` (a _signature) where given."""
    op = "xla_attn::paged_attention"
    _same_device(op, query.device, key_cache=key_cache, value_cache=value_cache,
                 seq_lens=seq_lens, block_tables=block_tables, query_start_loc=query_start_loc,
                 num_seqs=num_seqs, k_scale=k_scale, v_scale=v_scale, alibi_slopes=alibi_slopes)
    tensors = _dense_all(query, key_cache, value_cache, seq_lens, block_tables,
                         query_start_loc, num_seqs, k_scale, v_scale, alibi_slopes)
    query, kc, vc, lens, tables = tensors[:5]
    total_q, num_heads, head_dim = query.shape
    p = _capi.PagedAttentionParams().fill(
        total_q=total_q,
        max_num_seqs=lens.shape[0], num_heads=num_heads, num_heads_k=kc.shape[2],
        head_dim=head_dim, num_blocks=kc.shape[0], block_size=kc.shape[1],
        max_blocks_per_seq=tables.shape[1], sliding_window=spec.sliding_window,
        scale=spec.scale, soft_cap=spec.soft_cap, q_dtype=_code(query),
        cache_dtype=_cache_code(op, kc, spec.kv_cache_dtype), max_query_len=spec.max_query_len)
    plan = _Plan(_capi.paged_attention, p, _PAGED_FIELDS, ((query.shape, query.dtype),), None)
    (out,) = plan(query.device, tensors)
    _remember(remember, plan)
    return out


@_paged_attention.register_fake
def _paged_attention_fake(query, key_cache, value_cache, seq_lens, block_tables, query_start_loc,
                          num_seqs, k_scale, v_scale, alibi_slopes, scale, soft_cap,
                          sliding_window, kv_cache_dtype, max_query_len):
    return query.new_empty(query.shape)


# ---------------------------------------------------------------- KV-cache write op
@torch.library.custom_op("xla_attn::reshape_and_cache_flash",
                         mutates_args=("key_cache", "value_cache"), device_types=_DEVICES)
def _reshape_and_cache_flash(key: Tensor, value: Tensor, key_cache: Tensor, value_cache: Tensor,
                 slot_mapping: Tensor, k_scale: Optional[Tensor], v_scale: Optional[Tensor],
                 kv_cache_dtype: str) -> None:
    fmt = _cache_spec(key, value, key_cache, value_cache, slot_mapping, kv_cache_dtype,
                      k_scale, v_scale)
    _cache_write_run(fmt, key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale)


# reshape_and_cache_flash's tensors in the order its runs take them
_CACHE_FIELDS = ("key", "value", "key_cache", "value_cache", "slot_mapping", "k_scale",
                 "v_scale")


def _cache_write_run(fmt, key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale,
                     remember=None):
    """reshape_and_cache_flash's work on checked arguments and their format; its plan
    kept under `remember` (a _signature) where given."""
    op = "xla_attn::reshape_and_cache_flash"
    _same_device(op, key.device, value=value, key_cache=key_cache, value_cache=value_cache,
                 slot_mapping=slot_mapping, k_scale=k_scale, v_scale=v_scale)
    key, value, slots, ks, vs = _dense_all(key, value, slot_mapping, k_scale, v_scale)
    # The struct has no strides: a strided cache (e.g. one half of a stacked K/V
    # tensor) is written through a dense copy that is copied back.
    kc, vc = key_cache.contiguous(), value_cache.contiguous()
    num_blocks, block_size, num_heads_k, head_dim = kc.shape
    p = _capi.CacheWriteParams().fill(
        num_tokens=key.shape[0],
        num_slots=num_blocks * block_size, num_heads_k=num_heads_k, head_dim=head_dim,
        block_size=block_size, num_blocks=num_blocks, src_dtype=_code(key),
        cache_dtype=_cache_code(op, kc, fmt), slot_dtype=_code(slots))
    plan = _Plan(_capi.reshape_and_cache_flash, p, _CACHE_FIELDS, (), None)
    plan(key.device, (key, value, kc, vc, slots, ks, vs))
    _remember(remember, plan)
    if kc is not key_cache:
        key_cache.copy_(kc)
    if vc is not value_cache:
        value_cache.copy_(vc)


@_reshape_and_cache_flash.register_fake
def _reshape_and_cache_flash_fake(key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale,
                      kv_cache_dtype):
    return None


# ---------------------------------------------------------------- public functions
def flash_attn_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q=None, max_seqlen_k=None,
                      softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                      alibi_slopes=None, seqused_k=None, block_table=None,
                      return_softmax_lse=False, q_descale=None, k_descale=None, v_descale=None,
                      deterministic=False):
    """Flash attention over packed variable-length sequences (flash-attn's
    `flash_attn_varlen_func`). q `(total_q, H, D)`; k, v `(total_k, Hk, D)` or, with
    `block_table`, a paged cache `(num_blocks, block_size, Hk, D)`. Returns out like q
    (bf16 for fp8 q) and, if asked, softmax_lse `(H, total_q)` float32.
    Differentiable in q, k, v when not paged and not fp8, through out and softmax_lse
    alike (one backward call either way). On CUDA (and on torch_xla's CUDA devices) the
    backward adds dq up with float atomics (its last bits may vary from run to run, as
    flash-attn's); `deterministic=True` takes the slower backward without them."""
    tensors = (q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, block_table, alibi_slopes,
               q_descale, k_descale, v_descale)
    sig, plan = _planned("flash_attn_varlen", tensors, (max_seqlen_q, max_seqlen_k,
                                                        softmax_scale, causal, window_size,
                                                        softcap, deterministic))
    if plan is not None:
        out, lse = _planned_flash(plan, tensors)
    else:
        out, lse = _flash_forward(tensors, max_seqlen_q, max_seqlen_k, softmax_scale, causal,
                                  window_size, softcap, deterministic, sig)
    return (out, lse) if return_softmax_lse else out


def _flash_forward(tensors, max_seqlen_q, max_seqlen_k, softmax_scale, causal, window_size,
                   softcap, deterministic, remember):
    """flash_attn_varlen's checks and forward on `tensors` (_FLASH_FWD_FIELDS' inputs):
    through the custom op, or planned (the plan kept under `remember`)."""
    q, k, v, cu_q, cu_k, seqused_k, block_table, alibi, qd, kd, vd = tensors
    spec = _flash_spec(q, k, v, cu_q, cu_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal,
                       window_size, softcap, alibi, seqused_k, block_table, qd, kd, vd,
                       deterministic=deterministic)
    args = (*tensors, spec.softmax_scale, spec.softcap, spec.window_left, spec.window_right,
            spec.max_seqlen_q, spec.max_seqlen_k)
    if not _direct(tensors):
        return torch.ops.xla_attn.flash_fwd(*args, spec.deterministic)
    plan = _flash_fwd_plan(*args, spec.deterministic)
    _remember(remember, plan)
    return _planned_flash(plan, _dense_all(*tensors))


def _planned_flash(plan: _Plan, tensors):
    """A direct flash forward on its plan: with gradients where they are asked."""
    if _grad_asked(tensors[:3]):
        return _FlashEager.apply(plan, *tensors)
    return tuple(plan(tensors[0].device, tensors))


def flash_attn(q, k, v, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
               alibi_slopes=None, return_softmax_lse=False, q_segment_ids=None,
               kv_segment_ids=None, max_segments=None, deterministic=False):
    """Dense-layout flash attention: q `(B, Sq, H, D)`, k and v `(B, Sk, Hk, D)` (the
    layout of `flash_attn_func`). softmax_lse is `(B, H, Sq)`. `deterministic` as in
    `flash_attn_varlen`.

    `q_segment_ids (B, Sq)` / `kv_segment_ids (B, Sk)` (int32/int64) pack several
    documents in a row: a query sees only keys of its own segment. Each segment must
    be one contiguous run, in the same order in q and kv (see `_ops`, "segment ids");
    causal masking is then per segment. CPU ids are checked on the host (ValueError);
    device ids are converted on the device without a sync, and ids that break the rule
    give NaN outputs. `max_segments` (an int) bounds the segments per row
    (default min(Sq, Sk)); a tight bound keeps the launch small on GPUs."""
    sig = None
    if q_segment_ids is None and kv_segment_ids is None:
        sig, plan = _planned("flash_attn", (q, k, v, alibi_slopes),
                             (softmax_scale, causal, window_size, softcap, deterministic))
        if plan is not None:  # a plan of the call below (packed: its gradients' shapes)
            (b, sq), sk = q.shape[:2], k.shape[1]
            cu_q, cu_k = _dense_cu(b, sq, sk, q.device)
            qkv = (q, k, v)
            if _grad_asked(qkv):
                qkv = tuple(x.reshape(-1, *x.shape[2:]) for x in qkv)
            out, lse = _planned_flash(plan, (*qkv, cu_q, cu_k, None, None, alibi_slopes, None,
                                             None, None))
            return _dense_outputs(out, lse, q, b, sq, None, return_softmax_lse)
    b, sq, sk = _dense_check(q, k, v)
    bad = None
    if q_segment_ids is None and kv_segment_ids is None:
        cu_q, cu_k = _dense_cu(b, sq, sk, q.device)
        max_q, max_k = sq, sk
    else:
        bound = _ops.segment_ids_check(q_segment_ids, kv_segment_ids, b, sq, sk, max_segments)
        if alibi_slopes is not None and alibi_slopes.dim() == 2:
            raise ValueError("flash_attn: per-row alibi_slopes (batch, num_heads) cannot be "
                             "combined with segment ids; pass (num_heads,)")
        cu_q, cu_k, max_q, max_k, bad = _torch_segments.cu_seqlens(q_segment_ids,
                                                                   kv_segment_ids, bound)
        cu_q, cu_k = cu_q.to(q.device), cu_k.to(q.device)
    flat = (q.reshape(b * sq, *q.shape[2:]), k.reshape(b * sk, *k.shape[2:]),
            v.reshape(b * sk, *v.shape[2:]), cu_q, cu_k, None, None, alibi_slopes, None, None,
            None)
    out, lse = _flash_forward(flat, max_q, max_k, softmax_scale, causal, window_size, softcap,
                              deterministic, sig)
    return _dense_outputs(out, lse, q, b, sq, bad, return_softmax_lse)


def _dense_outputs(out, lse, q, b: int, sq: int, bad, return_softmax_lse: bool):
    """flash_attn's results from the packed call's: out `(B, Sq, H, D)` (NaN where the
    segment ids broke their rule: `bad`), softmax_lse `(B, H, Sq)`."""
    out = _torch_segments.poison(out, bad).reshape(*q.shape[:3], out.shape[-1])
    if not return_softmax_lse:
        return out
    return out, lse.reshape(lse.shape[0], b, sq).transpose(0, 1).contiguous()


def paged_attention(query, key_cache, value_cache, seq_lens, block_tables, query_start_loc, scale,
                    sliding_window=None, soft_cap=None, k_scale=None, v_scale=None, num_seqs=None,
                    kv_cache_dtype="auto", alibi_slopes=None, max_query_len=None):
    """Attention of ragged query spans over a paged KV cache (decode and short
    prefill chunks). query `(total_q, H, D)`; caches `(num_blocks, block_size, Hk, D)`
    (float like query, float8, or uint8 with `kv_cache_dtype`); `num_seqs` an int32
    device scalar counting the real rows of a padded batch; `alibi_slopes` `(H,)`
    float32; `max_query_len` an int bounding every sequence's query count (1 for
    a decode batch, which then launches the decode kernel alone)."""
    tensors = (query, key_cache, value_cache, seq_lens, block_tables, query_start_loc,
               num_seqs, k_scale, v_scale, alibi_slopes)
    sig, plan = _planned("paged_attention", tensors,
                         (scale, sliding_window, soft_cap, kv_cache_dtype, max_query_len))
    if plan is not None:
        return plan(query.device, tensors)[0]
    spec = _paged_spec(query, key_cache, value_cache, seq_lens, block_tables,
                       query_start_loc, scale, sliding_window, soft_cap, k_scale,
                       v_scale, num_seqs, kv_cache_dtype, alibi_slopes,
                       max_query_len)
    if _direct(tensors):
        return _paged_attention_run(spec, *tensors, remember=sig)
    return torch.ops.xla_attn.paged_attention(
        *tensors, spec.scale, spec.soft_cap, spec.sliding_window, spec.kv_cache_dtype,
        spec.max_query_len)


def reshape_and_cache_flash(key, value, key_cache, value_cache, slot_mapping,
                            kv_cache_dtype="auto", k_scale=None, v_scale=None):
    """Scatter `key`/`value` `(num_tokens, Hk, D)` into the paged caches at
    `slot_mapping` (slot -1 skipped) in place, as vLLM's op does; fp8 formats
    quantize as `x / scale`. Returns None. Each slot should appear once: on a GPU,
    tokens that share a slot are written concurrently (docs/xla-targets.md)."""
    tensors = (key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale)
    sig, plan = _planned("reshape_and_cache_flash", tensors, (kv_cache_dtype,),
                         differentiable=(key_cache, value_cache))
    if plan is not None:  # (its caches contiguous: written in place)
        plan(key.device, tensors)
    else:
        fmt = _cache_spec(key, value, key_cache, value_cache, slot_mapping, kv_cache_dtype,
                          k_scale, v_scale)
        if not _direct(tensors, differentiable=(key_cache, value_cache)):
            torch.ops.xla_attn.reshape_and_cache_flash(*tensors, fmt)
            return
        _cache_write_run(fmt, *tensors, remember=sig)
    # what the op's mutates_args does: autograd sees the caches written
    for cache in (key_cache, value_cache):
        torch.autograd.graph.increment_version(cache)
