"""DataError: every data-pipeline failure, as one line naming the bad value and the way out."""


class DataError(ValueError):
    """A missing, corrupt or mismatched source, prepared dir, shard or loader state."""
