"""Segment ids -> varlen cu_seqlens for the torch frontends (rules: _ops, "segment ids").

CPU ids are converted on the host by `_ops.segment_ids_to_cu_seqlens` (checked, compact).
Device ids (CUDA, XLA) are converted on the device with static shapes and no host
sync: `rows * max_segments` sequence slots, unused slots empty (length 0 is legal).
The device path cannot raise, so ids whose q and kv runs do not pair up give a flag
that turns the output into NaN instead of a silently wrong result."""

from __future__ import annotations

import torch

from xla_attn import _ops


def _run_table(ids: torch.Tensor, slots: int):
    """For (rows, seqlen) ids: cu_seqlens (slots + 1,) int32 of the runs (row-major,
    unused slots empty) and per slot the run's (row, id), -1 where unused."""
    rows, seqlen = ids.shape
    total = rows * seqlen
    flat = ids.reshape(total).to(torch.int64)
    pos = torch.arange(total, device=ids.device, dtype=torch.int64)
    first = torch.ones(1, dtype=torch.bool, device=ids.device)
    start = (pos % seqlen == 0) | torch.cat([first, flat[1:] != flat[:-1]])
    run = torch.cumsum(start.to(torch.int64), 0) - 1
    # Starts scatter to their run's slot; everything else to a spare slot (dropped).
    target = torch.where(start & (run < slots), run, torch.full_like(run, slots))
    begin = torch.full((slots + 1,), total, dtype=torch.int64, device=ids.device)
    begin = begin.scatter(0, target, pos)[:slots]
    cu = torch.cat([begin, torch.full((1,), total, dtype=torch.int64, device=ids.device)])
    unused = torch.full((slots + 1,), -1, dtype=torch.int64, device=ids.device)
    row_of = unused.scatter(0, target, pos // seqlen)[:slots]
    id_of = unused.scatter(0, target, flat)[:slots]
    runs_total = run[-1] + 1 if total else torch.zeros((), dtype=torch.int64, device=ids.device)
    return cu.to(torch.int32), row_of, id_of, runs_total


def cu_seqlens(q_segment_ids, kv_segment_ids, max_segments: int):
    """(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, bad) for the flattened
    (rows * seqlen) tokens; `bad` is None (checked on the host) or a device bool that
    is true when the ids break the rules."""
    if q_segment_ids.device.type == "cpu" and kv_segment_ids.device.type == "cpu":
        cu_q, cu_k, max_q, max_k = _ops.segment_ids_to_cu_seqlens(q_segment_ids.numpy(),
                                                                  kv_segment_ids.numpy())
        return torch.from_numpy(cu_q), torch.from_numpy(cu_k), max_q, max_k, None
    rows = q_segment_ids.shape[0]
    slots = rows * max_segments
    cu_q, row_q, id_q, n_q = _run_table(q_segment_ids, slots)
    cu_k, row_k, id_k, n_k = _run_table(kv_segment_ids, slots)
    bad = (n_q != n_k) | (n_q > slots) | (row_q != row_k).any() | (id_q != id_k).any()
    return cu_q, cu_k, q_segment_ids.shape[1], kv_segment_ids.shape[1], bad


def poison(out: torch.Tensor, bad) -> torch.Tensor:
    """out, or NaN everywhere when `bad` (a device bool) is set."""
    if bad is None:
        return out
    return out + torch.where(bad, float("nan"), 0.0).to(out.dtype)
