"""Where a P/D request's time goes inside vLLM: the scheduler hooks' moments, for one request.

With ``"timeline": FILE`` in ``kv_connector_extra_config`` the scheduler side appends one JSON
line per moment to FILE: ``{"at": unix seconds, "engine", "request", "handoff", "event"}``.
The handoff id joins P's lines with D's (and with the proxy's or client's own clock, on the same
host). Off by default; when off every hook pays one ``if``.

The moments, in the order one request meets them:

P:
* ``arrived``: vLLM's scheduler first saw a request that prefills for a remote D;
* ``forwarded``: (push, streamed) the step that completes the prompt was built: its writes go
  out layer by layer during that step's forward pass;
* ``prefilled``: vLLM named it finished (prompt computed, first token sampled); in pull the
  blocks are kept for D from here, and the response leaves for the proxy.

D:
* ``arrived``: vLLM's scheduler first saw the request with P's params;
* ``allocated``: vLLM gave it blocks (the claim, or the push registration, leaves now);
* ``landed``: the connector tells vLLM its KV is in (every READ or WRITE ended, the digest
  checked when on): the request may be scheduled from the next step on;
* ``scheduled``: the first step that computes for it was built (the prompt's last token, then
  the first output token follows that step's forward pass).

The benchmark of the vLLM suite (``test_zz_ttft_bench.py``) turns these into the phases of a
P/D TTFT. A line is written as it happens (line-buffered); the file is opened once.
"""

from __future__ import annotations

import json
import time
from typing import Any


class Timeline:
    """Appends moments to a file, or does nothing when no file was named."""

    def __init__(self, path: str | None, engine: str):
        self._file = open(path, "a", buffering=1) if path else None
        self._engine = engine
        # D: requests that landed and were not yet scheduled (their first step is the next
        # moment); request -> handoff id for every request with a line still to come.
        self._landed: set[str] = set()
        self._handoff: dict[str, str | None] = {}

    @property
    def on(self) -> bool:
        return self._file is not None

    def mark(self, request: str, event: str, handoff: str | None = None) -> None:
        if self._file is None:
            return
        if handoff is not None:
            self._handoff[request] = handoff
        line = {"at": time.time(), "engine": self._engine, "request": request,
                "handoff": handoff or self._handoff.get(request), "event": event}
        self._file.write(json.dumps(line) + "\n")

    def arrived(self, request: str, handoff: str | None) -> None:
        """The first time vLLM's scheduler asks about a request (it asks again every step while
        the request waits)."""
        if self._file is not None and request not in self._handoff:
            self._handoff[request] = handoff
            self.mark(request, "arrived")

    def landed(self, requests: list[str]) -> None:
        if self._file is None:
            return
        for r in requests:
            self.mark(r, "landed")
            self._landed.add(r)

    def scheduled(self, scheduler_output: Any) -> None:
        """D: the landed requests this step computes for (vLLM schedules a request whose KV
        arrived as a new one)."""
        if self._file is None or not self._landed:
            return
        for new in scheduler_output.scheduled_new_reqs:
            if new.req_id in self._landed:
                self._landed.discard(new.req_id)
                self.mark(new.req_id, "scheduled")

    def forget(self, request: str) -> None:
        self._landed.discard(request)
        self._handoff.pop(request, None)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
