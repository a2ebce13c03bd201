"""Which routes are keyed, and how (part of the HTTP contract, :mod:`pg_idempotency.contract`,
which re-exports these): :class:`Policy` per route, :class:`Route` (the policy, the body
fields the fingerprint covers, the lease) and :class:`Routes` (patterns to routes; only the
listed ones are keyed by default)."""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import timedelta
from enum import Enum
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .contract import Settings

__all__ = ["Policy", "Route", "Routes"]


class Policy(str, Enum):
    """Per-route use of the Idempotency-Key header."""

    REQUIRED = "required"  #: 400 without the header
    OPTIONAL = "optional"  #: idempotent when the header is sent, passed through otherwise
    IGNORED = "ignored"  #: never looked at


def _route_regex(pattern: str) -> re.Pattern[str]:
    method, _, path = pattern.strip().partition(" ")
    parts = re.split(r"(\{[^/{}]+\})", path.strip())
    body = "".join("[^/]+" if p.startswith("{") else re.escape(p) for p in parts)
    return re.compile(f"{re.escape(method.upper())} {body}")


def _field_paths(value: Iterable[str] | None, name: str) -> tuple[tuple[str, ...], ...] | None:
    if value is None:
        return None
    if isinstance(value, (str, bytes)):
        raise ValueError(f"{name} is a list of field names, not one string: [{value!r}]")
    paths = tuple(tuple(str(f).split(".")) for f in value)
    if any("" in p for p in paths):
        raise ValueError(f"{name}: a field name is a non-empty name or a dotted path (a.b)")
    return paths


@dataclass(frozen=True, init=False)
class Route:
    """How one route is keyed (Powertools' and Stripe users' per-endpoint settings):

    - ``policy``: required (the default), optional or ignored;
    - ``fingerprint_fields``: only these fields of a JSON object body make up the fingerprint
      (top-level names, or dotted paths into nested objects: ``"card.last4"``); a field the
      body lacks is simply absent. None (the default): the whole body;
    - ``fingerprint_exclude``: these fields (names or dotted paths) are left out, e.g. a client
      timestamp or a trace id that differs between retries of one intent;
    - ``lease``: this route's lease (seconds or a timedelta), else the adapter's.

    The method and the path always count. The fields apply to a JSON object body only: any
    other body counts whole. Leaving a field out means two requests that differ only there are
    the same request (the retry gets the first one's answer), so leave out only what does not
    change the operation."""

    policy: Policy
    fingerprint_fields: tuple[tuple[str, ...], ...] | None
    fingerprint_exclude: tuple[tuple[str, ...], ...]
    lease: timedelta | float | None

    def __init__(self, policy: Policy | str = Policy.REQUIRED, *,
                 fingerprint_fields: Iterable[str] | None = None,
                 fingerprint_exclude: Iterable[str] = (),
                 lease: timedelta | float | None = None) -> None:
        try:
            object.__setattr__(self, "policy", Policy(policy))
        except ValueError:
            raise ValueError(f"{policy!r}: a policy is one of 'required', 'optional', "
                             "'ignored'") from None
        object.__setattr__(self, "fingerprint_fields",
                           _field_paths(fingerprint_fields, "fingerprint_fields"))
        object.__setattr__(self, "fingerprint_exclude",
                           _field_paths(fingerprint_exclude, "fingerprint_exclude") or ())
        if lease is not None:
            seconds = lease.total_seconds() if isinstance(lease, timedelta) else float(lease)
            if not seconds > 0:
                raise ValueError("lease must be more than 0 seconds")
        object.__setattr__(self, "lease", lease)

    @classmethod
    def of(cls, value: Route | Policy | str | Mapping[str, Any]) -> Route:
        """A Route from what a configuration gives: a Route, a policy, or a mapping of
        Route's arguments (Django settings: ``{"policy": "required", "fingerprint_exclude":
        ["sent_at"], "lease": 60}``)."""
        if isinstance(value, Route):
            return value
        if isinstance(value, Mapping):
            return cls(**value)
        return cls(value)

    def lease_of(self, settings: Settings) -> timedelta | float:
        return settings.lease if self.lease is None else self.lease

    def body_for_fingerprint(self, body: Any) -> Any:
        """The part of a parsed JSON body the fingerprint covers."""
        if not isinstance(body, Mapping) or (self.fingerprint_fields is None
                                             and not self.fingerprint_exclude):
            return body
        if self.fingerprint_fields is not None:
            kept: dict[str, Any] = {}
            for path in self.fingerprint_fields:
                _copy_path(body, kept, path)
            body = kept
        for path in self.fingerprint_exclude:
            body = _without_path(body, path)
        return body


def _copy_path(source: Mapping[str, Any], target: dict[str, Any], path: tuple[str, ...]) -> None:
    head, rest = path[0], path[1:]
    if head not in source:
        return
    if not rest:
        target[head] = source[head]
    elif isinstance(source[head], Mapping):
        inner = target.setdefault(head, {})
        if isinstance(inner, dict):
            _copy_path(source[head], inner, rest)


def _without_path(source: Mapping[str, Any], path: tuple[str, ...]) -> Mapping[str, Any]:
    head, rest = path[0], path[1:]
    if head not in source:
        return source
    if not rest:
        return {k: v for k, v in source.items() if k != head}
    if not isinstance(source[head], Mapping):
        return source
    return {**source, head: _without_path(source[head], rest)}


class Routes:
    """``{"POST /payments": Policy.REQUIRED, "POST /orders/{id}/refunds": "optional",
    "POST /transfers": Route("required", fingerprint_exclude=["sent_at"], lease=120)}``
    (``{name}`` matches one path segment; a value is a :class:`Route`, a policy, or a mapping
    of Route's arguments). A route not listed gets ``default`` (IGNORED): keyed routes are
    named, so that no endpoint is idempotent by accident of a header."""

    def __init__(self, routes: Mapping[str, Route | Policy | str | Mapping[str, Any]]
                 | None = None, default: Policy | str | Route = Policy.IGNORED) -> None:
        self.default_route = Route.of(default)
        self.default = self.default_route.policy
        self._routes = [(_route_regex(pattern), Route.of(route))
                        for pattern, route in (routes or {}).items()]

    def route(self, method: str, path: str) -> Route:
        for regex, route in self._routes:
            if regex.fullmatch(f"{method} {path}"):
                return route
        return self.default_route

    def policy(self, method: str, path: str) -> Policy:
        return self.route(method, path).policy
