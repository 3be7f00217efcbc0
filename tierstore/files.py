"""Files in directories other people may write to: never write through a link, never trust a name blindly.

Every file tierstore (and the runtime's checkpoint writer) creates in a directory it was given goes through
:func:`create_new`: the file is created with ``O_CREAT|O_EXCL|O_NOFOLLOW``, so a symlink (or any file)
planted at that name makes the open fail instead of sending our bytes into someone else's file.
(Benchmark scratch files, which ``dd`` opens by name, live in private 0700 subdirectories instead.) The only file reopened by name is a lock
file (:func:`lock_file`): opened with ``O_NOFOLLOW`` and checked to be a plain file of ours with one link,
so neither a symlink nor a hard link to a victim can be truncated by it.

What this module leaves to callers: holding the directory's lock before :func:`create_new` is asked to
replace a leftover (only the lock holder may decide that a name is stale), and refusing directories that
:func:`shared_directory_problem` reports.
"""

from __future__ import annotations

import errno
import fcntl
import os
import stat

from tierstore.errors import DirectoryLockedError

_CLOEXEC = getattr(os, "O_CLOEXEC", 0)


def create_new(name: str | os.PathLike[str], *, dir_fd: int | None = None, flags: int = os.O_RDWR, mode: int = 0o600,
               replace_stale: bool = False) -> int:
    """Create ``name`` as a new file and return its descriptor; the file must not exist, not even as a link.

    ``replace_stale``: a file already at that name (a leftover of a killed run, or a planted link) is
    unlinked first -- unlinking a symlink removes the link, never its target -- and the create is retried
    once; a second clash (someone racing us) is an error. Only a caller holding the directory's lock may
    pass it. ``mode`` is applied with fchmod too, so a permissive umask cannot widen it."""
    open_flags = flags | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | _CLOEXEC
    try:
        fd = os.open(name, open_flags, mode, dir_fd=dir_fd)
    except FileExistsError:
        if not replace_stale:
            raise
        os.unlink(name, dir_fd=dir_fd)
        fd = os.open(name, open_flags, mode, dir_fd=dir_fd)
    try:
        os.fchmod(fd, mode)
    except OSError:
        os.close(fd)
        raise
    return fd


def unlink_lock_file(name: str | os.PathLike[str], fd: int, *, dir_fd: int | None = None) -> None:
    """Let go of a lock taken with :func:`lock_file` and remove its file, so the directory is left as found: the
    file is unlinked while the lock is still held (a run opening it meanwhile fails to lock it, and one that
    locks it after finds it unlinked: :func:`lock_file`'s check), then the lock is released."""
    try:
        os.unlink(name, dir_fd=dir_fd)
    except FileNotFoundError:
        pass  # removed by hand: nothing to leave behind
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)


def lock_file(name: str | os.PathLike[str], what: str, hint: str, *, dir_fd: int | None = None) -> int:
    """Open (creating, mode 0600) the lock file ``name`` and take an exclusive flock on it without waiting.

    Returns the descriptor; the lock lasts until it is closed (or the process dies: the kernel releases
    it, so a killed holder never leaves a directory locked). The holder's pid is written into the file for
    the message a second process gets. Raises DirectoryLockedError naming ``what`` and ``hint`` (what to
    change) when another open file holds it -- another process, or another store in this one. A lock
    file that is not a plain file owned by us with exactly one link is refused: truncating it would
    damage the file it is linked to."""
    try:
        fd = os.open(name, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | _CLOEXEC, 0o600, dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno != errno.ELOOP:
            raise
        raise DirectoryLockedError(f"{what}: its lock file {os.fsdecode(name)} is a symbolic link (planted by someone?); "
                                   f"it is never opened through a link. Remove it. {hint}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1 or st.st_uid != os.geteuid():
            raise DirectoryLockedError(f"{what}: its lock file {os.fsdecode(name)} is not a plain file of this user with one "
                                       f"link (uid {st.st_uid}, {st.st_nlink} links); remove it. {hint}")
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
            if holder == f"{os.getpid()} {os.uname().nodename}":  # a notebook re-running a cell after an exception
                raise DirectoryLockedError(
                    f"{what} is held by an object of this same process (pid {holder}) that was never closed: close "
                    f"it first (a training session: `optimizer.session.close()`), or restart the interpreter. {hint}") from None
            raise DirectoryLockedError(f"{what} is in use by another run (pid {holder}). {hint}") from None
        # The holder unlinks the file as it lets go (unlink_lock_file): a lock taken on a file already unlinked
        # from that name would let a second run lock the new file beside us, so the locked file must be the one
        # the name points to now.
        now = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        if (now.st_dev, now.st_ino) != (st.st_dev, st.st_ino):
            raise DirectoryLockedError(f"{what} was being released by another run as this one took it; try again. {hint}")
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()} {os.uname().nodename}".encode(), 0)
    except BaseException:
        os.close(fd)
        raise
    return fd


def shared_directory_problem(st: os.stat_result) -> str | None:
    """Why a directory with this stat is not private enough to hold our files, or None when it is.

    Another user who can write to a directory can plant links or squat on the names we create (the sticky
    bit does not stop that), so it must be ours and writable by nobody else. Group-writable counts: a
    project's shared 2775 scratch directory is exactly where a colleague's mistake or attack lands."""
    if not stat.S_ISDIR(st.st_mode):
        return "is not a directory"
    if st.st_uid != os.geteuid():
        return f"belongs to uid {st.st_uid}, not to this user (uid {os.geteuid()})"
    mode = stat.S_IMODE(st.st_mode)
    if mode & (stat.S_IWGRP | stat.S_IWOTH):
        who = "every user" if mode & stat.S_IWOTH else "its group"
        return f"is writable by {who} (mode {mode:04o})"
    return None

