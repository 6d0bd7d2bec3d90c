"""nbhd/_lib.py's ctypes structs agree with the library's layout (nbhd_layout), and a struct
that disagrees is refused with the struct, the field and both numbers."""
import ctypes

import pytest

from nbhd import _lib


def test_structs_match_the_library():
    _lib._check_layout()
    assert _lib.lib.nbhd_layout(b"nbhd_tensor", b"") == ctypes.sizeof(_lib._Tensor)
    assert _lib.lib.nbhd_layout(b"nbhd_exec", b"threads") == _lib._Exec.threads.offset
    assert _lib.lib.nbhd_layout(b"nbhd_exec", b"no_such_field") == -1
    assert _lib.lib.nbhd_layout(b"no_such_struct", b"") == -1


def test_a_wrong_struct_is_refused(monkeypatch):
    fields = list(_lib._Exec._fields_)
    fields[3], fields[4] = fields[4], fields[3]          # threads and kv_parallel swapped
    swapped = type("_SwappedExec", (ctypes.Structure,), {"_fields_": fields})
    monkeypatch.setitem(_lib._C_STRUCTS, "nbhd_exec", swapped)
    with pytest.raises(ImportError, match=r"nbhd_exec\.kv_parallel offset"):
        _lib._check_layout()
