"""Prepared calls: the eager path of na1d/na2d/na3d and na*d_jvp while nothing watches.

functional.py validates a call once per signature (its options, and its tensors' shapes,
strides, dtypes, devices and types) and keeps a `Prepared` for it when the fused kernels run it
(self attention that runs dense, flattened: `Prepared.tokens`). A later call with that
signature comes here; while nothing watches it (_torch_internals.unwatched: no torch.compile trace, functorch
transform, forward-mode AD level, torch function or dispatch mode, nor profiler) it runs the C
kernel straight away: its outputs allocated, the data pointers written into the C argument
structs that _lib keeps for this thread under the signature, one foreign call. No custom-op
dispatch, no autograd.Function argument handling, no re-validation.

With an input that requires grad the forward goes through `PreparedAttention`, whose backward
runs the backward kernel the same way; when that backward must itself be differentiable
(create_graph) or something watches it, it takes the rules' differentiable backward
(autograd.EAGER), as NeighborhoodAttention does.

Every function here returns None when the call must take PyTorch's full path instead: a
watcher, or an input without storage (a functorch wrapper that outlived its transform, a legacy
batched tensor of gradcheck's batched checks).
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor

from . import _lib, _torch_internals, ops
from .rules import Geometry

__all__ = ["Prepared", "PreparedAttention", "PreparedJvpPrimal", "PreparedJvp", "PreparedJvpJoint", "na",
           "na_jvp"]

_unwatched = _torch_internals.unwatched
_run_state = ops.run_state
_plans = _lib.plans


def _lse_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


class Prepared:
    """One validated call signature of the fused kernels: its geometry, its outputs' shapes,
    and the keys of its C arguments in _lib's per-thread plans (built on first use in each
    thread and for each run_state()). kx/vx: None or the additional keys (then present in every
    call of the signature); empty_kx/empty_vx: the zero-length stand-ins the ops take for absent
    ones, plain tensors (functional.py's, made outside any transform: this object outlives the
    call that built it). table: the call's bias table [H, M] (then every call of the signature
    passes its own, `biased`) or the zero-size stand-in for none (kept as empty_rpb; a biased
    signature keeps no table). With a query range in the geometry, the row outputs (out, lse,
    their tangents, dq, d_t_q) are allocated zeroed: the kernels leave the rows outside it."""

    __slots__ = ("geometry", "plan_geometry", "tiles", "dtype", "lse_dtype", "device", "shapes",
                 "out_shape", "lse_shape", "empty_kx", "empty_vx", "empty_rpb", "biased", "flat",
                 "rows", "__weakref__")

    def __init__(self, q: Tensor, k: Tensor, v: Tensor, kx: Optional[Tensor], vx: Optional[Tensor],
                 geometry: Geometry, empty_kx: Tensor, empty_vx: Tensor, table: Tensor, spatial=None):
        ks, st, dil, causal, scale, tiles, query_range = geometry.args()
        self.geometry, self.tiles = geometry, tiles
        self.plan_geometry = ops._geometry(ks, st, dil, causal, scale, query_range)
        self.rows = torch.zeros if query_range else torch.empty
        self.dtype, self.lse_dtype, self.device = q.dtype, _lse_dtype(q.dtype), q.device
        # gradients for every tensor but the zero-length k, v of dense attention (rank 0)
        self.shapes = tuple(None if t is None or (not ks and i in (1, 2)) else t.shape
                            for i, t in enumerate((q, k, v, kx, vx)))
        self.out_shape = (*q.shape[:-1], (v if ks else vx).shape[-1])
        self.lse_shape = tuple(q.shape[:-1])
        self.empty_kx, self.empty_vx = empty_kx, empty_vx
        self.biased = table.numel() > 0
        self.empty_rpb = None if self.biased else table
        # self attention flattened into dense attention of the tokens (spatial: the axes):
        # (the empty k and v, the outputs' spatial shapes)
        self.flat = None if spatial is None else (
            k, v, (q.shape[0], *spatial, *self.out_shape[-2:]), (q.shape[0], *spatial, q.shape[-2]))

    def tokens(self, q, k, v):
        """A self-attention call's tensors as the dense kernel takes them: (q [B, N, H, D], the
        empty k and v, k and v [B, N, Hkv, D|Dv] as the additional tokens)."""
        B = q.shape[0]
        empty_k, empty_v = self.flat[:2]
        return (q.reshape(B, -1, *q.shape[-2:]), empty_k, empty_v,
                k.reshape(B, -1, *k.shape[-2:]), v.reshape(B, -1, *v.shape[-2:]))

    def spatial(self, *outs):
        """Outputs of the dense kernel ([B, N, H, ...]) back on the spatial axes: (out, lse) or
        (out, lse, t_out, t_lse)."""
        out_shape, lse_shape = self.flat[2:]
        return tuple(o.reshape(out_shape if i % 2 == 0 else lse_shape) for i, o in enumerate(outs))

    def _out(self) -> Tensor:
        return self.rows(self.out_shape, dtype=self.dtype, device=self.device)

    def _lse(self) -> Tensor:
        return self.rows(self.lse_shape, dtype=self.lse_dtype, device=self.device)

    def _grads(self, wanted=(True,) * 5) -> list:
        """Gradients shaped like (q, k, v, kx, vx), None where absent or not `wanted`: dq by
        `rows`, the others uninitialised (the kernels write them whole)."""
        dev, dt = self.device, self.dtype
        new = lambda i: self.rows if i == 0 else torch.empty
        return [None if s is None or not w else new(i)(s, dtype=dt, device=dev)
                for i, (s, w) in enumerate(zip(self.shapes, wanted))]

    def _plan(self, key, op: int, tensors, state, backward: bool) -> _lib._Plan:
        return _lib.prepare(key, op, self.plan_geometry, tensors,
                            **ops.run_options(self.tiles, backward, state))

    def forward(self, q, k, v, kx, vx, rpb=None, lse_wanted: bool = True) -> Tuple[Tensor, Tensor]:
        """(out, lse). rpb: the bias table of a biased signature, else None. Without lse_wanted
        the kernel writes the LSE into a spare tensor that this thread's plan keeps (the caller
        must not return or keep it)."""
        state = _run_state()
        key = (self, _lib.OP_FORWARD, state)
        plan = _plans().get(key)
        out = self._out()
        lse = plan.spare if plan is not None and not lse_wanted else self._lse()
        tensors = (q, k, v, kx, vx, out, lse) if rpb is None else (q, k, v, kx, vx, out, lse, rpb)
        if plan is None:
            plan = self._plan(key, _lib.OP_FORWARD, tensors, state, False)
            plan.spare = self._lse()
        plan.launch(tensors)
        return out, lse

    def backward(self, q, k, v, kx, vx, out, lse, d_out, d_lse, rpb=None) -> list:
        """[dq, dk, dv, dkx, dvx, d_rpb]: None for absent additional keys and for no table."""
        dev = self.device
        grads = self._grads()
        tensors = (q, k, v, kx, vx, out, lse, d_out, d_lse, *grads)
        if rpb is None:
            grads.append(None)
        else:   # the kernel writes the whole table gradient (zeroed first)
            grads.append(torch.empty(rpb.shape, dtype=rpb.dtype, device=dev))
            tensors = (*tensors, rpb, grads[-1])
        state = _run_state()
        key = (self, _lib.OP_BACKWARD, state, d_out.stride(), None if d_lse is None else d_lse.stride())
        plan = _plans().get(key) or self._plan(key, _lib.OP_BACKWARD, tensors, state, True)
        plan.launch(tensors)
        return grads

    def forward_jvp(self, q, k, v, kx, vx, tq, tk, tv, tkx, tvx, layouts=(),
                    lse_wanted: bool = True) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
        """(out, lse, t_out, t_lse). layouts: what else the plan depends on, when the signature
        does not fix it (the tangents of duals); lse_wanted: as forward's, for both LSEs."""
        state = _run_state()
        key = (self, _lib.OP_FORWARD_JVP, state, layouts)
        plan = _plans().get(key)
        out, t_out = self._out(), self._out()
        lse, t_lse = plan.spare if plan is not None and not lse_wanted else (self._lse(), self._lse())
        tensors = (q, k, v, kx, vx, tq, tk, tv, tkx, tvx, out, lse, t_out, t_lse)
        if plan is None:
            plan = self._plan(key, _lib.OP_FORWARD_JVP, tensors, state, False)
            plan.spare = self._lse(), self._lse()
        plan.launch(tensors)
        return out, lse, t_out, t_lse


    def forward_jvp_backward(self, saved, grads, wanted, layouts) -> list:
        """Gradients of <grads, (out, lse, t_out, t_lse)> w.r.t. the primals (None for absent
        additional keys) and the tangents (None unless `wanted`: needs_input_grad)."""
        d_x, d_t = self._grads(), self._grads(wanted)
        tensors = (*saved, *grads, *d_x, *d_t)
        state = _run_state()
        key = (self, _lib.OP_FORWARD_JVP_BACKWARD, state, layouts,
               tuple(None if g is None else g.stride() for g in grads), tuple(t is None for t in d_t))
        plan = _plans().get(key) or self._plan(key, _lib.OP_FORWARD_JVP_BACKWARD, tensors, state, True)
        plan.launch(tensors)
        return d_x + d_t


def _stored(*tensors) -> bool:
    """Every tensor given has storage (functorch wrappers and legacy batched tensors have none:
    they take PyTorch's path)."""
    try:
        for t in tensors:
            if t is not None:
                t.data_ptr()
    except RuntimeError:
        return False
    return True


def _plain_grad(t: Optional[Tensor]) -> bool:
    return t is None or (type(t) is Tensor and _stored(t))


def _save(ctx, prep: Prepared, q, k, v, kx, vx, rpb, out, lse) -> None:
    """Saves what NeighborhoodAttention saves, in its order (q, k, v, kx, vx, rpb, out, lse),
    the empty stand-ins for absent kx, vx and table: activation checkpointing recomputes a
    first call's NeighborhoodAttention through this cached path, and pairs the tensors saved
    then with these by position."""
    ctx.absent = kx is None
    if ctx.absent:
        kx, vx = prep.empty_kx, prep.empty_vx
    ctx.save_for_backward(q, k, v, kx, vx, prep.empty_rpb if rpb is None else rpb, out, lse)


def _attention_backward(prep: Prepared, absent: bool, q, k, v, kx, vx, rpb, out, lse, d_out, d_lse) -> tuple:
    """(dq, dk, dv, dkx, dvx, d_rpb) of a prepared call's first-order backward (None for absent
    additional keys and table); kx and vx are the empty stand-ins when `absent`"""
    if (d_out is not None and not torch.is_grad_enabled() and _unwatched()
            and _plain_grad(d_out) and _plain_grad(d_lse)):
        return tuple(prep.backward(q, k, v, None if absent else kx, None if absent else vx,
                                   out, lse, d_out, d_lse, rpb if prep.biased else None))
    # a differentiable backward (create_graph), or a watched one: the rules' path
    from .autograd import EAGER
    if d_out is None:
        d_out = torch.zeros_like(out)
    dq, dk, dv, dkx, dvx, d_rpb = EAGER.backward(q, k, v, kx, vx, rpb, out, lse, d_out, d_lse,
                                                 prep.geometry)
    return (dq, dk, dv, None if absent else dkx, None if absent else dvx,
            d_rpb if prep.biased else None)


class PreparedAttention(torch.autograd.Function):
    """(out, lse) of a prepared call whose inputs require grad. Outside any functorch transform
    only (unwatched): the transforms take NeighborhoodAttention."""

    @staticmethod
    def forward(ctx, q, k, v, kx, vx, rpb, prep):
        out, lse = prep.forward(q, k, v, kx, vx, rpb)
        ctx.set_materialize_grads(False)
        ctx.prep = prep
        _save(ctx, prep, q, k, v, kx, vx, rpb, out, lse)
        return out, lse

    @staticmethod
    def backward(ctx, d_out, d_lse):
        if d_out is None and d_lse is None:
            return None, None, None, None, None, None, None
        return (*_attention_backward(ctx.prep, ctx.absent, *ctx.saved_tensors, d_out, d_lse), None)


class PreparedJvpPrimal(PreparedAttention):
    """(out, lse) of a prepared forward+JVP already run (`ran`: its four outputs), as a node over
    the primals alone, with PreparedAttention's backward: a loss on the primal outputs (a
    MeanFlow step, which stops the tangent) never reaches the tangents' graph through it."""

    @staticmethod
    def forward(ctx, q, k, v, kx, vx, rpb, prep, ran):
        ctx.set_materialize_grads(False)
        ctx.prep = prep
        _save(ctx, prep, q, k, v, kx, vx, rpb, ran[0], ran[1])
        return ran[0], ran[1]

    @staticmethod
    def backward(ctx, d_out, d_lse):
        return (*PreparedAttention.backward(ctx, d_out, d_lse), None)


class PreparedJvp(torch.autograd.Function):
    """(t_out, t_lse) of a prepared forward+JVP already run (`ran`: its four outputs), as a node
    over the primals and tangents: its backward runs the fused backward through the forward+JVP
    with the tangent outputs' cotangents alone (PreparedJvpPrimal takes the primal outputs'),
    or the rules' path."""

    @staticmethod
    def forward(ctx, q, k, v, kx, vx, tq, tk, tv, tkx, tvx, prep, layouts, ran):
        ctx.set_materialize_grads(False)
        ctx.prep, ctx.layouts = prep, layouts
        ctx.save_for_backward(q, k, v, kx, vx, tq, tk, tv, tkx, tvx, *ran)
        return ran[2], ran[3]

    @staticmethod
    def backward(ctx, d_t_out, d_t_lse):
        if d_t_out is None and d_t_lse is None:
            return (None,) * 13
        return _jvp_backward(ctx, (None, None, d_t_out, d_t_lse))


class PreparedJvpJoint(PreparedJvp):
    """(out, lse, t_out, t_lse) of a prepared forward+JVP already run, as one node over the
    primals and tangents, where no tangent requires grad (the tangents are data: no graph above
    them to reach): a loss on both kinds of output runs one fused backward through the
    forward+JVP, which takes the primal outputs' cotangents for two more products per pair
    instead of a first-order backward of their own; a loss on the primal outputs alone runs the
    first-order backward, one on the tangent outputs alone the fused one."""

    @staticmethod
    def forward(ctx, q, k, v, kx, vx, tq, tk, tv, tkx, tvx, prep, layouts, ran):
        PreparedJvp.forward(ctx, q, k, v, kx, vx, tq, tk, tv, tkx, tvx, prep, layouts, ran)
        return tuple(ran)

    @staticmethod
    def backward(ctx, d_out, d_lse, d_t_out, d_t_lse):
        if d_t_out is None and d_t_lse is None:
            if d_out is None and d_lse is None:
                return (None,) * 13
            prep, saved = ctx.prep, ctx.saved_tensors
            absent = saved[3] is None
            kx, vx = (prep.empty_kx, prep.empty_vx) if absent else saved[3:5]
            grads = _attention_backward(prep, absent, *saved[:3], kx, vx, prep.empty_rpb, *saved[10:12],
                                        d_out, d_lse)
            return (*grads[:5], *(None,) * 8)
        return _jvp_backward(ctx, (d_out, d_lse, d_t_out, d_t_lse))


def _jvp_backward(ctx, grads) -> tuple:
    """The gradients of a PreparedJvp node (primals, tangents, then None for prep, layouts and
    ran) for the cotangents `grads` on (out, lse, t_out, t_lse)"""
    prep, saved = ctx.prep, ctx.saved_tensors
    fused = prep.device.type in ops.FUSED_JVP_BACKWARD_DEVICES
    if (fused and not torch.is_grad_enabled() and _unwatched() and all(_plain_grad(g) for g in grads)):
        return (*prep.forward_jvp_backward(saved, grads, ctx.needs_input_grad[5:10], ctx.layouts),
                None, None, None)
    # a differentiable backward (create_graph), a watched one, or no fused kernel
    from .autograd import EAGER
    from .rules import RULES
    inputs, outs = list(saved[:10]), saved[10:]
    absent = inputs[3] is None
    if absent:
        inputs[3], inputs[4] = prep.empty_kx, prep.empty_vx
    # absent tangents stay None: the rule skips their products
    both = (*inputs[:5], prep.empty_rpb, *inputs[5:], None)
    need = ctx.needs_input_grad
    wanted = (*need[:5], False, *need[5:10], False)   # the rule's positions: no bias tables here
    g = list(RULES["na_forward_jvp"].vjp(EAGER, (*both, *outs), fused, prep.geometry, grads, wanted))
    g = g[:5] + g[6:11]   # the prepared call has no bias table
    for i, t in enumerate(saved[:10]):
        if t is None:
            g[i] = None
    return (*g, None, None, None)


_apply = _torch_internals.raw_apply(PreparedAttention)
_apply_jvp_primal = _torch_internals.raw_apply(PreparedJvpPrimal)
_apply_jvp = _torch_internals.raw_apply(PreparedJvp)
_apply_jvp_joint = _torch_internals.raw_apply(PreparedJvpJoint)


def _jvp_with_grad(prep: Prepared, q, k, v, kx, vx, tq, tk, tv, tkx, tvx, layouts=()):
    """(out, lse, t_out, t_lse) of one forward+JVP kernel whose inputs require grad. Where a
    tangent requires grad, as two autograd nodes: the primal outputs over the primals
    (PreparedJvpPrimal), the tangent outputs over both (PreparedJvp). One node for all four
    would link the tangents' graph to the primal outputs: a backward from them alone would then
    visit every node that computed a tangent, all the way up the model. Tangents that are data
    have no graph: one node (PreparedJvpJoint), so that a loss on both runs one fused backward."""
    ran = prep.forward_jvp(q, k, v, kx, vx, tq, tk, tv, tkx, tvx, layouts)
    if not any(t is not None and t.requires_grad for t in (tq, tk, tv, tkx, tvx)):
        return _apply_jvp_joint(q, k, v, kx, vx, tq, tk, tv, tkx, tvx, prep, layouts, ran)
    out, lse = _apply_jvp_primal(q, k, v, kx, vx, None, prep, ran)
    t_out, t_lse = _apply_jvp(q, k, v, kx, vx, tq, tk, tv, tkx, tvx, prep, layouts, ran)
    return out, lse, t_out, t_lse


def _requires_grad(q, k, v, kx, vx, rpb=None) -> bool:
    return torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad or (
        kx is not None and (kx.requires_grad or vx.requires_grad)) or (
        rpb is not None and rpb.requires_grad))


def na(prep: Prepared, q, k, v, kx, vx, lse_wanted: bool = True,
       rpb: Optional[Tensor] = None) -> Optional[Tuple[Tensor, Tensor]]:
    """(out, lse) of a call with prep's signature (rpb: its table when prep.biased), or None
    (PyTorch's path). Without lse_wanted, lse is a spare the caller must drop (unless the
    backward needs it), or None."""
    if _unwatched():
        if not _stored(q, k, v, kx, vx, rpb):
            return None
        if prep.flat is not None:
            q, k, v, kx, vx = prep.tokens(q, k, v)
        if _requires_grad(q, k, v, kx, vx, rpb):
            outs = _apply(q, k, v, kx, vx, rpb, prep)
        else:
            outs = prep.forward(q, k, v, kx, vx, rpb, lse_wanted)
        return outs if prep.flat is None else prep.spatial(*outs)
    if _forward_ad_active() and not prep.biased:   # a table's tangent takes PyTorch's path
        return _dual(prep, q, k, v, kx, vx, lse_wanted)
    return None


_forward_ad_active = _torch_internals.forward_ad_active
_unpack_dual, _make_dual = _torch_internals.unpack_dual, _torch_internals.make_dual
_unwrap, _wrap = _torch_internals.unwrap_level, _torch_internals.wrap_level


def _dual(prep: Prepared, q, k, v, kx, vx, lse_wanted: bool = True) -> Optional[Tuple[Tensor, Tensor]]:
    """Under torch.func.jvp alone, or forward_ad duals outside transforms: (out, lse) as duals
    whose primals and tangents come from one forward+JVP kernel run on the inputs unwrapped
    from the jvp's level, the outputs wrapped back, as functorch does for an op; through
    PreparedJvp when those inputs require grad (a backward follows outside the level). Without
    lse_wanted, lse is None (no dual made for it). None when none carries a tangent, under
    forward_ad duals that require grad (a backward may follow inside the dual level:
    functional.py's two-kernel path), or under other transforms."""
    level = _torch_internals.lone_jvp_level()
    if level is None or (level < 0 and _requires_grad(q, k, v, kx, vx)):
        return None
    unpacked = [_unpack_dual(t) for t in ((q, k, v) if kx is None else (q, k, v, kx, vx))]
    tangents = [_unwrap(tangent, level) for _, tangent in unpacked]
    if all(t is None for t in tangents):
        return None
    dtype, device = prep.dtype, prep.device
    if any(t is not None and (t.dtype is not dtype or t.device != device) for t in tangents):
        return None   # forward-mode AD allows them; the op's checks refuse them
    primals = [_unwrap(primal, level) for primal, _ in unpacked]
    if not _stored(*primals, *tangents):
        return None
    if kx is None:
        primals += (None, None)
        tangents += (None, None)
    grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (*primals, *tangents))
    with _torch_internals.below_level(level), _torch_internals.forward_grad_disabled():
        if prep.flat is not None:
            primals, tangents = _tokens_with_tangents(prep, primals, tangents)
        layouts = tuple(None if t is None else t.stride() for t in (*primals, *tangents))
        if grad:
            out, lse, t_out, t_lse = _jvp_with_grad(prep, *primals, *tangents, layouts)
        else:   # an unwanted LSE and its tangent go to the plan's spares
            out, lse, t_out, t_lse = prep.forward_jvp(*primals, *tangents, layouts, lse_wanted=lse_wanted)
        if prep.flat is not None:
            out, lse, t_out, t_lse = prep.spatial(out, lse, t_out, t_lse)
    out = _make_dual(_wrap(out, level), _wrap(t_out, level))
    return out, (_make_dual(_wrap(lse, level), _wrap(t_lse, level)) if lse_wanted else None)


def na_jvp(prep: Prepared, q, k, v, kx, vx, tq, tk, tv, tkx, tvx, lse_wanted: bool = True):
    """(out, lse, t_out, t_lse) of an na*d_jvp call with prep's signature, or None (PyTorch's
    path). lse_wanted: as na's."""
    tensors = (q, k, v, kx, vx, tq, tk, tv, tkx, tvx)
    if not _unwatched() or not _stored(*tensors):
        return None
    if prep.flat is not None:
        primals, tangents = _tokens_with_tangents(prep, tensors[:5], tensors[5:])
        tensors = (*primals, *tangents)
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors):
        outs = _jvp_with_grad(prep, *tensors)
    else:
        outs = prep.forward_jvp(*tensors, lse_wanted=lse_wanted)
    return outs if prep.flat is None else prep.spatial(*outs)


def _tokens_with_tangents(prep: Prepared, primals, tangents):
    """prep.tokens of a self-attention call's primals, and their tangents alike (k's and v's
    become the additional tokens' tangents)."""
    q, k, v = primals[:3]
    tq, tk, tv = tangents[:3]
    B = q.shape[0]
    flat = lambda t: None if t is None else t.reshape(B, -1, *t.shape[-2:])
    return prep.tokens(q, k, v), (flat(tq), None, None, flat(tk), flat(tv))
