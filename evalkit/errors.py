class EvalkitError(Exception):
    """A problem with the user's input or environment: the CLI prints one line and exits with 2."""


class WriteFailed(EvalkitError):
    """Results could not be written (a full disk, mostly): a fault of the machine during a run, not bad
    input, so the CLI exits with 1; what was recorded before stays, and the same command resumes."""

    exit_code = 1
