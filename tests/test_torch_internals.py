"""nbhd/_torch_internals.py: every private PyTorch symbol it binds exists in this PyTorch, no
other module of nbhd reaches into a private PyTorch name, and each fast path built on them still
beats the public path it skips (timed in this process against that path, interleaved)."""
import ast
import pathlib

import pytest
import torch

import nbhd
from nbhd import _torch_internals, autograd, functional, ops, prepared
from nbhd._timing import sample

PACKAGE = pathlib.Path(nbhd.__file__).parent


def test_no_private_symbol_is_missing():
    assert _torch_internals.MISSING == [], (
        f"PyTorch {torch.__version__} lacks {_torch_internals.MISSING}: their fast paths are off")
    assert _torch_internals.EAGER_SHORTCUT and _torch_internals.FAST_APPLY
    assert _torch_internals.ONE_KERNEL_JVP and _torch_internals.PREPARED_CALLS
    assert _torch_internals.LONE_JVP and _torch_internals.RAW_DUALS


def _private_uses(source: str):
    """(line, text) of each private torch name the module source reaches: `import torch._x`,
    `from torch.x import _y`, and attribute chains like torch._C or alias._y on a torch module
    (however it was imported and named)."""
    tree = ast.parse(source)
    private = lambda dotted: any(p.startswith("_") and not p.startswith("__") for p in dotted.split("."))
    aliases, found = set(), []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == "torch":
                    if private(a.name):
                        found.append((node.lineno, f"import {a.name}"))
                    aliases.add(a.asname or "torch")
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "torch":
            for a in node.names:
                if private(node.module) or private(a.name):
                    found.append((node.lineno, f"from {node.module} import {a.name}"))
                aliases.add(a.asname or a.name)   # a name from torch may be a module
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            chain, base = [node.attr], node.value
            while isinstance(base, ast.Attribute):
                chain.append(base.attr)
                base = base.value
            if isinstance(base, ast.Name) and base.id in aliases and private(".".join(chain)):
                found.append((node.lineno, ".".join([base.id, *reversed(chain)])))
    return found


def test_only_torch_internals_uses_private_torch_names():
    offenders = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name != "_torch_internals.py":
            uses = _private_uses(path.read_text())
            if uses:
                offenders[str(path.relative_to(PACKAGE))] = uses
    assert not offenders, f"private PyTorch names outside nbhd/_torch_internals.py: {offenders}"
    # the checker finds each way of reaching one
    seen = _private_uses(
        "import torch\nimport torch._guards\nimport torch.autograd.forward_ad as fwd\n"
        "from torch._C._functorch import is_batchedtensor\n"
        "from torch.utils import _python_dispatch\nfrom torch import autograd\n"
        "torch._C._dispatch_keys(t)\nfwd._set_fwd_grad_enabled(False)\n"
        "autograd.profiler._is_profiler_enabled\ntorch.autograd.Function.apply.__func__\n")
    assert sorted({line for line, _ in seen}) == [2, 4, 5, 7, 8, 9], seen


def _faster(fast, slow, at_most: float, rounds: int, calls: int, attempts: int = 3) -> float:
    """Best-of ratio fast/slow over rounds taken in turn (noise hits both); passes as soon as
    one attempt is below `at_most`, else returns the best ratio seen."""
    best = float("inf")
    for _ in range(attempts):
        fast(), slow()
        a, b = [], []
        for _ in range(rounds):
            a += sample(fast, rounds=1, calls=calls)
            b += sample(slow, rounds=1, calls=calls)
        best = min(best, min(a) / min(b))
        if best < at_most:
            break
    return best


@pytest.fixture
def one_thread():
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


def _tiny():
    q = torch.randn(1, 16, 1, 8, generator=torch.Generator().manual_seed(0))
    empty = torch.empty(1, 0, 1, 8)
    return q, empty, torch.empty(0), autograd.Geometry([3], [1], [1], [False], 0.35)


def test_eager_op_shortcut_pays_off(one_thread):
    """ops.call skips the custom op's dispatch for plain tensors (about half of a tiny call;
    python tests/test_torch_internals.py prints the ratios)."""
    q, e, no_rpb, geo = _tiny()
    args = (q, q, q, e, e, no_rpb, *geo.args())
    shortcut = lambda: ops.call(ops.na_forward, *args)
    ratio = _faster(shortcut, lambda: ops.na_forward(*args), 0.85, rounds=15, calls=20)
    assert ratio < 0.85, f"the eager op shortcut takes {ratio:.2f} of the dispatched call"
    assert not ops._needs_dispatcher(args)


def test_function_apply_without_binding_pays_off(one_thread):
    q, e, no_rpb, geo = _tiny()
    cls = autograd.NeighborhoodAttention
    public = lambda: torch.autograd.Function.apply.__func__(cls, q, q, q, e, e, no_rpb, geo)
    for a, b in zip(cls.apply(q, q, q, e, e, no_rpb, geo), public()):
        assert torch.equal(a, b)
    ratio = _faster(lambda: cls.apply(q, q, q, e, e, no_rpb, geo), public, 0.9, rounds=15, calls=20)
    assert ratio < 0.9, f"apply without binding takes {ratio:.2f} of Function.apply"


def _patched(monkeypatch, changes, fn):
    """fn() with the (object, attribute, value) changes made, undone after."""
    def run():
        saved = [(obj, name, getattr(obj, name)) for obj, name, _ in changes]
        for obj, name, value in changes:
            monkeypatch.setattr(obj, name, value)
        try:
            return fn()
        finally:
            for obj, name, value in saved:
                monkeypatch.setattr(obj, name, value)
    return run


_NO_LONE_JVP = (prepared, "_dual", lambda *args: None)            # the Function under functorch
_NO_ONE_KERNEL = (functional, "_dual_outputs", lambda *args: None)  # its jvp rule: two kernels


def test_one_kernel_jvp_pays_off(one_thread, monkeypatch):
    q = _tiny()[0]
    t = torch.randn_like(q)
    f = lambda: torch.func.jvp(lambda x: nbhd.na1d(x, q, q, 3), (q,), (t,))
    one = _patched(monkeypatch, [_NO_LONE_JVP], f)
    two = _patched(monkeypatch, [_NO_LONE_JVP, _NO_ONE_KERNEL], f)
    for a, b in zip(one(), two()):
        torch.testing.assert_close(a, b)
    ratio = _faster(one, two, 0.95, rounds=8, calls=5)
    assert ratio < 0.95, f"the one-kernel jvp takes {ratio:.2f} of the two-kernel path"


def test_lone_jvp_pays_off(one_thread, monkeypatch):
    """Under torch.func.jvp alone, prepared._dual runs the kernel on the tensors unwrapped
    from the jvp's level (`lone_jvp_level`, `unwrap_level`, `below_level`, `wrap_level`)
    instead of the autograd.Function through functorch's custom_function_call."""
    q = _tiny()[0]
    t = torch.randn_like(q)
    f = lambda: torch.func.jvp(lambda x: nbhd.na1d(x, q, q, 3), (q,), (t,))
    f()
    via_function = _patched(monkeypatch, [_NO_LONE_JVP], f)
    for a, b in zip(f(), via_function()):
        assert torch.equal(a, b)
    ratio = _faster(f, via_function, 0.5, rounds=8, calls=5)
    assert ratio < 0.5, f"the lone-jvp path takes {ratio:.2f} of the Function's"


def test_prepared_call_pays_off(one_thread, monkeypatch):
    """An unwatched call with a validated signature runs its kernel from prepared.py
    (`unwatched`, `raw_apply`) instead of NeighborhoodAttention and the op."""
    q = _tiny()[0]
    leaf = q.clone().requires_grad_()
    for x in (q, leaf):
        f = lambda: nbhd.na1d(x, q, q, 3)
        f()
        assert _torch_internals.unwatched()
        via_op = _patched(monkeypatch, [(prepared, "na", lambda *args, **kw: None)], f)
        assert torch.equal(f(), via_op())
        ratio = _faster(f, via_op, 0.6, rounds=15, calls=20)
        assert ratio < 0.6, f"a prepared call takes {ratio:.2f} of the op path (requires_grad={x.requires_grad})"
    assert nbhd.na1d(leaf, q, q, 3).grad_fn is not None


def test_raw_apply_pays_off(one_thread):
    q = _tiny()[0]
    leaf = q.clone().requires_grad_()
    nbhd.na1d(leaf, q, q, 3)
    prep = next(c.prepared for c in functional._CHECKED.values()
                if c.prepared is not None and c.prepared.shapes[0] == q.shape)
    raw, public = prepared._apply, prepared.PreparedAttention.apply
    assert raw is not public
    ratio = _faster(lambda: raw(leaf, q, q, None, None, None, prep),
                    lambda: public(leaf, q, q, None, None, None, prep),
                    0.95, rounds=15, calls=20)
    assert ratio < 0.95, f"the C++ apply takes {ratio:.2f} of Function.apply"


def _dual_round_trips(n: int = 20):
    """(raw, public): n unpack-and-make round trips of a dual inside torch.func.jvp, through
    _torch_internals and through torch.autograd.forward_ad; each returns its last dual's
    (primal, tangent) outside the jvp."""
    import torch.autograd.forward_ad as fwAD
    q = _tiny()[0]
    t = torch.randn_like(q)

    def loop(unpack, make):
        def f(x):
            for _ in range(n):
                primal, tangent = unpack(x)
                x = make(primal, tangent)
            return x
        return lambda: torch.func.jvp(f, (q,), (t,))

    return (loop(_torch_internals.unpack_dual, _torch_internals.make_dual),
            loop(lambda x: tuple(fwAD.unpack_dual(x)), fwAD.make_dual))


def test_raw_duals_pay_off(one_thread):
    """The lone-jvp path unpacks and makes its duals with torch._unpack_dual and
    torch._make_dual, not forward_ad's Python functions, with the same duals."""
    raw, public = _dual_round_trips()
    for a, b in zip(raw(), public()):
        assert torch.equal(a, b)
    ratio = _faster(raw, public, 0.8, rounds=8, calls=5)
    assert ratio < 0.8, f"the raw dual ops take {ratio:.2f} of forward_ad's functions"


if __name__ == "__main__":   # the ratios, for choosing the thresholds above
    torch.set_num_threads(1)
    q, e, no_rpb, geo = _tiny()
    args = (q, q, q, e, e, no_rpb, *geo.args())
    cls = autograd.NeighborhoodAttention
    print("op shortcut", _faster(lambda: ops.call(ops.na_forward, *args), lambda: ops.na_forward(*args),
                                 0, 15, 20, 1))
    print("apply", _faster(lambda: cls.apply(q, q, q, e, e, no_rpb, geo),
                           lambda: torch.autograd.Function.apply.__func__(cls, q, q, q, e, e, no_rpb, geo), 0, 15, 20, 1))
    mp = pytest.MonkeyPatch()
    t = torch.randn_like(q)
    f = lambda: torch.func.jvp(lambda x: nbhd.na1d(x, q, q, 3), (q,), (t,))
    one = _patched(mp, [_NO_LONE_JVP], f)
    print("one-kernel jvp", _faster(one, _patched(mp, [_NO_LONE_JVP, _NO_ONE_KERNEL], f), 0, 8, 5, 1))
    print("lone jvp", _faster(f, one, 0, 8, 5, 1))
    leaf = q.clone().requires_grad_()
    for x in (q, leaf):
        g = lambda: nbhd.na1d(x, q, q, 3)
        g()
        print(f"prepared call (requires_grad={x.requires_grad})",
              _faster(g, _patched(mp, [(prepared, "na", lambda *a, **kw: None)], g), 0, 15, 20, 1))
    prep = next(c.prepared for c in functional._CHECKED.values() if c.prepared is not None)
    print("raw duals", _faster(*_dual_round_trips(), 0, 8, 5, 1))
    print("raw apply", _faster(lambda: prepared._apply(leaf, q, q, None, None, None, prep),
                               lambda: prepared.PreparedAttention.apply(leaf, q, q, None, None, None, prep),
                               0, 15, 20, 1))
