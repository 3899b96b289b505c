"""The one tree of domain errors; each dialect maps it, once, to its own error shape at the edge.

TrajproxyError
├── BadRequest          the input is malformed or invalid
│   ├── PayloadTooLarge the body is over the configured limit
│   └── BodyStalled     the body stopped arriving before it was whole
├── Unauthorized        unknown episode key or bad trainer token
├── Forbidden           the caller may not use this route this way
├── NotFound            no such episode, turn or route
├── Conflict            the request contradicts what is recorded
│   └── TurnClosed      the turn can no longer be answered (answered, expired, abandoned, failed)
├── EpisodeClosed       the episode is finished, failed or cancelled
├── Paused              new calls are refused while the trainer updates its policy
├── OverBudget          the episode has used its turns, tokens or time
├── Busy                the episode has as many of these calls running as it may: retry in a moment
├── TurnTimeout         nobody answered the turn within its timeout
├── NoTurnYet           the agent made no call within the time a trainer would wait
├── StorageError        the database could not record a change
│   └── Stale           another replica recorded first (shared mode): reload, then try again
└── UpstreamError       a model answering in the trainer's place failed
    └── ContextFull     the conversation is longer than the model's context (the server's 400): not the server's fault
"""


class TrajproxyError(Exception):
    """Base of every error trajproxy reports to a client; `kind` is a stable machine-readable name."""

    kind = "error"

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class BadRequest(TrajproxyError):
    kind = "invalid_request_error"


class PayloadTooLarge(BadRequest):
    kind = "request_too_large"


class BodyStalled(BadRequest):
    kind = "request_timeout"


class Unauthorized(TrajproxyError):
    kind = "authentication_error"


class Forbidden(TrajproxyError):
    kind = "permission_error"


class NotFound(TrajproxyError):
    kind = "not_found_error"


class Conflict(TrajproxyError):
    kind = "conflict_error"


class TurnClosed(Conflict):
    kind = "turn_closed"


class EpisodeClosed(TrajproxyError):
    kind = "episode_closed"


class Paused(TrajproxyError):
    kind = "rate_limit_error"

    def __init__(self, message: str, retry_after_s: float) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class OverBudget(TrajproxyError):
    kind = "budget_exceeded"


class NoTurnYet(TrajproxyError):
    kind = "no_turn_yet"


class Busy(TrajproxyError):
    kind = "rate_limit_error"


class TurnTimeout(TrajproxyError):
    kind = "timeout_error"


class StorageError(TrajproxyError):
    kind = "storage_error"


class Stale(StorageError):
    kind = "storage_error"


class UpstreamError(TrajproxyError):
    kind = "upstream_error"


class ContextFull(UpstreamError):
    kind = "context_length_exceeded"  # OpenAI's code for it
