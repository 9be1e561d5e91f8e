"""Folders and files written whole or not at all.

Each is made under a temporary name beside its destination and moved into place only when complete,
so a failed or interrupted write never leaves a half model folder that would later load, nor a good
file half-overwritten.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import glob
import os
import shutil
import socket
import sys
import tempfile
import time
from pathlib import Path

from .errors import AlreadyExists, UserError, unpaired_surrogate
from .platform import cache_home, signals_held


@contextlib.contextmanager
def atomic_folder(dest: str | Path, force: bool = False):
    """Yield a temporary folder; on success it replaces `dest`, on failure it disappears."""
    dest = Path(dest).expanduser()
    check_utf8_name(dest)
    if Path.cwd().resolve().is_relative_to(dest.resolve()):
        raise UserError(f"{dest} is the current folder or holds it: give the name of a new folder")
    try:
        if dest.parent.is_dir():  # (a swap cut short is undone before `dest` is looked at)
            _clear_leftovers(dest)
    except OSError as e:
        raise UserError(f"cannot write {dest}: {e.strerror}") from None
    if _there(dest) and not force:
        raise AlreadyExists(f"{dest} already exists (pass --force to replace it)")
    if dest.exists() and not (dest.is_dir() or dest.is_file()):  # (/dev/null, a pipe: never replaced)
        raise UserError(f"cannot write {dest}: it is not a regular file or folder")
    above = next((p for p in dest.parents if _there(p)), None)
    if above is not None and not above.is_dir():  # (mkdir's error says "File exists")
        raise UserError(f"cannot write {dest}: {above} is a file, not a folder")
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=_partial(dest), dir=dest.parent))
    except OSError as e:  # (its own error names the folder above, or the temporary one)
        raise UserError(f"cannot write {dest}: {e.strerror}") from None
    try:
        yield tmp
        tmp.chmod(0o755)  # mkdtemp makes it private
        if _there(dest) and not force:  # (another process wrote it meanwhile: its work stays)
            raise AlreadyExists(f"{dest} was written meanwhile by another process (--force replaces it)")
        if _there(dest):
            old = moved_aside(dest)
            _remove(old)
            dest.rename(old)
            try:
                tmp.rename(dest)
            except BaseException:
                old.rename(dest)  # put the good folder back
                raise
            _remove_after_all(old)
        else:
            tmp.rename(dest)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if is_write_error(e):
            raise _no_room(dest, e) from None
        raise


def _there(path: Path) -> bool:
    """Something is at `path`: a link that leads nowhere too (a rename onto it would fail)."""
    return path.exists() or path.is_symlink()


@contextlib.contextmanager
def one_at_a_time(name: str, doing: str, refuse: str = ""):
    """Processes that make the same thing (`name`) take turns: an exclusive lock on a file of that name
    under the home's locks/ while the block runs. One that waits says so on stderr (`doing`: what the
    other is doing); with `refuse` (what to do instead), it is refused at once. Where no lock can be
    had (a read-only home, a network disk without locks), the block runs anyway."""
    lock = cache_home() / "locks" / name
    try:
        lock.parent.mkdir(parents=True, exist_ok=True)
        held = open(lock, "a")  # (closed below, which lets go of the lock)
    except OSError:
        held = None
    try:
        if held is not None:
            _take(held, doing, refuse)
        yield
    finally:
        if held is not None:
            held.close()


def _take(held, doing: str, refuse: str) -> None:
    try:
        for _ in range(20):  # (a second: a lock held only to read what is kept goes unsaid)
            try:
                return fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                time.sleep(0.05)
        if refuse:
            raise UserError(f"another process is {doing}: {refuse}")
        print(f"waiting for another process that is {doing} ...", file=sys.stderr, flush=True)
        fcntl.flock(held, fcntl.LOCK_EX)
    except OSError:  # (ENOLCK: an NFS home without its lock service)
        pass


def is_write_error(e: BaseException) -> bool:
    """A write that failed for want of room: the system's error, or MLX's (a RuntimeError "[write] ...",
    as its save functions raise)."""
    if isinstance(e, OSError):
        return e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
    return isinstance(e, RuntimeError) and str(e).startswith("[write]")


def _no_room(dest: Path, e: BaseException) -> UserError:
    reason = e.strerror if isinstance(e, OSError) else str(e).strip().rstrip(".")
    return UserError(f"cannot write {dest} ({reason}): is the disk full? Nothing was written")


def _partial(dest: Path) -> str:
    """The start of a temporary name beside `dest`: it names the writing process and its host, so that
    what a killed writer left (SIGKILL, a power cut: nothing runs to remove it) is known for stale."""
    return f".{dest.name}.partial-{os.getpid()}@{socket.gethostname()}-"


def _clear_leftovers(dest: Path) -> None:
    """Remove what writers of `dest` that are no longer running left beside it (another host's: a day
    on); a folder moved aside by a swap that was cut short goes back where `dest` is missing (it was
    whole), and is removed where the swap got as far as putting the new one in place."""
    old = moved_aside(dest)
    if old.exists() and not _there(dest):
        old.rename(dest)
    elif old.exists():
        _remove(old)
    start = f".{dest.name}.partial-"
    for stale in dest.parent.glob(glob.escape(start) + "*"):
        pid, _, writer = stale.name[len(start) :].partition("@")
        here = writer.startswith(f"{socket.gethostname()}-")
        if pid.isdigit() and (not _running(int(pid)) if here else _age(stale) > STALE):
            _remove(stale)


STALE = 86_400  # seconds after which another host's partial file is its killed writer's (hosts come and go)


def _age(path: Path) -> float:
    try:
        return time.time() - path.lstat().st_mtime
    except OSError:
        return 0.0


def moved_aside(dest: Path) -> Path:
    """Where a folder being replaced waits until its replacement is in place."""
    return dest.with_name(f".{dest.name}.old")


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # (another user's)
        return True
    return True


def check_utf8_name(path: Path, reading: bool = False) -> None:
    """MLX takes only UTF-8 paths (another name fails inside it with std::bad_cast, or reads as a
    damaged file): say so first."""
    if unpaired_surrogate(str(path)) is not None:  # (the name's stray bytes)
        shown = os.fsencode(path).decode("utf-8", "replace")
        doing, advice = ("read", "rename it") if reading else ("write", "give another")
        raise UserError(f"cannot {doing} {shown}: MLX needs a name in UTF-8, {advice}")


def folder_bytes(path: Path) -> int:
    """Bytes of the files under a folder."""
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def _remove_after_all(path: Path) -> None:
    """Remove what the new folder replaced. A Ctrl-C meanwhile (a model's old folder takes seconds to
    remove) is too late to stop the command, whose work is in place: it would leave the old folder half
    removed under a hidden name, and the command would say it was interrupted. So Ctrl-C, SIGTERM and
    SIGHUP wait for it, and are then dropped."""
    with signals_held(deliver=False):
        _remove(path)


def _remove(path: Path) -> None:
    """A folder or a file (what --force replaces may be either), if it is there."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


@contextlib.contextmanager
def atomic_file(dest: str | Path):
    """Yield a temporary path beside `dest`; on success it replaces `dest`, on failure it disappears.
    A link is written through (the file it names is replaced, the link kept), an existing file keeps
    its permissions, and what is not a regular file (a folder, a device) is refused, as is a name that
    ends in a slash (a folder's, which pathlib would drop)."""
    if str(dest).endswith(os.sep):
        raise UserError(f"cannot write {dest}: a name ending in {os.sep} is a folder's; give a file's name")
    dest = Path(dest).expanduser()
    check_utf8_name(dest)
    if dest.is_symlink():
        dest = dest.resolve()
    if dest.exists() and not dest.is_file():
        raise UserError(f"cannot write {dest}: it is {'a folder' if dest.is_dir() else 'not a regular file'}")
    if not dest.parent.is_dir():  # (mkstemp's error would name the temporary file)
        raise UserError(f"cannot write {dest}: there is no folder {dest.parent}")
    mode = dest.stat().st_mode & 0o7777 if dest.exists() else 0o644  # (mkstemp makes it private)
    try:
        _clear_leftovers(dest)
        fd, tmp = tempfile.mkstemp(prefix=_partial(dest), dir=dest.parent)
    except OSError as e:  # (its error is about the temporary file: "No such file" in /proc)
        raise UserError(f"cannot write {dest}: no file can be made in {dest.parent} ({e.strerror})") from None
    os.close(fd)
    try:
        yield Path(tmp)
        os.chmod(tmp, mode)
        os.replace(tmp, dest)
    except BaseException as e:
        Path(tmp).unlink(missing_ok=True)
        if is_write_error(e):
            raise _no_room(dest, e) from None
        raise


def check_writable(folder: str | Path, flag: str = "") -> None:
    """Fail now, in one line, where `folder` (given as `flag`) cannot be made or written (a read-only or
    mistyped place), rather than after a model loaded or hours of work; what this makes it removes again."""
    if not str(folder).strip():  # ("" is the current folder; blanks, a folder named by mistake)
        raise UserError(
            f"{flag} needs a folder's name" if flag else "the folder to write has no name: give one"
        )
    folder = Path(folder).expanduser()
    check_utf8_name(folder)
    named = f"{flag} {folder}".strip()
    if folder.exists() and not folder.is_dir():
        raise UserError(f"{named} is a file: give a folder")
    missing = [p for p in (folder, *folder.parents) if not p.exists()]
    try:
        folder.mkdir(parents=True, exist_ok=True)
        tempfile.TemporaryFile(dir=folder).close()
    except OSError as e:
        raise UserError(f"cannot write to {named} ({e.strerror or e}): give another folder") from None
    finally:
        for p in missing:  # (deepest first)
            with contextlib.suppress(OSError):
                p.rmdir()
