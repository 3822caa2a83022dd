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


def os_error_line(e: OSError, where: str = "", resume: str = "") -> str:
    """One line for an OSError at the edge: the path, what went wrong, what to do (`resume`: the out_dir
    a run can be continued from once the cause is fixed)."""
    import errno

    path = e.filename or where or "a file"
    what = e.strerror or type(e).__name__
    then = f", then continue with output.resume={resume}" if resume else ""
    advice = {
        errno.ENOSPC: f"the disk is full: free some space{then}",
        errno.EDQUOT: f"the disk quota is used up: free some space{then}",
        errno.EROFS: "the file system is read-only: choose another output.out_dir",
        errno.EACCES: "permission denied: choose a folder you can write, or fix its permissions",
        errno.EPERM: "permission denied: choose a folder you can write, or fix its permissions",
        errno.ENAMETOOLONG: "the name is too long: choose a shorter path",
        errno.ENOTDIR: "a part of the path is a file, not a folder: choose another path",
        errno.EISDIR: "it is a folder where a file was expected: pass the file",
        errno.ENOENT: "it does not exist: check the path",
    }.get(e.errno or -1, f"check the path and the disk{then}")
    return f"{path}: {what}; {advice}"


class ClientFailure(RaysimError):
    """A client's local training failed (it raised, uploaded a non-finite tensor, or ran past
    client_timeout) and the run's on_client_error / min_clients policy stops the run."""

    def __init__(self, message: str, *, client_id: int | None = None, round_idx: int | None = None, error: str = "") -> None:
        super().__init__(message)
        self.client_id = client_id
        self.round_idx = round_idx
        self.error = error
