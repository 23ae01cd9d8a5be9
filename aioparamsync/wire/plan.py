"""Plans: what the walk needs of a struct class, worked out once per class.

The structs are the classes :func:`thriftpy2.load` generates; their
``thrift_spec`` drives the walk, so the codec knows nothing of the IDL. A
spec's sub-specs come in several shapes (a bare type or a (type, sub) pair,
enums in the sub-spec's place...). A plan normalises them once (the fields by
id, their wire types and normalised sub-specs, the required names), so the
walk never looks at a spec again:

    LIST / SET -> (element type, element sub, element wire type)
    MAP        -> (key type, key sub, key wire, value type, value sub, value wire)
    STRUCT     -> the struct class
    otherwise  -> None
"""

from __future__ import annotations

from typing import Any

from thriftpy2.thrift import TType

from ..errors import RemoteProtocolError
from .protocol import _S_FIELD

# The spec's "binary" is a string on the wire.
_WIRE_TYPE = {TType.BINARY: TType.STRING, TType.UTF8: TType.STRING, TType.UTF16: TType.STRING}
_CONTAINER_TYPES = frozenset((TType.STRUCT, TType.LIST, TType.SET, TType.MAP))


def _wire_type(ttype: int) -> int:
    return _WIRE_TYPE.get(ttype, ttype)


def _split_spec(spec: Any) -> tuple[int, Any]:
    """An element spec is a bare type or a (type, sub-spec) pair."""
    if isinstance(spec, tuple):
        return spec[0], spec[1]
    return spec, None


def _field_sub_spec(field: tuple) -> Any:
    # (type, name, required), (type, name, enum, required), (type, name, sub, required)
    return field[2] if len(field) == 4 and field[0] in _CONTAINER_TYPES else None


def _norm_sub(ttype: int, sub: Any) -> Any:
    if ttype == TType.LIST or ttype == TType.SET:
        etype, esub = _split_spec(sub)
        return etype, _norm_sub(etype, esub), _wire_type(etype)
    if ttype == TType.MAP:
        (ktype, ksub), (vtype, vsub) = _split_spec(sub[0]), _split_spec(sub[1])
        return (
            ktype,
            _norm_sub(ktype, ksub),
            _wire_type(ktype),
            vtype,
            _norm_sub(vtype, vsub),
            _wire_type(vtype),
        )
    if ttype == TType.STRUCT:
        return sub
    return None


class _Plan:
    """A struct class's fields, ready for the walk.

    Attributes:
        by_id: field id -> (wire type, name, type, normalised sub-spec), for reading.
        in_order: (name, field id, type, normalised sub-spec, required,
            binary field header or None) by field id, for writing.
        required: names of the required fields.
    """

    __slots__ = ("by_id", "in_order", "required")

    def __init__(self, cls: Any) -> None:
        self.by_id: dict[int, tuple[int, str, int, Any]] = {}
        in_order = []
        for fid, field in sorted(cls.thrift_spec.items()):
            ttype, name = field[0], field[1]
            sub = _norm_sub(ttype, _field_sub_spec(field))
            wire = _wire_type(ttype)
            is_required = field[-1] is True
            self.by_id[fid] = (wire, name, ttype, sub)
            # None: not a valid binary field header (refused when written)
            header = (
                _S_FIELD.pack(wire, fid) if -128 <= wire < 128 and -(2**15) <= fid < 2**15 else None
            )
            in_order.append((name, fid, ttype, sub, is_required, header))
        self.in_order: tuple[tuple[str, int, int, Any, bool, bytes | None], ...] = tuple(in_order)
        # in the spec's order, so that the first one missing is named
        self.required: tuple[str, ...] = tuple(
            f[1] for f in cls.thrift_spec.values() if f[-1] is True
        )


_PLANS: dict[Any, _Plan] = {}


def _plan(cls: Any) -> _Plan:
    plan = _PLANS.get(cls)
    if plan is None:
        plan = _PLANS[cls] = _Plan(cls)
    return plan


def _build(cls: Any, plan: _Plan, values: dict[str, Any]) -> Any:
    """The decoded struct, once its required fields are known to be there."""
    for name in plan.required:
        if name not in values:
            raise RemoteProtocolError(f"required field {cls.__name__}.{name} is missing")
    return cls(**values)
