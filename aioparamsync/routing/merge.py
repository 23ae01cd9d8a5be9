"""A read cut into parts, and the parts' answers merged into one."""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

from ..wire import thrift

__all__ = ["merge_answers", "merge_responses", "merge_results", "read_part"]


def read_part(request: Any, names: list[str]) -> Any:
    """A copy of a read ``request`` for ``names`` only (the node's passing on cuts so too),
    answered one ``Parameter`` each (not in blocks: the parts' answers are merged so)."""
    sub = copy.copy(request)
    sub.param_names = names
    sub.packed = sub.shared = None
    if request.known_versions:
        sub.known_versions = {n: v for n, v in request.known_versions.items() if n in names}
    if request.known_origins:
        sub.known_origins = {n: o for n, o in request.known_origins.items() if n in names}
    return sub


def merge_responses(answers: Sequence[Any]) -> Any:
    """One ``ParameterResponse`` of the parts' (their parameters, the largest timestamp)."""
    params = [p for a in answers for p in a.params]
    return thrift.ParameterResponse(params=params, timestamp=max(a.timestamp for a in answers))


def merge_results(answers: Sequence[Any]) -> Any:
    """One ``UpdateResult`` of the parts' (every version, the largest timestamp)."""
    versions: dict[str, int] = {}
    for a in answers:
        versions.update(a.versions)
    return thrift.UpdateResult(versions=versions, timestamp=max(a.timestamp for a in answers))


def merge_answers(oneway: bool, answers: Sequence[Any]) -> Any:
    """One answer of the answers of a call's parts (None for a oneway call)."""
    if oneway or all(a is None for a in answers):
        return None
    first = answers[0]
    if isinstance(first, thrift.ParameterResponse):
        return merge_responses(answers)
    if isinstance(first, thrift.UpdateResult):
        return merge_results(answers)
    return first
