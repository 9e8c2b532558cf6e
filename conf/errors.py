"""The one exception a bad config raises, shared by conf/validate.py and the plug-ins' own checks
(model families in models/<family>/, objectives in objectives/)."""


class ConfigError(ValueError):
    """A config value that cannot run; the message starts with the key, e.g. `model.num_heads: ...`."""

    def __init__(self, key: str, message: str):
        super().__init__(f"{key}: {message}")
        self.key = key


def require(ok: bool, key: str, message: str) -> None:
    if not ok:
        raise ConfigError(key, message)
