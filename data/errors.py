"""The one exception the data pipeline raises for bad inputs or settings."""


class DataError(ValueError):
    """A data problem the user can fix; the message names the file or config key and the fix."""
