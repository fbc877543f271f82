class EvalkitError(Exception):
    """A problem with the user's input or environment: the CLI prints one line and exits with 2."""
