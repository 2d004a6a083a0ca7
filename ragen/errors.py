"""Errors a user can cause and fix, shared by every layer (no imports: any module may raise them)."""


class ConfigError(ValueError):
    """A user mistake in the configuration (unknown key, wrong type, impossible value)."""
