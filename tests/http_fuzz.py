"""Seeded random JSON bodies for the HTTP surface's fuzz tests (hypothesis): any JSON shape, or
an object of a route's fields with near-valid and arbitrary values. Every answer must be below
500; each test then checks the server's state."""

from __future__ import annotations

import json
from typing import Any, Callable, Mapping

import requests
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

LEAF = (st.none() | st.booleans() | st.integers(-2**40, 2**40) | st.text(max_size=12)
        | st.floats(allow_nan=True))
JSON = st.recursive(LEAF, lambda inner: st.lists(inner, max_size=4)
                    | st.dictionaries(st.text(max_size=8), inner, max_size=4), max_leaves=10)
# Small values for lengths: a valid request must not decode for minutes.
SMALL = st.integers(-3, 3) | st.text(max_size=3) | st.floats(allow_nan=False) | st.booleans()
REPLICA_LISTS = st.lists(st.integers(-1, 4), max_size=4) | JSON


def bodies(fields: Mapping[str, Mapping[str, Any]], required: Mapping[str, tuple] = (),
           any_shape: tuple[str, ...] = ()) -> Any:
    """(route, body): an object of the route's ``fields`` (``required`` ones always present),
    or for the routes in ``any_shape`` also any JSON value."""
    required = dict(required or {})

    def of(route: str) -> Any:
        need = {k: v for k, v in fields[route].items() if k in required.get(route, ())}
        rest = {k: v for k, v in fields[route].items() if k not in need}
        objects = st.fixed_dictionaries(need, optional=rest)
        return objects | JSON if route in any_shape else objects

    return st.sampled_from(sorted(fields)).flatmap(lambda r: st.tuples(st.just(r), of(r)))


def fuzz(url: str, cases: Any, headers_of: Callable[[str], dict], examples: int
         ) -> list[tuple[str, int]]:
    """Send ``examples`` cases (seeded); every answer below 500. Returns (route, status)."""
    answers: list[tuple[str, int]] = []

    @settings(max_examples=examples, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(cases)
    def send(case):
        route, body = case
        # json.dumps writes NaN and Infinity, which strict JSON parsers refuse: fuzz too.
        r = requests.post(f"{url}{route}", data=json.dumps(body), timeout=300, headers={
            **headers_of(route), "Content-Type": "application/json"})
        answers.append((route, r.status_code))
        assert r.status_code < 500, (route, body, r.status_code, r.text[:300])

    send()
    assert requests.get(f"{url}/health", timeout=60).status_code == 200
    return answers
