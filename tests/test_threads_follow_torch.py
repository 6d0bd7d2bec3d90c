"""nbhd's CPU kernels take at most torch.get_num_threads() threads, on every Python thread (the
library lowers the count for small problems; a count set in ops._OPTIONS is used exactly)."""
import threading

import torch

import nbhd
from nbhd import _lib, ops


def _threads_seen(monkeypatch, fn):
    """The thread count of every launch fn makes (prepared calls and ops alike)."""
    seen = []
    real = _lib._Plan.launch
    monkeypatch.setattr(_lib._Plan, "launch", lambda self, t: (seen.append(self.exec.threads), real(self, t))[1])
    fn()
    monkeypatch.setattr(_lib._Plan, "launch", real)
    return seen


def test_threads_follow_set_num_threads_on_every_thread(monkeypatch):
    before = torch.get_num_threads()
    q = torch.randn(1, 8, 8, 2, 8)
    try:
        torch.set_num_threads(1)

        def both():
            nbhd.na2d(q, q, q, 3)                               # this thread
            worker = threading.Thread(target=lambda: nbhd.na2d(q, q, q, 3))
            worker.start()                                      # a thread torch never set
            worker.join()

        assert _threads_seen(monkeypatch, both) == [-1, -1]
    finally:
        torch.set_num_threads(before)
    assert _threads_seen(monkeypatch, lambda: nbhd.na2d(q, q, q, 3)) == [-before]


def test_an_explicit_count_is_passed_as_is(monkeypatch):
    monkeypatch.setitem(ops._OPTIONS, "threads", 2)
    q = torch.randn(1, 8, 8, 2, 8)
    out = nbhd.na2d(q, q, q, 3)
    assert _threads_seen(monkeypatch, lambda: nbhd.na2d(q, q, q, 3)) == [2]
    monkeypatch.setitem(ops._OPTIONS, "threads", 0)
    torch.testing.assert_close(nbhd.na2d(q, q, q, 3), out, rtol=0, atol=0)  # same result either way
