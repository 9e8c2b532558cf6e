"""The one exception the data pipeline raises for bad inputs or settings, and the disk-full case as one."""
import errno
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from base.errors import UserError

_NO_SPACE = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


class DataError(UserError, ValueError):
    """A data problem the user can fix; the message names the file or config key and the fix."""


@contextmanager
def writing(where: Path, what: str = "it") -> Iterator[None]:
    """Turn a full disk (or quota, or file-size limit) met while writing `what` under `where` into a DataError
    naming them. MindRecord's writer says it with a RuntimeError of its own ("No free disk to be used ...")."""
    try:
        yield
    except (OSError, RuntimeError) as e:
        full = e.errno in _NO_SPACE if isinstance(e, OSError) else "No free disk" in str(e)
        if not full:
            raise
        reason = e.strerror if isinstance(e, OSError) else "no space left on device"
        raise DataError(f"{where}: cannot write {what} ({reason}); free space there or point data.cache_dir at a "
                        f"larger disk, then run prepare again: the work already finished is kept") from e
