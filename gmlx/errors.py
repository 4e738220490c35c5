"""Errors users can act on. The CLI turns any GmlxError into one line and exit code 1."""


class GmlxError(Exception):
    """Base class: the message is shown to the user as is, so it says what to do."""


class InvalidRequest(GmlxError, ValueError):
    """A prompt or sampling parameter is out of range; raised before any engine state changes."""


class ModelLoadError(GmlxError):
    """A model directory is missing, incomplete or of an unsupported kind."""


class NoDrafterError(GmlxError):
    """Speculation was asked for explicitly, but the model has no drafter."""


class ConfigError(GmlxError):
    """An environment switch or config file value is invalid."""


class EngineClosed(GmlxError):
    """The engine was closed; create a new one."""


class Overloaded(GmlxError):
    """The engine's request queue is full; retry later or raise the queue bound."""


class EngineBusy(GmlxError):
    """step() was called while the engine thread drives the engine."""


class LaunchError(GmlxError):
    """A distributed run was set up wrongly: no launcher, a model that cannot shard, a width the
    model's head count does not divide, ranks that loaded different models."""


class ReplicaDivergence(GmlxError):
    """The ranks of a distributed engine no longer hold the same state (a bug, never a user error)."""
