"""``sglang-morph top``: poll a running server and redraw ``view.render`` of each poll.

One poll reads ``/elastic/status`` (which mechanisms run), then each running mechanism's own
status route and SGLang's ``/v1/loads`` (the queue) at once. A route that fails once the view is up shows
as a red line in the frame and the view keeps polling (a server that restarts comes back on
screen); a first poll that reaches nothing is the command's error.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

from rich.console import Console
from rich.live import Live

from sglang_morph.console.client import Client, ServerError
from sglang_morph.console.view import MECHANISM_ROUTES, Frame, render

LOADS_ROUTE = "/v1/loads?include=core"
# /elastic/status answers 503 on a server without any mechanism: the view then shows the
# queue alone rather than an error.
NO_MECHANISM_STATUS = 503


def poll(client: Client, clock: Callable[[], float] = time.time, strict: bool = False) -> Frame:
    """One frame of the server behind ``client``. ServerError when the server was not reached
    or, with ``strict``, when ``/elastic/status`` failed (other than for having no
    mechanism); otherwise a failed route is one of the frame's errors."""
    errors: dict[str, str] = {}
    elastic = None
    try:
        elastic = client.get("/elastic/status")
    except ServerError as e:
        if e.status_code is None or (strict and e.status_code != NO_MECHANISM_STATUS):
            raise  # unreachable (the other routes would not answer either), or a wrong key
        if e.status_code != NO_MECHANISM_STATUS:
            errors["/elastic/status"] = str(e)
    # The mechanisms' routes and the queue's are independent: asked at once, a poll costs two
    # round trips however many mechanisms run (a frame lags a change by one interval plus
    # one poll, and a busy server answers each route slowly).
    routes = {name: MECHANISM_ROUTES[name] for name in (elastic or {}).get("mechanisms") or []
              if name in MECHANISM_ROUTES}
    with ThreadPoolExecutor(max_workers=len(routes) + 1) as pool:
        pending = {name: pool.submit(client.get, route) for name, route in routes.items()}
        pending_loads = pool.submit(client.get, LOADS_ROUTE)
    mechanisms = {}
    for name, future in pending.items():
        try:
            mechanisms[name] = future.result()
        except ServerError as e:
            errors[routes[name]] = str(e)
    loads = None
    try:
        loads = pending_loads.result()
    except ServerError as e:
        errors["/v1/loads"] = str(e)
    return Frame(url=client.base_url, time_unix_s=clock(), elastic=elastic,
                 mechanisms=mechanisms, loads=loads, errors=errors)


def _poll_or_error_frame(client: Client) -> Frame:
    try:
        return poll(client)
    except ServerError as e:
        return Frame(url=client.base_url, time_unix_s=time.time(), errors={"server": str(e)})


def run(client: Client, interval_s: float, once: bool, console: Console | None = None,
        transitions_shown: int = 8) -> None:
    """Print one frame (``once``) or redraw one every ``interval_s`` until Ctrl-C.

    The first poll raises ServerError when the server cannot be reached or refuses the
    status route (a wrong key, say); later ones show such errors in the frame."""
    console = console or Console()
    frame = poll(client, strict=True)
    if once:
        console.print(render(frame, transitions_shown))
        return
    # screen=True: the alternate screen, like top; the terminal is restored on exit.
    with Live(render(frame, transitions_shown), console=console, screen=True,
              auto_refresh=False, vertical_overflow="crop") as live:
        try:
            next_s = time.monotonic()
            while True:
                # A poll slower than the interval starts the next one at once, without
                # queueing up missed ones.
                now = time.monotonic()
                next_s = max(next_s + interval_s, now)
                time.sleep(next_s - now)
                live.update(render(_poll_or_error_frame(client), transitions_shown),
                            refresh=True)
        except KeyboardInterrupt:
            pass
