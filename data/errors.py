"""The one exception the data pipeline raises for bad inputs or settings."""
from base.errors import UserError


class DataError(UserError, ValueError):
    """A data problem the user can fix; the message names the file or config key and the fix."""
