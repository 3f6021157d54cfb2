"""vLLM's request states that HandoffConnector reads."""

import enum


class RequestStatus(enum.IntEnum):
    RUNNING = 2
    FINISHED_STOPPED = 6
    FINISHED_LENGTH_CAPPED = 7
    FINISHED_ABORTED = 8
