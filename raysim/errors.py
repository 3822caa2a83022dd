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


SHOWN_CHARS = 300  # the most characters of a user's value an error message repeats (a long file path fits whole)


def shown(value: object, limit: int = SHOWN_CHARS) -> str:
    """`repr(value)` for an error message, at most about `limit` characters: a 10 MB string or a list of a
    million items given as a config value is named, never echoed whole. The repr itself is bounded work
    (reprlib: the first few items of a container, a few levels deep, the head of a long string)."""
    import reprlib

    r = reprlib.Repr()
    r.maxlevel, r.maxtuple, r.maxlist, r.maxarray, r.maxdict, r.maxset, r.maxfrozenset, r.maxdeque = 3, 6, 6, 6, 6, 6, 6, 6
    r.maxstring, r.maxlong, r.maxother = limit, 40, limit
    try:
        text = r.repr(value)
    except (ValueError, RecursionError, TypeError):  # an integer of more digits than int->str allows, an odd object
        return f"<a {type(value).__name__} too large to show>"
    if isinstance(value, (str, bytes)) and len(value) > limit:
        # head and tail: a too-long path still shows where it starts and the file name it ends with
        keep = (limit - 40) // 2
        text = f"{value[:keep]!r}...{value[-keep:]!r} ({len(value):,} characters)"
    elif isinstance(value, (list, tuple, dict, set)) and len(value) > limit:
        text = f"{text[: limit - 24]} ({len(value):,} items)"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def one_line(text: str, limit: int = 300) -> str:
    """`text` (a library's message, perhaps of several lines) as one line of at most `limit` characters."""
    flat = " ".join(text[: 4 * limit].split())
    return flat if len(flat) <= limit else flat[: limit - 3] + "..."


def os_error_line(e: OSError, where: str = "", resume: str = "", *, again: bool = False) -> str:
    """One line for an OSError at the edge: the path, what went wrong, what to do (`resume`: the out_dir
    a run can be continued from once the cause is fixed; `again`: nothing was kept, run the command again)."""
    import errno

    path = e.filename or where or "a file"
    what = e.strerror or type(e).__name__
    then = f", then continue with output.resume={resume}" if resume else ", then run the command again" if again else ""
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
