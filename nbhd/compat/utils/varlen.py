"""natten.utils.varlen: generate_varlen_parameters (the packed-sequence offsets of attention)."""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from ...attention import generate_varlen_parameters as _nbhd_generate_varlen_parameters

__all__ = ["generate_varlen_parameters"]


def generate_varlen_parameters(query: Tensor, key: Tensor, value: Tensor,
                               seqlens_Q: Optional[Tensor] = None,
                               seqlens_KV: Optional[Tensor] = None):
    """(cumulative_seqlen_Q, cumulative_seqlen_KV, max_seqlen_Q, max_seqlen_KV) for packed
    sequences of lengths seqlens_Q / seqlens_KV (int tensors [n]); (None, None, 0, 0) when
    neither is given. Refused inside torch.compile (it reads the lengths on the host)."""
    if torch.compiler.is_compiling():
        raise RuntimeError("generate_varlen_parameters reads sequence lengths on the host; call it "
                           "outside the compiled region and pass cumulative_seqlen_{Q,KV} and "
                           "max_seqlen_{Q,KV} to attention")
    if (seqlens_Q is None) != (seqlens_KV is None):
        raise ValueError("seqlens_Q and seqlens_KV must be given together (both or neither)")
    if seqlens_Q is None:
        return None, None, 0, 0
    return _nbhd_generate_varlen_parameters(query, key, value, seqlens_Q, seqlens_KV)
