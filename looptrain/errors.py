"""`ConfigError`, the error of an invalid strategy or loop option, in a module that imports nothing of looptrain's
(so the levers' implementations, `looptrain.lora` among them, can raise it without importing `looptrain.strategy`)."""


class ConfigError(ValueError):
    """An invalid `LoopConfig` or `Strategy` value or combination; the message names the fields."""


__all__ = ["ConfigError"]
