"""Errors a user can act on. The front doors turn these into one clear message and exit code 2."""


class RaysimError(Exception):
    """Base class for errors that carry a message meant for the user."""


class ConfigError(RaysimError, ValueError):
    """A configuration value is unknown, out of range, or inconsistent."""


class DataError(RaysimError):
    """A dataset is missing or malformed on disk."""


class PrivacyBudgetExceeded(RaysimError):
    """A release would take a client past its privacy budget."""


class UploadViolation(RaysimError):
    """A client tried to send something the method did not declare as shared."""


class CheckpointError(DataError):
    """A checkpoint under a run folder is truncated, corrupted, or holds objects that are not plain data."""


class RunFolderLocked(ConfigError):
    """Another live process is writing the run folder (out_dir)."""
class ClientFailure(RaysimError):
    """A client's local training failed (it raised, uploaded a non-finite tensor, or ran past
    client_timeout) and the run's on_client_error / min_clients policy stops the run."""

    def __init__(self, message: str, *, client_id: int | None = None, round_idx: int | None = None, error: str = "") -> None:
        super().__init__(message)
        self.client_id = client_id
        self.round_idx = round_idx
        self.error = error
