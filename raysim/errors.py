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
