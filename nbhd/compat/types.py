"""natten.types: NATTEN's argument type aliases and the KernelSchedule enum (accepted by nbhd,
whose kernels have no schedule variants)."""
from __future__ import annotations

from enum import Enum
from typing import Tuple, Union

NoneType = type(None)

Dimension1DType = Tuple[int]
Dimension2DType = Tuple[int, int]
Dimension3DType = Tuple[int, int, int]
CausalArg1DType = Tuple[bool]
CausalArg2DType = Tuple[bool, bool]
CausalArg3DType = Tuple[bool, bool, bool]
Dimension1DTypeOrDed = Union[int, Dimension1DType]
Dimension2DTypeOrDed = Union[int, Dimension2DType]
Dimension3DTypeOrDed = Union[int, Dimension3DType]
CausalArg1DTypeOrDed = Union[bool, CausalArg1DType]
CausalArg2DTypeOrDed = Union[bool, CausalArg2DType]
CausalArg3DTypeOrDed = Union[bool, CausalArg3DType]
DimensionType = Union[Dimension1DType, Dimension2DType, Dimension3DType]
CausalArgType = Union[CausalArg1DType, CausalArg2DType, CausalArg3DType]
DimensionTypeOrDed = Union[int, DimensionType]
CausalArgTypeOrDed = Union[bool, CausalArgType]
QKTileShapeType = Union[Tuple[Dimension1DType, Dimension1DType],
                        Tuple[Dimension2DType, Dimension2DType],
                        Tuple[Dimension3DType, Dimension3DType]]


class KernelSchedule(Enum):
    NonPersistent = 0
    WarpSpecializedCooperative = 1
    WarpSpecializedPingpong = 2


CutlassFnaForwardConfigType = CutlassFnaBackwardConfigType = QKTileShapeType
CutlassBlackwellFnaForwardConfigType = CutlassBlackwellFnaBackwardConfigType = QKTileShapeType
CutlassHopperFnaForwardConfigType = Tuple[QKTileShapeType, KernelSchedule]
CutlassHopperFnaBackwardConfigType = QKTileShapeType
FlexFnaForwardConfigType = QKTileShapeType
FmhaForwardConfigType = Tuple[int, int]
CutlassFmhaForwardConfigType = CutlassFmhaBackwardConfigType = FmhaForwardConfigType
FlexFmhaForwardConfigType = FmhaForwardConfigType
CutlassBlackwellFmhaForwardConfigType = CutlassBlackwellFmhaBackwardConfigType = FmhaForwardConfigType
CutlassHopperFmhaForwardConfigType = Tuple[FmhaForwardConfigType, KernelSchedule]
CutlassHopperFmhaBackwardConfigType = FmhaForwardConfigType
