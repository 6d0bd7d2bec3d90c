"""Loads the nbhd C library and passes it tensors: data pointers, shapes, strides, stream.

Nothing here computes: it only marshals. Every tensor is described to C as a 6-D view
[B, X, Y, Z, H, D] with element strides (csrc/include/nbhd.h has the legend).
"""
from __future__ import annotations

import ctypes
import glob
import os
import sys
import threading
from typing import Optional, Sequence

import torch

__all__ = ["NbhdError", "lib", "Problem", "FIELDS", "run", "plans", "prepare", "tile_configs", "merge"]


class NbhdError(RuntimeError):
    """The C library rejected a call; the message names the field and the rule."""


def _find_library() -> str:
    override = os.environ.get("NBHD_LIBRARY")
    if override:
        return override
    here = os.path.dirname(os.path.abspath(__file__))
    found = sorted(glob.glob(os.path.join(here, "_nbhd*.so")) + glob.glob(os.path.join(here, "_nbhd*.pyd")))
    if not found:
        root = os.path.dirname(here)
        if os.path.isfile(os.path.join(root, "setup.py")):
            other = _other_nbhd(here)
            raise ImportError(
                f"nbhd was imported from its source tree {root} (the current directory or "
                "PYTHONPATH puts it first on sys.path), which has no built C library"
                + (f"; it shadows the installed nbhd at {other}: run Python from another "
                   "directory to use that one" if other else "")
                + ". To use the source tree, build it in place (`pip install -e .`), or point "
                "NBHD_LIBRARY at a built libnbhd.so (`make build/c/libnbhd.so`)")
        raise ImportError(
            f"nbhd's C library was not found in {here}: build it with `pip install .` "
            "(or `pip install -e .`) from the repository root")
    return found[0]


def _other_nbhd(here: str) -> Optional[str]:
    """The folder of an nbhd package other than `here` that Python could import (an installed
    or editable one), or None."""
    mine = os.path.realpath(here)
    for finder in sys.meta_path:   # editable installs answer through their own finder
        try:
            spec = finder.find_spec("nbhd", None) if hasattr(finder, "find_spec") else None
        except Exception:  # noqa: BLE001  (a third-party finder may fail any way)
            spec = None
        for folder in (spec.submodule_search_locations or []) if spec else []:
            if os.path.realpath(folder) != mine:
                return folder
    for entry in sys.path:
        folder = os.path.join(os.path.abspath(entry or os.curdir), "nbhd")
        if os.path.isfile(os.path.join(folder, "__init__.py")) and os.path.realpath(folder) != mine:
            return folder
    return None


MAX_RANK = 3
_DTYPES = {torch.float64: 0, torch.float32: 1, torch.float16: 2, torch.bfloat16: 3}
OP_FORWARD, OP_BACKWARD, OP_FORWARD_JVP, OP_FORWARD_JVP_BACKWARD = 0, 1, 2, 3


class _Problem(ctypes.Structure):
    _fields_ = [
        ("rank", ctypes.c_int32),
        ("extent", ctypes.c_int64 * MAX_RANK),
        ("kernel", ctypes.c_int32 * MAX_RANK),
        ("stride", ctypes.c_int32 * MAX_RANK),
        ("dilation", ctypes.c_int32 * MAX_RANK),
        ("causal", ctypes.c_uint8 * MAX_RANK),
        ("batch", ctypes.c_int64),
        ("extra_kv", ctypes.c_int64),
        ("heads", ctypes.c_int32),
        ("kv_heads", ctypes.c_int32),
        ("head_dim", ctypes.c_int32),
        ("head_dim_v", ctypes.c_int32),
        ("scale", ctypes.c_double),
        ("dtype", ctypes.c_int),
        ("device", ctypes.c_int),
        ("rpb", ctypes.c_int32),
        ("query_begin", ctypes.c_int64 * MAX_RANK),
        ("query_end", ctypes.c_int64 * MAX_RANK),
    ]


class _Tensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("stride", ctypes.c_int64 * 6), ("elements", ctypes.c_int64)]


class _Exec(ctypes.Structure):
    _fields_ = [
        ("stream", ctypes.c_void_p),
        ("workspace", ctypes.c_void_p),
        ("workspace_bytes", ctypes.c_size_t),
        ("threads", ctypes.c_int32),
        ("kv_parallel", ctypes.c_int32),
        ("use_reference", ctypes.c_int32),
        ("q_tile", ctypes.c_int32 * MAX_RANK),
        ("kv_tile", ctypes.c_int32 * MAX_RANK),
    ]


class _TileConfig(ctypes.Structure):
    _fields_ = [("q_tile", ctypes.c_int32 * MAX_RANK), ("kv_tile", ctypes.c_int32 * MAX_RANK)]


MERGE_MAX_PARTS = 32


class _MergeProblem(ctypes.Structure):
    _fields_ = [("parts", ctypes.c_int32), ("batch", ctypes.c_int64), ("tokens", ctypes.c_int64),
                ("heads", ctypes.c_int32), ("head_dim_v", ctypes.c_int32), ("dtype", ctypes.c_int),
                ("device", ctypes.c_int)]


class _MergeArgs(ctypes.Structure):
    _fields_ = [("outs", _Tensor * MERGE_MAX_PARTS), ("lses", _Tensor * MERGE_MAX_PARTS),
                ("out", _Tensor), ("lse", _Tensor)]


def _args_struct(name: str, fields: Sequence[str]):
    return type(name, (ctypes.Structure,), {"_fields_": [(f, _Tensor) for f in fields]})


_ARGS = {
    OP_FORWARD: _args_struct("_ForwardArgs", ["q", "k", "v", "kx", "vx", "out", "lse", "rpb"]),
    OP_BACKWARD: _args_struct("_BackwardArgs", [
        "q", "k", "v", "kx", "vx", "out", "lse", "d_out", "d_lse",
        "d_q", "d_k", "d_v", "d_kx", "d_vx", "rpb", "d_rpb"]),
    OP_FORWARD_JVP: _args_struct("_ForwardJvpArgs", [
        "q", "k", "v", "kx", "vx", "t_q", "t_k", "t_v", "t_kx", "t_vx",
        "out", "lse", "t_out", "t_lse", "rpb", "t_rpb"]),
}
_ARGS[OP_FORWARD_JVP_BACKWARD] = _args_struct("_ForwardJvpBackwardArgs", [
    "q", "k", "v", "kx", "vx", "t_q", "t_k", "t_v", "t_kx", "t_vx", "out", "lse", "t_out", "t_lse",
    "d_out", "d_lse", "d_t_out", "d_t_lse", "d_q", "d_k", "d_v", "d_kx", "d_vx",
    "d_t_q", "d_t_k", "d_t_v", "d_t_kx", "d_t_vx", "rpb", "t_rpb", "d_rpb", "d_t_rpb"])
_ENTRY = {OP_FORWARD: "nbhd_forward", OP_BACKWARD: "nbhd_backward", OP_FORWARD_JVP: "nbhd_forward_jvp",
          OP_FORWARD_JVP_BACKWARD: "nbhd_forward_jvp_backward"}


def _load():
    so = ctypes.CDLL(_find_library())
    so.nbhd_last_error.restype = ctypes.c_char_p
    so.nbhd_version.restype = ctypes.c_char_p
    so.nbhd_status_string.restype = ctypes.c_char_p
    so.nbhd_has_cuda.restype = ctypes.c_int
    so.nbhd_validate.argtypes = [ctypes.POINTER(_Problem)]
    so.nbhd_workspace_bytes.restype = ctypes.c_size_t
    so.nbhd_workspace_bytes.argtypes = [ctypes.POINTER(_Problem), ctypes.c_int, ctypes.POINTER(_Exec)]
    so.nbhd_tile_configs.restype = ctypes.c_int32
    so.nbhd_tile_configs.argtypes = [ctypes.POINTER(_Problem), ctypes.c_int, ctypes.POINTER(_TileConfig),
                                     ctypes.c_int32]
    so.nbhd_merge.restype = ctypes.c_int
    so.nbhd_merge.argtypes = [ctypes.POINTER(_MergeProblem), ctypes.POINTER(_MergeArgs),
                              ctypes.POINTER(_Exec)]
    for op, name in _ENTRY.items():
        fn = getattr(so, name)
        fn.restype = ctypes.c_int
        fn.argtypes = [ctypes.POINTER(_Problem), ctypes.POINTER(_ARGS[op]), ctypes.POINTER(_Exec)]
    return so


lib = _load()

_C_STRUCTS = {"nbhd_problem": _Problem, "nbhd_tensor": _Tensor, "nbhd_exec": _Exec,
              "nbhd_tile_config": _TileConfig, "nbhd_merge_problem": _MergeProblem,
              "nbhd_merge_args": _MergeArgs, "nbhd_forward_args": _ARGS[OP_FORWARD],
              "nbhd_backward_args": _ARGS[OP_BACKWARD], "nbhd_forward_jvp_args": _ARGS[OP_FORWARD_JVP],
              "nbhd_forward_jvp_backward_args": _ARGS[OP_FORWARD_JVP_BACKWARD]}


def _check_layout() -> None:
    """The ctypes structs above against the library's own sizes and offsets (nbhd_layout): a
    header changed without them, or a stale library, fails at import instead of corrupting
    calls."""
    if not hasattr(lib, "nbhd_layout"):
        raise ImportError(f"{lib._name} has no nbhd_layout: it is older than this package; rebuild it")
    lib.nbhd_layout.restype = ctypes.c_int64
    lib.nbhd_layout.argtypes = [ctypes.c_char_p, ctypes.c_char_p]
    for c_name, struct in _C_STRUCTS.items():
        checks = [("", ctypes.sizeof(struct))] + [(f, getattr(struct, f).offset) for f, _ in struct._fields_]
        for field, ours in checks:
            theirs = lib.nbhd_layout(c_name.encode(), field.encode())
            if theirs != ours:
                what = f"{c_name}.{field} offset" if field else f"sizeof({c_name})"
                raise ImportError(f"nbhd/_lib.py disagrees with {lib._name} on {what}: {ours} here, "
                                  f"{theirs} in the library (-1: unknown there); update the ctypes "
                                  f"structs to csrc/include/nbhd.h, or rebuild the library")


_check_layout()


def _by_address(name: str, library=None):
    """The entry point again (of `library`, by default the loaded one), taking the structs'
    addresses as plain ints (no conversion)."""
    fn = getattr(ctypes.CDLL((library or lib)._name), name)
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p] * 3
    return fn


_ENTRY_POINTS = {op: _by_address(name) for op, name in _ENTRY.items()}


def version() -> str:
    return lib.nbhd_version().decode()


_HAS_CUDA = bool(lib.nbhd_has_cuda())  # read once: a ctypes call cannot be traced by Dynamo


def has_cuda() -> bool:
    return _HAS_CUDA


lib.nbhd_cpu_isa.restype = ctypes.c_char_p


def cpu_isa() -> str:
    """The instruction set the fast CPU kernels run with here: "amx" (the bf16 kernels on AMX
    tiles, the rest AVX-512), "avx512", "avx2" or "generic"; NBHD_CPU_ISA can lower it."""
    return lib.nbhd_cpu_isa().decode()


class Problem:
    """The C problem descriptor for one call, built from the query and key tensors.

    `kernel_size` etc. are per-axis tuples of length rank (rank 0: dense attention over the
    additional keys only). q: [B, *spatial, H, D]; k: [B, *spatial, Hkv, D]; v: [..., Dv];
    kx/vx: [B, S, Hkv, D|Dv] or None. `rpb`: the scores carry a relative positional bias
    (the ops' tables, docs/rpb.md). `query_range`: () for every query, else
    (begin0, end0, begin1, end1, ...) per axis: only those queries are computed (nbhd.h).
    """

    def __init__(self, q, k, v, kx, vx, kernel_size, stride, dilation, is_causal, scale, rpb=False,
                 query_range=()):
        rank = len(kernel_size)
        p = _Problem()
        p.rank = rank
        spatial = q.shape[1:-2]
        for a in range(MAX_RANK):
            if a < rank:
                p.extent[a] = spatial[a]
                p.kernel[a] = kernel_size[a]
                p.stride[a] = stride[a]
                p.dilation[a] = dilation[a]
                p.causal[a] = 1 if is_causal[a] else 0
            else:
                p.extent[a] = p.kernel[a] = p.stride[a] = p.dilation[a] = 1
        if rank == 0:
            p.extent[0] = spatial[0]
        p.batch = q.shape[0]
        p.extra_kv = kx.shape[1] if kx is not None else 0
        p.heads = q.shape[-2]
        p.kv_heads = (k if rank > 0 else kx).shape[-2]
        p.head_dim = q.shape[-1]
        p.head_dim_v = (v if rank > 0 else vx).shape[-1]
        p.scale = float(scale)
        p.dtype = _DTYPES[q.dtype]
        p.device = 1 if q.device.type == "cuda" else 0
        p.rpb = 1 if rpb else 0
        for a in range(len(query_range) // 2):   # absent axes stay 0: the whole axis
            p.query_begin[a], p.query_end[a] = query_range[2 * a], query_range[2 * a + 1]
        self.c = p
        self.rank = rank
        self.device = q.device

    def check(self) -> None:
        status = lib.nbhd_validate(ctypes.byref(self.c))
        if status != 0:
            raise NbhdError(lib.nbhd_last_error().decode())


def _check(status: int) -> None:
    """Raises the C library's status and message for a failed call."""
    if status != 0:
        raise NbhdError(f"{lib.nbhd_status_string(status).decode()}: {lib.nbhd_last_error().decode()}")


def tile_configs(problem: Problem, op: int):
    """[(q_tile, kv_tile)] the op's tiled kernels accept for the problem (tuples of length
    rank, or 1 for rank 0), the default first; [] when no tiled kernel runs it."""
    count = lib.nbhd_tile_configs(ctypes.byref(problem.c), op, None, 0)
    if count < 0:
        raise NbhdError(lib.nbhd_last_error().decode())
    if count == 0:
        return []
    out = (_TileConfig * count)()
    lib.nbhd_tile_configs(ctypes.byref(problem.c), op, out, count)
    rank = max(problem.rank, 1)
    return [(tuple(c.q_tile[:rank]), tuple(c.kv_tile[:rank])) for c in out]


def _elements(t: torch.Tensor) -> int:
    """Elements of t's storage from its data on (the library checks the strides stay inside)."""
    return t.untyped_storage().nbytes() // t.element_size() - t.storage_offset()


def _describe(t: Optional[torch.Tensor], rank: int, token_major: bool = False,
              table: bool = False) -> _Tensor:
    """Tensor -> (pointer, 6 strides). Spatial tensors are [B, *spatial(rank), H, D?]; token
    tensors (additional keys, rank-0 queries) are [B, S, H, D?]; tables (rpb and its gradient
    and tangent) [H, M]."""
    d = _Tensor()
    if t is None:
        d.data = None
        return d
    d.data = t.data_ptr() if t.numel() else None
    # the storage from data on: the library checks that the strides stay inside it
    d.elements = _elements(t) if t.numel() else 0
    st = t.stride()
    if table:
        d.stride[4], d.stride[5] = st[0], st[1]
        return d
    n_spatial = 1 if token_major else rank
    has_last = t.dim() == n_spatial + 3
    d.stride[0] = st[0]
    for a in range(MAX_RANK):
        d.stride[1 + a] = st[1 + a] if a < n_spatial else 0
    head_axis = 1 + n_spatial
    d.stride[4] = st[head_axis]
    d.stride[5] = st[head_axis + 1] if has_last else 0
    return d


_TOKEN_MAJOR = frozenset({"kx", "vx", "d_kx", "d_vx", "t_kx", "t_vx", "d_t_kx", "d_t_vx"})
_TABLES = frozenset({"rpb", "t_rpb", "d_rpb", "d_t_rpb"})

# The C argument structs' fields in order: `run` takes its tensors in this order.
FIELDS = {op: tuple(name for name, _ in struct._fields_) for op, struct in _ARGS.items()}

# Workspaces up to this size stay with the calling thread between CPU calls; larger ones are
# allocated per call (their kernels dwarf the allocation, and nothing large stays resident).
_KEPT_WORKSPACE_BYTES = 8 << 20


class _Plan:
    """One op's C arguments for one geometry and tensor layout, built once: a call writes the
    data pointers (and on CUDA the stream and workspace) into them and calls the library.

    Each tensor's `elements` (its storage from data on) is the first call's: a later tensor of
    the same shape and strides reaches the same span, which PyTorch keeps inside its storage,
    so the library's extent check holds for it as well (a storage shrunk in place by resize_
    afterwards is the one case it no longer sees)."""

    def __init__(self, op, geometry, tensors, threads, use_reference, q_tile, kv_tile, kv_parallel,
                 problem=None):
        rank, kernel_size, stride, dilation, is_causal, scale, query_range = geometry
        q, k, v, kx, vx = tensors[:5]
        self.op = op
        # the bias tables are the structs' last fields: a caller without them may leave them off
        tables = sum(name in _TABLES for name in FIELDS[op])
        if not len(FIELDS[op]) - tables <= len(tensors) <= len(FIELDS[op]):
            raise ValueError(f"{_ENTRY[op]} takes {len(FIELDS[op])} tensors {FIELDS[op]} (the last "
                             f"{tables} optional), got {len(tensors)}")
        has_rpb = any(t is not None for name, t in zip(FIELDS[op], tensors) if name in _TABLES)
        self.problem = problem or Problem(q, k, v, kx, vx, kernel_size, stride, dilation, is_causal, scale,
                                          rpb=has_rpb, query_range=query_range)
        self.args = _ARGS[op]()   # ctypes structures start zeroed: absent tensors stay NULL
        self.slots = []           # (64-bit word of the data pointer, position in `tensors`)
        for pos, (name, t) in enumerate(zip(FIELDS[op], tensors)):
            if t is None:
                continue
            setattr(self.args, name, _describe(t, rank, token_major=rank == 0 or name in _TOKEN_MAJOR,
                                               table=name in _TABLES))
            if t.numel():
                field = getattr(type(self.args), name).offset
                self.slots.append(((field + _Tensor.data.offset) // 8, pos))
        self.words = (ctypes.c_int64 * (ctypes.sizeof(self.args) // 8)).from_buffer(self.args)
        ex = self.exec = _Exec()
        ex.threads = threads
        ex.use_reference = 1 if use_reference else 0
        ex.kv_parallel = 1 if kv_parallel else 0
        if q_tile:
            ex.q_tile[:len(q_tile)] = q_tile
        if kv_tile:
            ex.kv_tile[:len(kv_tile)] = kv_tile
        self.device = q.device
        self.cuda = q.device.type == "cuda"
        self.workspace_bytes = lib.nbhd_workspace_bytes(ctypes.byref(self.problem.c), op, ctypes.byref(ex))
        self.fn = _ENTRY_POINTS[op]
        self.addresses = (ctypes.addressof(self.problem.c), ctypes.addressof(self.args), ctypes.addressof(ex))

    def launch(self, tensors) -> None:
        words = self.words
        for word, pos in self.slots:
            words[word] = tensors[pos].data_ptr()
        nbytes, ex, workspace = self.workspace_bytes, self.exec, None
        if self.cuda:
            ex.stream = torch.cuda.current_stream(self.device).cuda_stream
            if nbytes:  # from the caching allocator, which orders its reuse on the stream
                workspace = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
                ex.workspace, ex.workspace_bytes = workspace.data_ptr(), nbytes
        elif nbytes:
            workspace = _cpu_workspace(nbytes)
            ex.workspace, ex.workspace_bytes = workspace.data_ptr(), nbytes
        status = self.fn(*self.addresses)
        del workspace  # kept alive until the call returned
        if status:
            _check(status)


_local = threading.local()   # per Python thread: its plans (their structs are written per call)
_MAX_PLANS = 256


def _cpu_workspace(nbytes: int) -> torch.Tensor:
    """A host buffer of at least nbytes, kept by the calling thread when small."""
    if nbytes > _KEPT_WORKSPACE_BYTES:
        return torch.empty(nbytes, dtype=torch.uint8)
    kept = getattr(_local, "workspace", None)
    if kept is None or kept.numel() < nbytes:
        kept = _local.workspace = torch.empty(max(nbytes, 1 << 16), dtype=torch.uint8)
    return kept


def _layout(t: Optional[torch.Tensor]):
    return None if t is None else (t.shape, t.stride())


def plans() -> dict:
    """This thread's plans, by key: `run`'s keys, and those of prepared.py's callers."""
    try:
        return _local.plans
    except AttributeError:
        made = _local.plans = {}
        return made


def prepare(key, op: int, geometry, tensors: Sequence[Optional[torch.Tensor]], threads: int = 0,
            use_reference: bool = False, q_tile=(), kv_tile=(), kv_parallel: bool = False) -> _Plan:
    """This thread's plan under `key`, built from `tensors` when it has none: `key` must name
    everything the plan holds (op, geometry, options and the tensors' layouts, as `run`'s key
    does), or stand for it (one validated call signature, prepared.py)."""
    kept = plans()
    plan = kept.get(key)
    if plan is None:
        if len(kept) >= _MAX_PLANS:
            kept.clear()
        plan = kept[key] = _Plan(op, geometry, tensors, threads, use_reference, q_tile, kv_tile,
                                 kv_parallel)
    return plan


def run(op: int, geometry, tensors: Sequence[Optional[torch.Tensor]], threads: int = 0,
        use_reference: bool = False, q_tile=(), kv_tile=(), kv_parallel: bool = False,
        problem: Optional[Problem] = None) -> None:
    """Calls one entry point. geometry = (rank, kernel_size, stride, dilation, is_causal, scale,
    query_range) with tuples of length rank (query_range: () or 2 x rank, Problem's); `tensors`
    are the op's C arguments in FIELDS[op] order (None: absent). The C structs are built once
    per geometry, layout and options (per thread).
    `problem` replaces the one the tensors describe, uncached (tests of the library's checks)."""
    if problem is not None:
        _Plan(op, geometry, tensors, threads, use_reference, q_tile, kv_tile, kv_parallel,
              problem).launch(tensors)
        return
    q = tensors[0]
    key = (op, geometry, tuple(q_tile), tuple(kv_tile), kv_parallel, use_reference, threads,
           q.dtype, q.device, *map(_layout, tensors))
    prepare(key, op, geometry, tensors, threads, use_reference, q_tile, kv_tile,
            kv_parallel).launch(tensors)


def merge(outs: Sequence[torch.Tensor], lses: Sequence[torch.Tensor], out: torch.Tensor,
          lse: torch.Tensor, threads: int = 0) -> None:
    """nbhd_merge: outs[i] [B, T, H, Dv] and lses[i] [B, T, H] (any strides) into out, lse."""
    p = _MergeProblem()
    p.parts = len(outs)
    p.batch, p.tokens, p.heads, p.head_dim_v = (int(x) for x in out.shape)
    p.dtype = _DTYPES[out.dtype]
    p.device = 1 if out.device.type == "cuda" else 0
    args = _MergeArgs()
    for i, (o, l) in enumerate(zip(outs, lses)):
        args.outs[i] = _describe(o, 1, token_major=True)
        args.lses[i] = _describe(l, 1, token_major=True)
    args.out = _describe(out, 1, token_major=True)
    args.lse = _describe(lse, 1, token_major=True)
    ex = _Exec()
    ex.threads = threads
    if out.device.type == "cuda":
        ex.stream = torch.cuda.current_stream(out.device).cuda_stream
    status = lib.nbhd_merge(ctypes.byref(p), ctypes.byref(args), ctypes.byref(ex))
    _check(status)
