"""Private by default: every folder the launcher or the job creates is 0700 and every file 0600, whatever the umask.

The submitit pickles in a run folder are code that the compute nodes execute, and config.yaml is re-read on every
requeue, so nobody else may write (or read) them. ``private_umask`` sets the process-wide umask 077 (the CLI, the
Slurm task and ``megatron_rl.main`` call it first, so torch's checkpoint writes and Slurm's log files follow it);
``make_private_dir`` and ``write_private_text`` set the modes explicitly and never follow a symlink.
``check_run_dir`` refuses a run folder that someone else could write.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from megatron_rl.spec.errors import ConfigError

PRIVATE_UMASK = 0o077
DIR_MODE = 0o700
FILE_MODE = 0o600


def private_umask() -> None:
    """Make every file this process (and its children) creates private: umask 077."""
    os.umask(PRIVATE_UMASK)


def check_run_dir(path: Path, *, key: str = "run.dir") -> None:
    """Refuse ``path`` as a run folder when it is a symlink or a file, or an existing folder that is not the user's
    or that the group or others can write. A folder that does not exist yet is fine (it is created 0700)."""
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return
    if stat.S_ISLNK(info.st_mode):
        raise ConfigError(f"{key}={path} is a symlink; give the real folder ({os.path.realpath(path)}) instead, "
                          "the launcher does not write through symlinks")
    if not stat.S_ISDIR(info.st_mode):
        raise ConfigError(f"{key}={path} is a file, not a folder; give another {key}")
    if info.st_uid != os.getuid():
        raise ConfigError(f"{key}={path} belongs to another user (uid {info.st_uid}); give a folder of your own")
    if info.st_mode & 0o022:
        raise ConfigError(f"{key}={path} can be written by others (mode {stat.S_IMODE(info.st_mode):04o}), who "
                          f"could replace the job's config or pickles; run `chmod 700 {path}` or give another {key}")


def make_private_dir(path: Path) -> Path:
    """Create ``path`` and its missing parents as 0700 folders; an existing ``path`` must be a real folder (not a
    symlink). Returns ``path``."""
    path = Path(path)
    missing = []
    probe = path
    while not os.path.lexists(probe):
        missing.append(probe)
        probe = probe.parent
    for folder in reversed(missing):
        try:
            os.mkdir(folder, DIR_MODE)
        except FileExistsError:  # made meanwhile by another process
            pass
        os.chmod(folder, DIR_MODE, follow_symlinks=False)
    if os.path.islink(path):
        raise ConfigError(f"{path} is a symlink; the launcher does not write through symlinks (remove it)")
    if not path.is_dir():
        raise ConfigError(f"{path} is a file, not a folder; remove it or choose another run.dir")
    return path


def open_private(path: Path, flags: int) -> int:
    """``os.open`` of ``path`` as a private file (0600) that is not a symlink; returns the descriptor."""
    try:
        fd = os.open(path, flags | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, FILE_MODE)
    except OSError as exc:
        if os.path.islink(path):
            raise ConfigError(f"{path} is a symlink; the launcher does not write through symlinks (remove it)") \
                from None
        raise ConfigError(f"cannot write {path} ({exc.strerror}); check the folder and its permissions") from None
    os.fchmod(fd, FILE_MODE)
    return fd


def write_private_text(path: Path, text: str) -> Path:
    """Write ``text`` to ``path`` as a 0600 file, atomically (a temporary file renamed over it); a symlink at
    ``path`` is refused, never followed. Returns ``path``."""
    path = Path(path)
    if os.path.islink(path):
        raise ConfigError(f"{path} is a symlink; the launcher does not write through symlinks (remove it)")
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.unlink(missing_ok=True)  # left by a killed earlier process of the same pid
    fd = open_private(tmp, os.O_WRONLY | os.O_TRUNC | os.O_EXCL)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


def open_private_append(path: Path):
    """A binary append handle on the private (0600, not a symlink) file ``path``."""
    return os.fdopen(open_private(Path(path), os.O_WRONLY | os.O_APPEND), "ab")
