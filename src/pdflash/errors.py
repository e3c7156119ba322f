"""Exception types users see. Every message names what was wrong, the value seen and what is valid."""


class CheckpointError(ValueError):
    """A checkpoint directory, config or tensor file cannot be used (names the file and value)."""


class ContextLimitError(ValueError):
    """A prompt (plus the tokens it asks for) does not fit in the model's context."""


class EngineOverloadedError(RuntimeError):
    """The waiting queue is full: the request was not queued (retry later)."""


class EngineClosedError(RuntimeError):
    """The engine is not running (outside `async with`, or after it exited)."""
