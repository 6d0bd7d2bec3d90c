"""Context parallelism: neighborhood attention over a token grid sharded across a process group.

The grid [B, *S, H, D] is split along one or two spatial axes into boxes, one per rank (uneven
sizes allowed). Neighborhood attention is local, so each rank needs only a halo of keys/values
around its box: along a sharded axis, the union of its queries' windows is one contiguous key
range [L, R) (docs/context_parallel.md derives it). Every rank receives the halo from the ranks
that own it (point-to-point, possibly several ranks deep) and runs the fused kernel on the
sub-grid [L, R) with a query range: only its own queries are computed (the halo tokens serve as
keys and values alone). Sub-grid windows equal the global windows because
NATTEN's window is the centred window clamped into the grid, and [L, R) is chosen (and checked
at plan time, per axis) so that every own query's clamped window is the same on both grids.

The halo exchange is one autograd.Function whose backward sends the halo gradients back to their
owners (which add them), whose forward-mode rule exchanges the tangents (the exchange is linear)
and whose vmap rule folds the vmapped dimension into the exchanged tensor. So forward, backward,
double backward, torch.func.jvp/vjp/grad/vmap and forward-mode AD work as they do on one device.

    sharding = nbhd.distributed.Sharding((T, Hgt, Wid), axes=(0,))        # time split over the group
    q_local = nbhd.distributed.shard(q_full, sharding)                      # or produced locally
    out_local = nbhd.distributed.na3d(q_local, k_local, v_local, (3, 7, 7), sharding=sharding)
    out_full = nbhd.distributed.gather(out_local, sharding)                # for inspection
"""
from __future__ import annotations

import math
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from . import _torch_internals as _ti
from . import backends, checks, functional, ops
from .modules import NeighborhoodAttention2D, NeighborhoodAttention3D
from .reference import axis_windows
from .rules import Geometry

__all__ = ["Sharding", "HaloPlan", "axis_key_range", "split_sizes", "shard_box", "key_box",
           "exchange_halo", "shard", "gather",
           "na1d", "na2d", "na3d",
           "ContextParallelNeighborhoodAttention2D", "ContextParallelNeighborhoodAttention3D"]

_NA = {1: functional.na1d, 2: functional.na2d, 3: functional.na3d}
Range = Tuple[int, int]
Box = Tuple[Range, ...]


# ---------------------------------------------------------------------------------------------
# Per-axis window arithmetic

def _queries_matching(extent: int, kernel: int, stride: int, dilation: int, causal: bool,
                      lo: int, hi: int) -> Tensor:
    """bool [hi - lo]: does each query of [lo, hi) see, on the sub-axis [lo, hi), exactly its
    window on the whole axis [0, extent)?"""
    keys, valid = axis_windows(extent, kernel, stride, dilation, causal)
    sub_keys, sub_valid = axis_windows(hi - lo, kernel, stride, dilation, causal)
    keys, valid = keys[lo:hi], valid[lo:hi]
    return ((valid == sub_valid) & ((keys == sub_keys + lo) | ~valid)).all(1)


def _windows_match(extent: int, kernel: int, stride: int, dilation: int, causal: bool,
                   start: int, end: int, lo: int, hi: int) -> bool:
    """True iff every query in [start, end) (inside [lo, hi)) sees, on the sub-axis [lo, hi),
    exactly its window on the whole axis [0, extent)."""
    same = _queries_matching(extent, kernel, stride, dilation, causal, lo, hi)
    return bool(same[start - lo:end - lo].all())


def axis_read_range(extent: int, kernel: int, stride: int, dilation: int, causal: bool,
                    start: int, end: int) -> Range:
    """[lo, hi) on one axis: the union of the windows of the queries [start, end), the only keys
    whose values their outputs (and gradients) depend on. The key range around it (below) only
    reproduces the window rule; its other keys are never read into a result."""
    if not 0 <= start < end <= extent:
        raise ValueError(f"query range [{start}, {end}) must be a non-empty part of [0, {extent})")
    keys, valid = axis_windows(extent, kernel, stride, dilation, causal)
    keys, valid = keys[start:end], valid[start:end]
    lo = int(keys[:, 0].min())   # slot 0 is always valid: every window holds at least its query
    hi = int(torch.where(valid, keys, torch.zeros_like(keys)).max()) + 1
    return lo, hi


def axis_key_range(extent: int, kernel: int, stride: int, dilation: int, causal: bool,
                   start: int, end: int) -> Range:
    """[L, R) on one axis: the smallest range found by the rules below whose sub-axis gives the
    queries [start, end) exactly their windows of the whole axis [0, extent).

    Rules: [L, R) holds every key of those windows; for causal axes also each query's stride
    leader (the window start is computed from it, and a sub-axis ending before it would clamp
    it); L is a multiple of dilation*stride when stride > 1 (stride groups are anchored at the
    start of each dilation group); R - L >= kernel*dilation (the kernel's extent rule). The result
    is checked against the window rule itself (reference.axis_windows) for every own query.
    """
    lo, hi = axis_read_range(extent, kernel, stride, dilation, causal, start, end)
    if causal:
        x = torch.arange(start, end)
        g, i = x % dilation, x // dilation
        group_len = (extent - g + dilation - 1) // dilation
        leader = torch.minimum((i // stride) * stride + stride - 1, group_len - 1)
        hi = max(hi, int((g + leader * dilation).max()) + 1)
    align = dilation * stride if stride > 1 else 1
    lo = lo // align * align
    span = kernel * dilation
    if hi - lo < span:
        grown = min(extent, lo + span)
        if grown - lo < span:   # at the end of the axis: grow downwards instead
            lo = (grown - span) // align * align
            grown = max(hi, lo + span)
        hi = grown
    if not _windows_match(extent, kernel, stride, dilation, causal, start, end, lo, hi):
        raise RuntimeError(
            f"nbhd.distributed: the key range [{lo}, {hi}) does not reproduce the windows of queries "
            f"[{start}, {end}) (extent={extent}, kernel={kernel}, stride={stride}, "
            f"dilation={dilation}, causal={causal}); this is a bug in nbhd")
    return lo, hi


def own_box_queries(extent: int, kernel: int, stride: int, dilation: int, causal: bool,
                    lo: int, hi: int) -> Optional[Range]:
    """The longest run of queries in [lo, hi) whose windows on the sub-axis [lo, hi) alone are
    their windows on the whole axis [0, extent): the queries a rank can compute before its halo
    arrives. None when there is none (or the sub-axis is shorter than a window)."""
    if hi - lo < kernel * dilation:
        return None
    same = _queries_matching(extent, kernel, stride, dilation, causal, lo, hi).tolist()
    best, start = None, None
    for x, ok in enumerate(same + [False]):
        if ok and start is None:
            start = x
        if not ok and start is not None:
            if best is None or x - start > best[1] - best[0]:
                best = (start, x)
            start = None
    return None if best is None else (lo + best[0], lo + best[1])


def split_sizes(extent: int, parts: int, multiple: int = 1) -> Tuple[int, ...]:
    """Shard sizes of one axis: multiples of `multiple` as even as they go, the last shard
    short by what the axis lacks of a whole multiple (multiple 1: torch.tensor_split's sizes,
    the first extent % parts shards one token longer). With `multiple` = stride * dilation of
    a strided axis no shard boundary cuts a stride group, whose queries share one window: a
    cut group costs a partly filled query patch on each side (docs/context_parallel.md)."""
    if multiple < 1:
        raise ValueError(f"multiple must be >= 1, got {multiple}")
    units = -(-extent // multiple)
    if units < parts:
        raise ValueError(f"an extent of {extent} holds {units} multiples of {multiple}: too few "
                         f"for {parts} shards (need units >= parts)")
    sizes = [(units // parts + (1 if i < units % parts else 0)) * multiple for i in range(parts)]
    sizes[-1] -= units * multiple - extent
    if sizes[-1] < 1:
        raise ValueError(f"the last of {parts} shards of {extent} tokens in multiples of {multiple} "
                         f"would be empty")
    return tuple(sizes)


def shard_box(global_shape: Sequence[int], axes: Sequence[int], sizes: Sequence[Sequence[int]],
              coords: Sequence[int]) -> Box:
    """The box of the shard at mesh coordinates `coords` (one per sharded axis)."""
    box = [(0, e) for e in global_shape]
    for a, c, ax in zip(axes, coords, sizes):
        box[a] = (sum(ax[:c]), sum(ax[:c + 1]))
    return tuple(box)


def key_box(global_shape: Sequence[int], axes: Sequence[int], box: Box, ks, st, dil, causal) -> Box:
    """The keys the queries of `box` need (axis_key_range on each sharded axis), widened by one
    token where the sub-grid would otherwise run as dense attention while the whole grid does
    not (another kernel, other rounding: one more token keeps results bitwise equal)."""
    shape = tuple(global_shape)
    out = list(box)
    for a in axes:
        out[a] = axis_key_range(shape[a], ks[a], st[a], dil[a], causal[a], *box[a])
    if _runs_dense(out, ks, causal) and not _runs_dense([(0, e) for e in shape], ks, causal):
        a = next(a for a in axes if out[a] != (0, shape[a]))
        lo, hi = out[a]
        out[a] = (lo, hi + 1) if hi < shape[a] else (lo - (dil[a] * st[a] if st[a] > 1 else 1), hi)
        if not _windows_match(shape[a], ks[a], st[a], dil[a], causal[a], *box[a], *out[a]):
            raise RuntimeError(f"nbhd.distributed: widening the key range to {out[a]} broke the "
                               f"windows of {box[a]} on axis {a}; this is a bug in nbhd")
    return tuple(out)


def read_box(global_shape: Sequence[int], axes: Sequence[int], box: Box, ks, st, dil, causal) -> Box:
    """The keys whose values the queries of `box` read (axis_read_range on each sharded axis): the
    part of their key box that travels; the rest of the key box is zeros."""
    out = list(box)
    for a in axes:
        out[a] = axis_read_range(global_shape[a], ks[a], st[a], dil[a], causal[a], *box[a])
    return tuple(out)


def _runs_dense(box, ks, causal) -> bool:
    """True where nbhd.na*d runs a grid as dense self attention on CUDA: every window spans its
    axis and no axis is causal (functional._Call.runs_dense). The CPU runs such grids with the
    neighborhood kernels, which the widening keeps as well."""
    return all(hi - lo == k for (lo, hi), k in zip(box, ks)) and not any(causal)


def _balanced_mesh(world: int) -> Tuple[int, int]:
    """Two factors of world, as close to each other as possible (the smaller first)."""
    a = max(d for d in range(1, int(math.isqrt(world)) + 1) if world % d == 0)
    return a, world // a


def _intersect(a: Box, b: Box) -> Optional[Box]:
    out = tuple((max(x0, y0), min(x1, y1)) for (x0, x1), (y0, y1) in zip(a, b))
    return out if all(lo < hi for lo, hi in out) else None


def _slices(dim0: int, box: Box, origin: Sequence[int]) -> tuple:
    """Index of `box` (global coordinates) in a tensor whose spatial axes start at dim0 and whose
    spatial origin is `origin`."""
    return (slice(None),) * dim0 + tuple(slice(lo - o, hi - o) for (lo, hi), o in zip(box, origin))


# ---------------------------------------------------------------------------------------------
# Sharding and plans

class Sharding:
    """How a spatial grid is split across a process group.

    Args:
        global_shape: the spatial extents of the whole grid, e.g. (T, H, W)
        axes: the sharded spatial axes (one or two, e.g. (0,) for time or (0, 1))
        group: the process group (None: the default group)
        mesh_shape: ranks per sharded axis, their product the group size (default: the whole
            group on one axis; for two axes the most square factorization, smaller first).
            Rank r has mesh coordinates in row-major order.
        sizes: per sharded axis, the shard sizes (positive, summing to the extent); default
            split_sizes(extent, parts) (uneven where the ranks do not divide the extent)

    A rank's local tensors are [B, *local_shape, ...] with local_shape the sizes of its box.
    Plans (halo ranges and transfers) are computed once per window geometry and cached.
    """

    def __init__(self, global_shape: Sequence[int], axes: Sequence[int] = (0,), group=None,
                 mesh_shape: Optional[Sequence[int]] = None,
                 sizes: Optional[Sequence[Sequence[int]]] = None):
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("nbhd.distributed.Sharding needs an initialized default process group "
                               "(torch.distributed.init_process_group)")
        self.global_shape = tuple(int(e) for e in global_shape)
        spatial = len(self.global_shape)
        if not 1 <= spatial <= 3 or any(e < 1 for e in self.global_shape):
            raise ValueError(f"global_shape must be 1 to 3 positive extents, got {tuple(global_shape)}")
        self.axes = tuple(int(a) for a in axes)
        if not 1 <= len(self.axes) <= 2 or len(set(self.axes)) != len(self.axes) or \
                any(not 0 <= a < spatial for a in self.axes):
            raise ValueError(f"axes must be one or two distinct spatial axes in [0, {spatial}), "
                             f"got {tuple(axes)}")
        self.group = group
        self.world = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        if mesh_shape is None:
            mesh_shape = (self.world,) if len(self.axes) == 1 else _balanced_mesh(self.world)
        self.mesh_shape = tuple(int(m) for m in mesh_shape)
        if len(self.mesh_shape) != len(self.axes) or math.prod(self.mesh_shape) != self.world:
            raise ValueError(f"mesh_shape must have one entry per sharded axis {self.axes} and "
                             f"multiply to the group size {self.world}, got {tuple(mesh_shape)}")
        if sizes is None:
            sizes = [split_sizes(self.global_shape[a], m) for a, m in zip(self.axes, self.mesh_shape)]
        self.sizes = tuple(tuple(int(s) for s in ax) for ax in sizes)
        for a, m, ax in zip(self.axes, self.mesh_shape, self.sizes):
            if len(ax) != m or any(s < 1 for s in ax) or sum(ax) != self.global_shape[a]:
                raise ValueError(f"sizes of axis {a} must be {m} positive shard sizes summing to its "
                                 f"extent {self.global_shape[a]}, got {ax}")
        self._plans: Dict[tuple, HaloPlan] = {}

    def coords(self, rank: int) -> Tuple[int, ...]:
        """The mesh coordinates (one per sharded axis) of a group rank, row-major."""
        out = []
        for m in reversed(self.mesh_shape):
            out.append(rank % m)
            rank //= m
        return tuple(reversed(out))

    def box(self, rank: int) -> Box:
        """The [start, end) per spatial axis owned by a group rank (full range on unsharded axes)."""
        return shard_box(self.global_shape, self.axes, self.sizes, self.coords(rank))

    @property
    def local_shape(self) -> Tuple[int, ...]:
        """This rank's spatial sizes."""
        return tuple(hi - lo for lo, hi in self.box(self.rank))

    def global_rank(self, rank: int) -> int:
        return rank if self.group is None else dist.get_global_rank(self.group, rank)

    def plan(self, kernel_size, stride, dilation, is_causal) -> "HaloPlan":
        """The cached HaloPlan of a window geometry (validated against the global grid)."""
        ks, st, dil, causal = checks.geometry(self.global_shape, kernel_size, stride, dilation, is_causal)
        key = (ks, st, dil, causal)
        if key not in self._plans:
            self._plans[key] = HaloPlan(self, ks, st, dil, causal)
        return self._plans[key]

    def __repr__(self) -> str:
        return (f"Sharding(global_shape={self.global_shape}, axes={self.axes}, "
                f"mesh_shape={self.mesh_shape}, sizes={self.sizes}, rank={self.rank}/{self.world})")


class HaloPlan:
    """For one window geometry: every rank's sub-grid (its key box) and this rank's transfers.

    Attributes:
        boxes: per group rank, the owned box (global [start, end) per spatial axis)
        key_boxes: per group rank, the sub-grid its kernel runs on (contains the owned box): the
            window rule evaluated on it gives its queries their windows on the whole grid
        read_boxes: per group rank, the keys its queries' windows hold (inside the key box);
            the key box's other tokens are zeros, which no result reads
        sends: [(peer, box)] pieces of this rank's box that peer reads
        recvs: [(peer, box)] pieces of this rank's read box that peer owns
        interior: the owned queries whose windows the owned box alone holds (None: some
            sharded axis has none); border: the owned box's other pieces; border_key_boxes:
            the key box of each border piece; border_share: the largest share of border
            queries over the ranks (inf where some rank has no interior); send_holders: per
            send, the index of a border key box holding it (None: none does)
    """

    def __init__(self, sharding: Sharding, ks, st, dil, causal):
        self.sharding = sharding
        shape, axes = sharding.global_shape, sharding.axes
        self.boxes = [sharding.box(r) for r in range(sharding.world)]
        self.key_boxes = [key_box(shape, axes, box, ks, st, dil, causal) for box in self.boxes]
        self.read_boxes = [read_box(shape, axes, box, ks, st, dil, causal) for box in self.boxes]
        me = sharding.rank
        self.box, self.key_box = self.boxes[me], self.key_boxes[me]
        self.sends = [(r, piece) for r in range(sharding.world) if r != me
                      for piece in [_intersect(self.box, self.read_boxes[r])] if piece is not None]
        self.recvs = [(r, piece) for r in range(sharding.world) if r != me
                      for piece in [_intersect(self.boxes[r], self.read_boxes[me])] if piece is not None]
        # the own queries the own box alone serves (computed while the halo travels), and the
        # border pieces of the own box around them (computed once it arrived); every rank's
        # share of border queries decides whether overlapping pays (overlap=None)
        parts = [_interior_and_border(shape, axes, box, ks, st, dil, causal) for box in self.boxes]
        self.interior, self.border = parts[me]
        shares = [sum(_volume(b) for b in border) / _volume(box)
                  for box, (interior, border) in zip(self.boxes, parts) if interior is not None]
        self.border_share = max(shares) if len(shares) == len(parts) else math.inf
        # each border piece runs on the keys its own windows need (inside the key box)
        self.border_key_boxes: List[Box] = []
        for piece in self.border:
            kb = key_box(shape, axes, piece, ks, st, dil, causal)
            self.border_key_boxes.append(kb if _intersect(kb, self.key_box) == kb else self.key_box)
        # per send, the border piece whose key box holds it: the split backward adds the owner's
        # gradient of it there, beside the interior's backward
        self.send_holders = [next((i for i, kb in enumerate(self.border_key_boxes)
                                   if _intersect(box, kb) == box), None) for _, box in self.sends]

    @property
    def splits(self) -> bool:
        """Whether this rank can run split calls: it has interior queries and a border, and a
        border piece's key box holds each piece it sends."""
        return self.interior is not None and bool(self.border) and None not in self.send_holders

    @property
    def split_by_default(self) -> bool:
        """overlap=None's choice: split where no rank's border holds more than
        _OVERLAP_BORDER_SHARE of its queries."""
        return self.splits and self.border_share <= _OVERLAP_BORDER_SHARE

    @property
    def owned_tokens(self) -> int:
        return _volume(self.box)

    @property
    def key_box_tokens(self) -> int:
        """Tokens of this rank's sub-grid (owned, halo and zero-filled): what its kernel runs on."""
        return _volume(self.key_box)

    @property
    def query_range(self) -> Tuple[Range, ...]:
        """The owned box in the key box's coordinates: the queries this rank's kernel computes."""
        return _relative(self.box, _origin(self.key_box))

    @property
    def halo_tokens(self) -> int:
        """Tokens this rank receives per exchanged tensor (its sends are other ranks' receives)."""
        return sum(_volume(box) for _, box in self.recvs)

    def _post(self, pieces_out, pieces_in) -> list:
        """One batch of point-to-point transfers, posted: the requests to wait for.
        pieces_out: [(peer, tensor)], any layout; pieces_in: [(peer, contiguous tensor)] to fill."""
        group = self.sharding.group
        ops = []
        sent = [tensor.contiguous() for _, tensor in pieces_out]
        for (peer, _), tensor in zip(pieces_out, sent):
            ops.append(dist.P2POp(dist.isend, tensor, self.sharding.global_rank(peer), group))
        for peer, tensor in pieces_in:
            ops.append(dist.P2POp(dist.irecv, tensor, self.sharding.global_rank(peer), group))
        return (dist.batch_isend_irecv(ops) if ops else []) + [_Holds(sent)]

    def post_halo(self, tensors: Sequence[Tensor], dims: Sequence[int]):
        """Posts the exchange of owned tensors' halos (spatial axes from dims[i]): -> (per tensor,
        the pieces of self.recvs as they will arrive (contiguous), the requests to wait for)."""
        sends, recvs, halos = [], [], []
        origin_own = _origin(self.box)
        for t, d in zip(tensors, dims):
            for peer, box in self.sends:
                sends.append((peer, t[_slices(d, box, origin_own)]))
            pieces = [t.new_empty(_with_box(t.shape, d, box)) for _, box in self.recvs]
            recvs += [(peer, piece) for (peer, _), piece in zip(self.recvs, pieces)]
            halos.append(pieces)
        return halos, self._post(sends, recvs)

    def post_halo_grads(self, grads: Sequence[Sequence[Tensor]], like: Sequence[Tensor],
                        dims: Sequence[int]):
        """The adjoint of post_halo: per tensor, gradients of its self.recvs pieces (any
        layout), each sent to its owner -> (per tensor, the gradients of self.sends' pieces as
        they will arrive, the requests). like: the owned tensors (spatial axes from dims)."""
        sends, recvs, received = [], [], []
        for pieces, t, d in zip(grads, like, dims):
            sends += [(peer, g) for (peer, _), g in zip(self.recvs, pieces)]
            back = [t.new_empty(_with_box(t.shape, d, box)) for _, box in self.sends]
            recvs += [(peer, g) for (peer, _), g in zip(self.sends, back)]
            received.append(back)
        return received, self._post(sends, recvs)

    def owned_part(self, t: Tensor, d: int, box: Box) -> Tensor:
        """A tensor of the tokens of `box` (global coordinates, inside the key box) holding the
        owned tensor t's; the halo's part is for add_halo, the rest zeros (no window reads it)."""
        inters = [i for i in (_intersect(b, box) for b in [self.box] + [b for _, b in self.recvs]) if i]
        filled = sum(_volume(i) for i in inters) == _volume(box)
        out = (t.new_empty if filled else t.new_zeros)(_with_box(t.shape, d, box))
        inter = _intersect(self.box, box)
        if inter is not None:
            out[_slices(d, inter, _origin(box))] = t[_slices(d, inter, _origin(self.box))]
        return out

    def add_halo(self, out: Tensor, halo: Sequence[Tensor], d: int, box: Box) -> Tensor:
        """Writes the halo pieces' (post_halo's) tokens of `box` into out (owned_part's)."""
        for (_, piece_box), piece in zip(self.recvs, halo):
            inter = _intersect(piece_box, box)
            if inter is not None:
                out[_slices(d, inter, _origin(box))] = piece[_slices(d, inter, _origin(piece_box))]
        return out

    def assemble(self, t: Tensor, halo: Sequence[Tensor], d: int, box: Box) -> Tensor:
        """The tokens of `box` from the owned tensor t and its halo pieces, zeros elsewhere."""
        return self.add_halo(self.owned_part(t, d, box), halo, d, box)

    def gather_halo(self, tensors: Sequence[Tensor], dims: Sequence[int]) -> List[Tensor]:
        """Owned tensors (spatial axes from dims[i]) -> their key boxes, halos from their owners."""
        halos, requests = self.post_halo(tensors, dims)
        for req in requests:
            req.wait()
        return [self.assemble(t, h, d, self.key_box) for t, h, d in zip(tensors, halos, dims)]

    def reduce_halo(self, tensors: Sequence[Tensor], dims: Sequence[int]) -> List[Tensor]:
        """The adjoint of gather_halo: key-box tensors -> owned tensors, each halo piece sent back
        to its owner and added there."""
        origin_own = _origin(self.box)
        origin_key = _origin(self.key_box)
        own = [t[_slices(d, self.box, origin_key)].clone(memory_format=torch.contiguous_format)
               for t, d in zip(tensors, dims)]
        halo_grads = [[t[_slices(d, box, origin_key)] for _, box in self.recvs] for t, d in zip(tensors, dims)]
        received, requests = self.post_halo_grads(halo_grads, own, dims)
        for req in requests:
            req.wait()
        for o, back, d in zip(own, received, dims):
            for (_, box), g in zip(self.sends, back):
                o[_slices(d, box, origin_own)] += g
        return own


def _interior_and_border(shape, axes, box: Box, ks, st, dil, causal) -> Tuple[Optional[Box], List[Box]]:
    """The queries of `box` whose windows `box` alone holds (own_box_queries per sharded axis;
    None if some axis has none), and the border pieces of box around them (at most two per
    sharded axis)."""
    inner = [own_box_queries(shape[a], ks[a], st[a], dil[a], causal[a], *box[a]) if a in axes else box[a]
             for a in range(len(box))]
    if any(r is None for r in inner):
        return None, []
    rest, border = list(box), []
    for a in axes:
        (lo, hi), (ilo, ihi) = rest[a], inner[a]
        border += [tuple(rest[:a]) + ((x0, x1),) + tuple(rest[a + 1:]) for x0, x1 in ((lo, ilo), (ihi, hi))
                   if x0 < x1]
        rest[a] = (ilo, ihi)
    return tuple(inner), border


def _origin(box: Box) -> List[int]:
    """The first token of a box per axis: where a tensor holding it starts."""
    return [lo for lo, _ in box]


def _volume(box: Box) -> int:
    return math.prod(hi - lo for lo, hi in box)


def _with_box(shape, d: int, box: Box) -> list:
    """shape with its spatial axes (from dim d) the sizes of box."""
    shape = list(shape)
    shape[d:d + len(box)] = [hi - lo for lo, hi in box]
    return shape


class _Holds:
    """Keeps the tensors of posted sends alive until the transfer is waited for."""

    def __init__(self, tensors):
        self.tensors = tensors

    def wait(self):
        self.tensors = []


# ---------------------------------------------------------------------------------------------
# The exchange as a differentiable, linear map

class _GatherHalo(torch.autograd.Function):
    """Owned tensors -> key-box tensors (linear). Args: plan, dims (first spatial dim of each
    tensor), *tensors."""

    @staticmethod
    def forward(plan, dims, *tensors):
        return tuple(plan.gather_halo(tensors, dims))

    @staticmethod
    def setup_context(ctx, inputs, output):
        _save_shapes(ctx, inputs, output)

    @staticmethod
    def backward(ctx, *grads):   # grads are materialized: zeros for unused outputs
        return (None, None, *_ReduceHalo.apply(ctx.plan, ctx.dims, *grads))

    @staticmethod
    def jvp(ctx, _plan_t, _dims_t, *tangents):
        return _GatherHalo.apply(ctx.plan, ctx.dims, *_nonnull_in(ctx, tangents))

    @staticmethod
    def vmap(info, in_dims, plan, dims, *tensors):
        moved, new_dims = _fold_vmap(info, in_dims[2:], dims, tensors)
        return _GatherHalo.apply(plan, new_dims, *moved), (0,) * len(tensors)


class _ReduceHalo(torch.autograd.Function):
    """The adjoint of _GatherHalo: key-box tensors -> owned tensors, halos added by their owners."""

    @staticmethod
    def forward(plan, dims, *tensors):
        return tuple(plan.reduce_halo(tensors, dims))

    @staticmethod
    def setup_context(ctx, inputs, output):
        _save_shapes(ctx, inputs, output)

    @staticmethod
    def backward(ctx, *grads):   # grads are materialized: zeros for unused outputs
        return (None, None, *_GatherHalo.apply(ctx.plan, ctx.dims, *grads))

    @staticmethod
    def jvp(ctx, _plan_t, _dims_t, *tangents):
        return _ReduceHalo.apply(ctx.plan, ctx.dims, *_nonnull_in(ctx, tangents))

    @staticmethod
    def vmap(info, in_dims, plan, dims, *tensors):
        moved, new_dims = _fold_vmap(info, in_dims[2:], dims, tensors)
        return _ReduceHalo.apply(plan, new_dims, *moved), (0,) * len(tensors)


def _save_shapes(ctx, inputs, output):
    ctx.plan, ctx.dims = inputs[0], inputs[1]
    ctx.shapes = [t.shape for t in inputs[2:]]
    ctx.dtype, ctx.device = inputs[2].dtype, inputs[2].device


def _nonnull_in(ctx, tangents):
    """Zero tangents for inputs that have none: every rank must still take part in the exchange."""
    return [t if t is not None else torch.zeros(shape, dtype=ctx.dtype, device=ctx.device)
            for t, shape in zip(tangents, ctx.shapes)]


def _fold_vmap(info, in_dims, dims, tensors):
    """Every tensor with its vmapped dim first (unbatched ones expanded): the spatial axes move
    one dim to the right."""
    moved = []
    for t, b in zip(tensors, in_dims):
        if b is None:
            t = t.unsqueeze(0).expand(info.batch_size, *t.shape)
        else:
            t = t.movedim(b, 0)
        moved.append(t)
    return moved, tuple(d + 1 for d in dims)


@torch.compiler.disable
def exchange_halo(plan: HaloPlan, *tensors: Tensor, spatial_dim: int = 1) -> Tuple[Tensor, ...]:
    """This rank's tensors [*lead, *local_shape, *rest] (spatial axes from spatial_dim) -> the
    same over its key box, halos received from their owners. Differentiable (backward: halo
    gradients returned to and added by their owners), forward-mode and vmap capable. Every rank
    of the group must call it with the same plan and the same number of tensors.
    (torch.compile runs it eagerly: point-to-point transfers are not traced.)"""
    return _GatherHalo.apply(plan, (spatial_dim,) * len(tensors), *tensors)


# ---------------------------------------------------------------------------------------------
# Public functions

def shard(x: Tensor, sharding: Sharding, spatial_dim: int = 1) -> Tensor:
    """This rank's box of a full tensor [*lead, *global_shape, *rest] (spatial axes from
    spatial_dim; every rank holds the same x) -> [*lead, *local_shape, *rest], a contiguous copy.
    Differentiable (a slice)."""
    spatial = tuple(x.shape[spatial_dim:spatial_dim + len(sharding.global_shape)])
    if spatial != sharding.global_shape:
        raise ValueError(f"x's spatial sizes (dims {spatial_dim}..) {spatial} must equal the "
                         f"sharding's global_shape {sharding.global_shape}")
    return x[_slices(spatial_dim, sharding.box(sharding.rank), [0] * len(spatial))].contiguous()


def gather(x: Tensor, sharding: Sharding, spatial_dim: int = 1) -> Tensor:
    """Every rank's local tensor [*lead, *local_shape, *rest] -> the full tensor
    [*lead, *global_shape, *rest] on every rank (all_gather; not differentiable: for checks,
    logging and saving)."""
    boxes = [sharding.box(r) for r in range(sharding.world)]
    n = len(sharding.global_shape)
    local = tuple(x.shape[spatial_dim:spatial_dim + n])
    if local != sharding.local_shape:
        raise ValueError(f"x's spatial sizes (dims {spatial_dim}..) {local} must equal this rank's "
                         f"local_shape {sharding.local_shape}")
    biggest = [max(b[a][1] - b[a][0] for b in boxes) for a in range(n)]
    padded_shape = list(x.shape)
    padded_shape[spatial_dim:spatial_dim + n] = biggest
    x = x.detach()
    padded = x.new_zeros(padded_shape)
    padded[_slices(spatial_dim, tuple((0, e) for e in local), [0] * n)] = x
    parts = [torch.empty_like(padded) for _ in boxes]
    dist.all_gather(parts, padded.contiguous(), group=sharding.group)
    full_shape = list(x.shape)
    full_shape[spatial_dim:spatial_dim + n] = sharding.global_shape
    full = x.new_empty(full_shape)
    for part, box in zip(parts, boxes):
        sizes = tuple((0, hi - lo) for lo, hi in box)
        full[_slices(spatial_dim, box, [0] * n)] = part[_slices(spatial_dim, sizes, [0] * n)]
    return full


class _Overlapped(torch.autograd.Function):
    """One rank's sharded attention as one autograd node, the halo exchange beside the compute
    (eager calls on plain tensors; `overlap` of na*d). Forward: the interior queries on the
    own box; beside them, on a high-priority side stream, the exchange of k and v, then each
    border piece on its own key box (kept for the backward); their rows written into the
    output. Backward: the border pieces, then the interior's, while the border's halo
    gradients travel to their owners and the owners' come back; then every part added into
    the owned gradients. A backward that builds a graph (double backward) recomputes through
    the composable path (_na_composed)."""

    @staticmethod
    def forward(ctx, spec, q, k, v):
        plan, kernel, composed = spec
        ctx.spec = spec
        ctx.set_materialize_grads(False)
        own = _origin(plan.box)
        # beside the interior's kernel: the halo's transfer, then each border piece on its key
        # box (the CTAs of the high-priority side stream take SMs as the interior's retire)
        side = _Beside(q.device)
        with side:
            (hk, hv), requests = plan.post_halo((k, v), (1, 1))
        out, lse = kernel(q, k, v, _relative(plan.interior, own))
        with side:
            inputs = [(_rows_of(q, piece, own, kb), plan.owned_part(k, 1, kb), plan.owned_part(v, 1, kb))
                      for piece, kb in zip(plan.border, plan.border_key_boxes)]
            for req in requests:
                req.wait()
            border = [kernel(qb, plan.add_halo(kb_k, hk, 1, kb), plan.add_halo(kb_v, hv, 1, kb),
                             _relative(piece, _origin(kb)))
                      for piece, kb, (qb, kb_k, kb_v) in zip(plan.border, plan.border_key_boxes, inputs)]
        key_boxes = [t for _, kb_k, kb_v in inputs for t in (kb_k, kb_v)]
        side.join([t for b in border for t in b] + key_boxes)
        for piece, kb, (ob, lb) in zip(plan.border, plan.border_key_boxes, border):
            at_own, at_kb = _slices(1, piece, own), _slices(1, piece, _origin(kb))
            out[at_own], lse[at_own] = ob[at_kb], lb[at_kb]
        # the border key boxes are kept for the backward: less than the one call keeps (its
        # whole key box), and gathering them again would be the backward's longest copy before
        # its first kernel
        ctx.save_for_backward(q, k, v, out, lse, *key_boxes)
        return out, lse

    @staticmethod
    def backward(ctx, d_out, d_lse):
        plan, kernel, composed = ctx.spec
        q, k, v, out, lse, *key_boxes = ctx.saved_tensors
        if torch.is_grad_enabled():   # a graph of the backward: the composable path's
            with torch.enable_grad():
                res = composed(q, k, v)
                pairs = [(o, g) for o, g in zip(res, (d_out, d_lse)) if g is not None]
                grads = torch.autograd.grad([o for o, _ in pairs], (q, k, v), [g for _, g in pairs],
                                            create_graph=True, allow_unused=True)
            return (None, *grads)
        if d_out is None:
            d_out = torch.zeros_like(out)
        own = _origin(plan.box)
        # the border pieces first, all SMs theirs; their halo gradients' transfer, posted before
        # the interior's backward is launched, goes ahead of its CTAs (a transfer posted later
        # waits for SMs behind them, as would the interior behind a high-priority border)
        border = []
        for i, (piece, kb) in enumerate(zip(plan.border, plan.border_key_boxes)):
            origin = _origin(kb)
            rows = [_rows_of(t, piece, own, kb) for t in (q, out, lse, d_out)]
            d_lse_b = None if d_lse is None else _rows_of(d_lse, piece, own, kb)
            dqb, dkb, dvb = kernel.backward(rows[0], key_boxes[2 * i], key_boxes[2 * i + 1], rows[1],
                                            rows[2], rows[3], d_lse_b, _relative(piece, origin))
            border.append((piece, kb, dqb, dkb, dvb))
        halo_grads = [[_cut_sum([(kb, b[i]) for _, kb, *b in border], rbox, like)
                       for (_, rbox) in plan.recvs] for i, like in ((1, k), (2, v))]
        side = _Beside(q.device)
        with side:
            (back_k, back_v), requests = plan.post_halo_grads(halo_grads, (k, v), (1, 1))
        dq, dk, dv = kernel.backward(q, k, v, out, lse, d_out, d_lse, _relative(plan.interior, own))
        with side:   # beside the interior's backward
            for req in requests:
                req.wait()
            # the owners' gradients of what this rank sent, added into the border piece whose
            # key box holds it (below, into the owned gradients with that piece's)
            for (_, box), gk, gv, i in zip(plan.sends, back_k, back_v, plan.send_holders):
                at = _slices(1, box, _origin(border[i][1]))
                border[i][3][at] += gk
                border[i][4][at] += gv
        side.join(())   # nothing made on the side stream is used on this one
        for piece, kb, dqb, dkb, dvb in border:
            origin = _origin(kb)
            dq[_slices(1, piece, own)] = dqb[_slices(1, piece, origin)]   # dq holds no other rows there
            inter = _intersect(plan.box, kb)
            dk[_slices(1, inter, own)] += dkb[_slices(1, inter, origin)]
            dv[_slices(1, inter, own)] += dvb[_slices(1, inter, origin)]
        return None, dq, dk, dv


class _Beside:
    """A context running CUDA work on a side stream that starts where the current stream is;
    join(tensors) orders the current stream after it and marks the tensors made there as used
    on the current stream. On the CPU both do nothing (the work runs in order)."""

    _streams: Dict[int, "torch.cuda.Stream"] = {}

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        if self.cuda:
            if device.index not in self._streams:
                # high priority: its CTAs are scheduled first as SMs free, so the border's
                # smaller work and the transfer after it finish while the interior still runs
                self._streams[device.index] = torch.cuda.Stream(device, priority=-1)
            self.stream, self.main = self._streams[device.index], torch.cuda.current_stream(device)
            self.stream.wait_stream(self.main)
        self.contexts = []

    def __enter__(self):   # may be entered several times, in turn
        if self.cuda:
            self.contexts.append(torch.cuda.stream(self.stream))
            self.contexts[-1].__enter__()

    def __exit__(self, *exc):
        if self.cuda:
            self.contexts.pop().__exit__(*exc)

    def join(self, tensors: Sequence[Tensor]) -> None:
        if self.cuda:
            self.main.wait_stream(self.stream)
            for t in tensors:
                t.record_stream(self.main)


def _cut_sum(parts: Sequence[Tuple[Box, Tensor]], box: Box, like: Tensor) -> Tensor:
    """The sum over parts (key-box tensors) of their tokens in `box`, as a tensor like `like`
    but for its spatial sizes: one part holding all of box is returned as a view, no copy."""
    cuts = [(inter, t, kb) for kb, t in parts for inter in [_intersect(box, kb)] if inter is not None]
    if len(cuts) == 1 and cuts[0][0] == box:
        inter, t, kb = cuts[0]
        return t[_slices(1, box, _origin(kb))]
    acc = like.new_zeros(_with_box(like.shape, 1, box))
    for inter, t, kb in cuts:
        acc[_slices(1, inter, _origin(box))] += t[_slices(1, inter, _origin(kb))]
    return acc


def _rows_of(t: Tensor, piece: Box, own: Sequence[int], kb: Box) -> Tensor:
    """An owned row tensor's rows of `piece` on the grid of key box kb (the other rows are
    never read: the kernels read a query range's rows only)."""
    out = t.new_empty(_with_box(t.shape, 1, kb))
    out[_slices(1, piece, _origin(kb))] = t[_slices(1, piece, own)]
    return out


class _Kernel:
    """The fused kernels of one validated call's geometry, for a query range: forward -> (out,
    lse); backward -> (dq, dk, dv), the rows of out, lse and dq outside the range uninitialised
    (the caller writes them). Calls the kernels directly (the _Overlapped node is their
    autograd); the arguments were checked by na*d, so each call only sets its range."""

    def __init__(self, rank, q, ks, st, dil, causal, scale, backend):
        self.rank, self.backend = rank, backends.choose(q, backend)
        self.geo = (ks, st, dil, causal, checks.scale_of(scale, q.shape[-1], q.dtype))

    @property
    def fused(self) -> bool:
        return self.backend in ("cpu-fna", "cuda-fna")

    def _args(self, q, k, v, queries: Box):
        geometry = Geometry(*self.geo, query_range=[x for r in queries for x in r])
        return functional._Call.checked(self.rank, q, k, v, None, None, geometry, self.backend).kernel_args()

    def __call__(self, q, k, v, queries: Box):
        q_, k_, v_, kx, vx, rpb, geometry = self._args(q, k, v, queries)
        return ops.forward_unfilled(q_, k_, v_, kx, vx, rpb, *geometry.args())

    def backward(self, q, k, v, out, lse, d_out, d_lse, queries: Box):
        q_, k_, v_, kx, vx, rpb, geometry = self._args(q, k, v, queries)
        return ops.backward_unfilled(q_, k_, v_, kx, vx, rpb, out, lse, d_out.contiguous(),
                                     None if d_lse is None else d_lse.contiguous(), *geometry.args())[:3]


# overlap=None overlaps where no rank's border holds more than this share of its queries: the
# split calls' extra work is paid on the border (two H200s, bench/bench_context_parallel.py,
# docs/context_parallel.md: faster at a 20 % border, slower at 30 % and at 50-57 %)
_OVERLAP_BORDER_SHARE = 0.25


def _na_sharded(rank: int, query: Tensor, key: Tensor, value: Tensor, kernel_size, stride,
                dilation, is_causal, scale, sharding: Sharding, backend, return_lse: bool,
                overlap: Optional[bool]):
    if not isinstance(sharding, Sharding):
        raise TypeError(f"sharding must be an nbhd.distributed.Sharding, got {type(sharding).__name__}")
    if len(sharding.global_shape) != rank:
        raise ValueError(f"na{rank}d needs a sharding of {rank} spatial axes, got global_shape "
                         f"{sharding.global_shape}")
    checks.flags(return_lse=return_lse)
    q, k, v = checks.qkv(query, key, value, rank)
    if tuple(q.shape[1:-2]) != sharding.local_shape:
        raise ValueError(f"query's spatial sizes {tuple(q.shape[1:-2])} must equal this rank's "
                         f"local_shape {sharding.local_shape} (global_shape "
                         f"{sharding.global_shape}, box {sharding.box(sharding.rank)})")
    plan = sharding.plan(kernel_size, stride, dilation, is_causal)
    ks, st, dil, causal = checks.geometry(sharding.global_shape, kernel_size, stride, dilation, is_causal)
    composed = lambda q, k, v: _na_composed(rank, plan, q, k, v, ks, st, dil, causal, scale, backend)
    split = (plan.split_by_default if overlap is None else overlap) and plan.splits and _can_overlap(q, k, v)
    kernel = _Kernel(rank, q, ks, st, dil, causal, scale, backend) if split else None
    if kernel is not None and kernel.fused:
        out, lse = _Overlapped.apply((plan, kernel, composed), q, k, v)
    else:
        out, lse = composed(q, k, v)
    return (out, lse) if return_lse else out


def _na_composed(rank, plan, q, k, v, ks, st, dil, causal, scale, backend):
    """The sharded attention of differentiable parts, for every transform: the exchange Function
    gives the key box, one kernel call computes the own queries on it."""
    k_box, v_box = exchange_halo(plan, k, v)
    # halo rows of q are never read (query ranges): zeros only give q the key box's shape
    pad = []
    for a in reversed(range(rank)):
        (lo, hi), (klo, khi) = plan.box[a], plan.key_box[a]
        pad += [lo - klo, khi - hi]
    q_box = F.pad(q, [0, 0, 0, 0] + pad)
    own = _slices(1, plan.box, _origin(plan.key_box))
    out, lse = _NA[rank](q_box, k_box, v_box, ks, st, dil, causal, scale, backend=backend,
                         return_lse=True, query_range=plan.query_range)
    return out[own], lse[own]


def _relative(box: Box, origin: Sequence[int]) -> Box:
    return tuple((lo - o, hi - o) for (lo, hi), o in zip(box, origin))


def _can_overlap(*tensors: Tensor) -> bool:
    """An eager call on plain tensors outside every functorch transform, forward-mode AD and
    torch.compile: _Overlapped can run it (it has no jvp or vmap rule, and its exchange is
    posted and waited for around kernel calls Dynamo does not trace)."""
    return (not torch.compiler.is_compiling() and not _ti.forward_ad_active()
            and all(_ti.plain_tensor(t) for t in tensors))


_DOC = """{rank}-D neighborhood attention on a grid sharded across a process group.

    Every rank passes its own box of the grid and gets its queries' outputs, equal to the
    corresponding part of nbhd.na{rank}d on the whole grid (same kernel, same windows).

    Args:
        query: [B, *sharding.local_shape, H, D] (this rank's box)
        key: [B, *local_shape, Hkv, D]; value: [B, *local_shape, Hkv, Dv]
        kernel_size, stride, dilation, is_causal, scale: as nbhd.na{rank}d, for the global grid
        sharding: an nbhd.distributed.Sharding of {rank} spatial axes (the same on every rank)
        backend: as nbhd.na{rank}d
        return_lse: also return the logsumexp [B, *local_shape, H]
        overlap: True: compute the own queries whose windows lie in the own box while the
            halo travels and each border piece after it arrived, and in the backward send the
            halo gradients while the interior's backward runs (eager calls on plain tensors
            outside functorch transforms and forward-mode AD, fused backends; elsewhere the
            exchange is waited for, then one call computes the own box). False: never.
            None (default): True where no rank's border pieces hold more than a quarter of
            its queries (docs/context_parallel.md: the split calls cost more elsewhere)

    Returns:
        output [B, *local_shape, H, Dv], or (output, lse).

    Every rank of the group must call it (the halo exchange is collective). Differentiable under
    autograd (the backward returns the halo gradients to their owners), torch.func.grad/vjp/
    jvp/vmap and forward-mode AD; torch.compile runs the exchange eagerly (a graph break).
    Compute: each rank runs the kernel on its key box (owned + halo tokens) for its own queries
    only (a query range), so its work is that of its own queries' windows.
    """


def _make(rank: int):
    def na(query: Tensor, key: Tensor, value: Tensor, kernel_size, stride=1, dilation=1,
           is_causal=False, scale: Optional[float] = None, *, sharding: Sharding,
           backend: Optional[str] = None, return_lse: bool = False, overlap: Optional[bool] = None):
        return _na_sharded(rank, query, key, value, kernel_size, stride, dilation, is_causal,
                           scale, sharding, backend, return_lse, overlap)

    na.__name__ = na.__qualname__ = f"na{rank}d"
    na.__doc__ = _DOC.format(rank=rank)
    return na


na1d, na2d, na3d = _make(1), _make(2), _make(3)
_NA_SHARDED = {1: na1d, 2: na2d, 3: na3d}


class _ContextParallel:
    """Mixin: forward runs the sharded na*d on this rank's box of the grid."""

    def __init__(self, *args, sharding: Sharding, **kwargs):
        super().__init__(*args, **kwargs)
        self.sharding = sharding

    def forward(self, x: Tensor) -> Tensor:
        """x [B, *sharding.local_shape, C] -> [B, *local_shape, C]"""
        if x.dim() != self.rank + 2 or x.shape[-1] != self.embed_dim:
            raise ValueError(f"{type(self).__name__} expects x of shape [batch, {self.rank} local "
                             f"spatial axes, embed_dim={self.embed_dim}], got {tuple(x.shape)}")
        q, k, v = self.qkv(x).unflatten(-1, (3, self.num_heads, self.head_dim)).unbind(-3)
        out = _NA_SHARDED[self.rank](q, k, v, self.kernel_size, self.stride, self.dilation,
                                     self.is_causal, self.scale, sharding=self.sharding)
        return self.proj_drop(self.proj(out.flatten(-2)))

    def extra_repr(self) -> str:
        return super().extra_repr() + f", sharding={self.sharding}"


class ContextParallelNeighborhoodAttention2D(_ContextParallel, NeighborhoodAttention2D):
    """NeighborhoodAttention2D on a sharded grid: the same parameters (state dicts interchange)
    and constructor arguments plus sharding=Sharding(...); x [B, *local_shape, C] -> same."""


class ContextParallelNeighborhoodAttention3D(_ContextParallel, NeighborhoodAttention3D):
    """NeighborhoodAttention3D on a sharded grid: the same parameters (state dicts interchange)
    and constructor arguments plus sharding=Sharding(...); x [B, *local_shape, C] -> same."""
