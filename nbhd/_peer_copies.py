"""Halo transfers by the GPUs' copy engines (nbhd.distributed on the GPUs of one host).

Each rank packs its outgoing pieces into its own symmetric-memory buffer
(torch.distributed._symmetric_memory), one slot per receiving rank; after a barrier every rank
copies its slot out of each sender's buffer (a device-to-device cudaMemcpy of peer memory: the
copy engines move it, no SM does), and a second barrier tells every sender that its slots were
read. Packing runs on the current stream; the barriers and copies run on a side stream, so a
kernel launched after `post` runs beside the transfer (NCCL's point-to-point transfers are
kernels that wait for SMs the attention kernel holds; docs/context_parallel.md).
"""
from __future__ import annotations

import math
import socket
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import Tensor

_AVAILABLE: Dict[tuple, bool] = {}
_BUFFERS: Dict[tuple, Tuple[Tensor, object]] = {}
_SIDE_STREAMS: Dict[int, "torch.cuda.Stream"] = {}


def _group_name(group) -> str:
    return (group if group is not None else dist.group.WORLD).group_name


def available(group, device: torch.device) -> bool:
    """Whether every rank of the group is a CUDA device of this host that can read every other
    rank's memory, and symmetric memory exists: the same answer on every rank (collective on
    the first call per group and device)."""
    key = (_group_name(group), device.index)
    if key not in _AVAILABLE:
        try:
            import torch.distributed._symmetric_memory  # noqa: F401
            importable = True
        except ImportError:
            importable = False
        mine = (socket.gethostname(), device.index if device.type == "cuda" else -1, importable)
        everyone: List[Optional[tuple]] = [None] * dist.get_world_size(group)
        dist.all_gather_object(everyone, mine, group=group)
        ok = all(host == mine[0] and index >= 0 and imp for host, index, imp in everyone)
        if ok:
            indices = [index for _, index, _ in everyone]
            ok = len(set(indices)) == len(indices) and all(
                torch.cuda.can_device_access_peer(device.index, other)
                for other in indices if other != device.index)
            flags = torch.tensor([int(ok)], device=device)
            dist.all_reduce(flags, op=dist.ReduceOp.MIN, group=group)
            ok = bool(flags.item())
        _AVAILABLE[key] = ok
    return _AVAILABLE[key]


def _buffer(group, device: torch.device, nbytes: int):
    """This rank's symmetric buffer of at least nbytes and its handle (reallocated, collectively,
    when a transfer needs more: every rank computes the same size)."""
    import torch.distributed._symmetric_memory as symm_mem
    key = (_group_name(group), device.index)
    held = _BUFFERS.get(key)
    if held is None or held[0].numel() < nbytes:
        if held is not None:
            torch.cuda.current_stream(device).wait_stream(_side_stream(device))
        buf = symm_mem.empty(nbytes, dtype=torch.uint8, device=device)
        held = (buf, symm_mem.rendezvous(buf, _group_name(group)))
        _BUFFERS[key] = held
    return held


def _side_stream(device: torch.device) -> "torch.cuda.Stream":
    if device.index not in _SIDE_STREAMS:
        # high priority: the barriers' one-block kernels start as soon as an SM frees
        _SIDE_STREAMS[device.index] = torch.cuda.Stream(device, priority=-1)
    return _SIDE_STREAMS[device.index]


def _bytes(t: Tensor) -> int:
    return t.numel() * t.element_size()


class Transfer:
    """A posted transfer: wait() orders the current stream after it (the host does not block)."""

    def __init__(self, device: torch.device, done: "torch.cuda.Event", keep: list):
        self.device, self.done, self.keep = device, done, keep

    def wait(self) -> None:
        torch.cuda.current_stream(self.device).wait_event(self.done)
        self.keep = []


def post(group, device: torch.device, pieces_out: Sequence[Tuple[int, Tensor]],
         pieces_in: Sequence[Tuple[int, Tensor]], slot_bytes: int) -> Transfer:
    """Sends pieces_out [(group rank, contiguous tensor)] and fills pieces_in [(group rank,
    contiguous tensor)]. Every rank of the group calls it (with empty lists too: the barriers
    are collective), with matching lists: the pieces one rank sends another are, in order, the
    pieces that rank receives from it, and no rank sends one rank more than slot_bytes (the
    same value on every rank)."""
    world, me = dist.get_world_size(group), dist.get_rank(group)
    buf, handle = _buffer(group, device, max(1, world * slot_bytes))
    side = _side_stream(device)
    # the previous transfer's second barrier: every peer has read this buffer
    torch.cuda.current_stream(device).wait_stream(side)
    ends: Dict[int, int] = {}
    for peer, t in pieces_out:   # packed on the current stream, in order, into the peer's slot
        start = ends.get(peer, peer * slot_bytes)
        if start + _bytes(t) > (peer + 1) * slot_bytes:
            raise RuntimeError("nbhd.distributed: a halo piece exceeds its transfer slot")
        buf[start:start + _bytes(t)].view(t.dtype).view(t.shape).copy_(t)
        ends[peer] = start + _bytes(t)
    side.wait_stream(torch.cuda.current_stream(device))
    starts: Dict[int, int] = {}
    with torch.cuda.stream(side):
        handle.barrier(channel=0)            # every rank has packed
        for peer, t in pieces_in:
            remote = handle.get_buffer(peer, (world * slot_bytes,), torch.uint8, 0)
            start = starts.get(peer, me * slot_bytes)
            t.copy_(remote[start:start + _bytes(t)].view(t.dtype).view(t.shape))
            starts[peer] = start + _bytes(t)
        handle.barrier(channel=1)            # every rank has read its slots: buffers reusable
        done = torch.cuda.Event()
        done.record(side)
    return Transfer(device, done, [t for _, t in pieces_out] + [t for _, t in pieces_in])


def slot_tokens(boxes: Sequence, read_boxes: Sequence) -> int:
    """The most tokens one rank sends another (either direction: the pieces are the owned boxes
    cut by the read boxes)."""
    most = 0
    for s, box in enumerate(boxes):
        for r, read in enumerate(read_boxes):
            if r != s:
                lo_hi = [(max(a[0], b[0]), min(a[1], b[1])) for a, b in zip(box, read)]
                most = max(most, math.prod(max(0, hi - lo) for lo, hi in lo_hi))
    return most
