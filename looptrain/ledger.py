"""The output directory as a ledger: one run at a time, a run's identity, and what a new run may do there.

An output directory holds hours of a user's compute, so no run may destroy, mix into or silently
resume another run's state:

- `OutputDirLock`: a lock held for the whole run (an `flock` on `output_dir/.looptrain.lock`, which
  the kernel releases when the process dies, so a killed run leaves no live lock). A second run gets
  an error naming the PID that holds it; a lock file left by a dead process is taken over with a notice.
  A run that wrote nothing (refused, or failed before its first file) removes the lock file and the
  directories it created: no directory holding only a lock is left behind.
- `run.json`: the run's identity (what makes it the same run: the schedule, the seed, and whatever
  the caller adds, such as the model and data files and their hashes) and its status.
- `RunLedger.begin` decides, before anything is read or written: a fresh run into a directory that
  holds another run refuses (or with `overwrite` moves that run aside, never deleting it);
  `resume="auto"` continues only a run with the same identity, from its newest checkpoint that can
  be read; a finished run is reported as finished (`finished_run_summary`) and left alone; a checkpoint
  whose saved identity is another run's is refused wherever it sits; a run that saved nothing (no
  checkpoint, no final/, not finished) is no run to protect: a new run moves its files aside and starts.
  `run_file_owner` tells other commands which paths are a run's own files. The directory
  is asked once while its lock is held: the command line asks before it reads any data, and the Loop it
  then runs under the same lock is given that verdict.
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import json
import os
import socket
from collections.abc import Callable
from pathlib import Path
from typing import Any

from looptrain.checkpoint import list_checkpoints, resolve_resume_checkpoint, write_json_atomic
from looptrain.checkpoint.layout import CHECKPOINT_PREFIX, TRAINER_STATE_FILE
from looptrain.report import REPORT_FILE  # the run's picture
from looptrain.run_files import METRICS_FILE, read_json_object
from looptrain.trackers import STATE_FILE as TRACKERS_STATE_FILE

LOCK_FILE = ".looptrain.lock"
RUN_FILE = "run.json"
# What a run writes at the top of its output directory; their presence means a run lives there.
# (run_config.json is not among them: it is written just before a run begins.)
RUN_ARTIFACTS = (RUN_FILE, METRICS_FILE, "summary.json", "final")
# Files that belong to a run but do not by themselves mean a run lives here; --overwrite moves them aside too.
# (trackers.json: the tracker runs a resume continues; report.png: the run's picture; config.yaml: the command
# line's recipe of the run)
MOVED_WITH_A_RUN = ("run_config.json", TRACKERS_STATE_FILE, REPORT_FILE, "config.yaml")
# Directories a run manages inside its output directory besides final/: a file in them is the run's (moved,
# replaced, rotated away).
RUN_DIRECTORY_PREFIXES = (CHECKPOINT_PREFIX, "previous-", ".tmp-", ".old-", ".deleting-")
# Locks this process holds (re-entrant): path -> [file descriptor, count, verdict, (entries found, directories made)]
_HELD: dict[str, list] = {}


class LedgerError(RuntimeError):
    """The output directory belongs to another run, or is in use; the message says what to do."""


def file_fingerprint(path: str | os.PathLike, whole: bool = False, head_bytes: int = 1 << 20) -> dict:
    """A file's identity: its path, its size and the SHA-256 of its first `head_bytes` bytes (`head_sha256`); with
    `whole`, also the SHA-256 of its whole content (`sha256`, streamed in 1 MiB reads; its cost is in
    docs/reliability.md), so that a change anywhere in the file counts, even at the same size."""
    path = Path(path)
    with open(path, "rb") as handle:
        fingerprint = {"path": str(path.resolve()), "bytes": path.stat().st_size,
                       "head_sha256": hashlib.sha256(handle.read(head_bytes)).hexdigest()[:16]}
        if whole:  # streamed in 1 MiB reads (hashlib.file_digest is Python 3.11+; looptrain supports 3.10)
            handle.seek(0)
            digest = hashlib.sha256()
            for chunk in iter(lambda: handle.read(1 << 20), b""):
                digest.update(chunk)
            fingerprint["sha256"] = digest.hexdigest()
    return fingerprint


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, owned by someone else
        return True
    return True


class OutputDirLock:
    """Holds `output_dir/.looptrain.lock` while entered; re-entrant within one process.

    Args:
        output_dir: the run's directory (created if missing).
        echo: prints the notice when a stale lock is taken over.
    """

    def __init__(self, output_dir: str | os.PathLike, echo: Callable[[str], None] = print):
        self.path = Path(output_dir) / LOCK_FILE
        self.echo = echo

    def __enter__(self) -> OutputDirLock:
        key = str(self.path.resolve())
        if key in _HELD:
            _HELD[key][1] += 1
            return self
        if self.path.parent.exists() and not self.path.parent.is_dir():
            raise LedgerError(f"output directory {self.path.parent} is a file; pass a directory (--output-dir)")
        created = missing_directories(self.path.parent)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        found = set(os.listdir(self.path.parent))
        descriptor, holder = self._lock_file()
        try:
            if holder.get("pid") and not (
                holder.get("host") == socket.gethostname() and _pid_alive(int(holder["pid"]))
            ):
                self.echo(f"notice: taking over the lock of {self.path.parent} left by PID {holder['pid']}, which is "
                          "no longer running (a killed run)")
            os.ftruncate(descriptor, 0)
            os.pwrite(descriptor, json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                                              "started": _now()}).encode(), 0)
        except BaseException:
            os.close(descriptor)
            raise
        # the verdict: (what was asked, RunLedger.begin's answer), once asked; what this lock found and created
        _HELD[key] = [descriptor, 1, None, (found, created)]
        return self

    def __exit__(self, *exc_info) -> None:
        key = str(self.path.resolve())
        held = _HELD.get(key)
        if held is None:
            return
        held[1] -= 1
        if held[1] == 0:
            del _HELD[key]
            os.ftruncate(held[0], 0)  # an empty lock file: free
            with contextlib.suppress(OSError):
                self._remove_if_nothing_written(*held[3])
            os.close(held[0])  # closing releases the flock

    def _remove_if_nothing_written(self, found: set[str], created: list[Path]) -> None:
        """A run that wrote nothing but the lock file it created (a refused run) removes it, and the directories it
        created: the deepest first, each only when empty. Unlinked while held: see `_lock_file`."""
        if LOCK_FILE in found or set(os.listdir(self.path.parent)) - found - {LOCK_FILE}:
            return
        self.path.unlink(missing_ok=True)
        for directory in created:
            with contextlib.suppress(OSError):
                directory.rmdir()

    def _lock_file(self) -> tuple[int, dict]:
        """The lock file's descriptor, locked, and what the previous holder wrote in it.

        A run that wrote nothing unlinks its lock file while it holds it (`__exit__`): an opener that got that file
        finds it unlinked once it holds the lock, and opens the path again, so that two runs never hold two files.
        """
        while True:
            descriptor = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                holder = self._read(descriptor)
                if not _try_lock(descriptor):
                    raise LedgerError(
                        f"{self.path.parent} is in use by another looptrain run (PID {holder.get('pid', '?')} on "
                        f"{holder.get('host', '?')}, since {holder.get('started', '?')}); wait for it to finish, or "
                        "pass another --output-dir (output_dir)"
                    )
                with contextlib.suppress(FileNotFoundError):
                    if os.stat(self.path).st_ino == os.fstat(descriptor).st_ino:
                        return descriptor, holder
            except BaseException:
                os.close(descriptor)
                raise
            os.close(descriptor)

    @staticmethod
    def _read(descriptor: int) -> dict:
        try:
            return json.loads(os.pread(descriptor, 4096, 0).decode() or "{}")
        except (ValueError, UnicodeDecodeError):
            return {}


def missing_directories(directory: Path) -> list[Path]:
    """The directories `mkdir(parents=True)` would create for `directory`, the deepest first."""
    missing = []
    while not directory.exists():
        missing.append(directory)
        directory = directory.parent
    return missing


def _try_lock(descriptor: int) -> bool:
    try:
        import fcntl
    except ImportError:  # Windows: no flock; the PID in the file is the only guard
        return True
    try:
        fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


def _now() -> str:
    return datetime.datetime.now().isoformat(timespec="seconds")


# Identity fields that looptrain added after runs had saved theirs in run.json (the whole-file `sha256` of a file
# fingerprint, and these keys): a saved identity without them was written by an earlier looptrain, and is compared on
# what it recorded (`older_identity`), with a notice, instead of being refused as another run.
LATER_IDENTITY_KEYS = ("tokenizer",)


def older_identity(saved: dict, current: dict) -> bool:
    """Whether `saved` was written before the identity held `LATER_IDENTITY_KEYS` (which `current` holds)."""
    return any(key in current and key not in saved for key in LATER_IDENTITY_KEYS)


def as_recorded_before(identity):
    """`identity` as an earlier looptrain recorded it: without `LATER_IDENTITY_KEYS` and whole-file hashes."""
    if isinstance(identity, list):
        return [as_recorded_before(item) for item in identity]
    if not isinstance(identity, dict):
        return identity
    later = LATER_IDENTITY_KEYS + (("sha256",) if "head_sha256" in identity else ())
    return {key: as_recorded_before(value) for key, value in identity.items() if key not in later}


def identity_differences(saved: dict, current: dict, prefix: str = "") -> list[str]:
    """The fields two run identities disagree on, as "field: saved -> current" lines, a nested field by its path
    ("data.train.sha256"); an `older_identity` is compared on what it recorded."""
    if not prefix and older_identity(saved, current):
        current = as_recorded_before(current)
    differences = []
    for key in sorted(set(saved) | set(current)):
        before, now = saved.get(key), current.get(key)
        if isinstance(before, dict) and isinstance(now, dict):
            differences += identity_differences(before, now, f"{prefix}{key}.")
        elif before != now:
            differences.append(f"{prefix}{key}: {json.dumps(before)} -> {json.dumps(now)}")
    return differences


def older_identity_notice(output_dir: Path, saved: dict, current: dict) -> str | None:
    """What resuming a run whose run.json an earlier looptrain wrote could not check (None for a current one)."""
    if not older_identity(saved, current):
        return None
    return (f"notice: the run in {output_dir} was saved by an earlier looptrain, whose run.json holds a hash of the "
            "first MiB of each data file and nothing of the tokenizer: resuming it as this run. If the data or the "
            "tokenizer changed since, start afresh instead (--overwrite moves this run aside, or pass another "
            "--output-dir); from now on its run.json covers both whole")


class RunLedger:
    """The output directory's ledger for one run: `begin` decides, `finish` records the end.

    Args:
        output_dir: the run's directory.
        echo: prints notices.
    """

    def __init__(self, output_dir: str | os.PathLike, echo: Callable[[str], None] = print):
        self.output_dir = Path(output_dir)
        self.echo = echo

    @property
    def run_file(self) -> Path:
        return self.output_dir / RUN_FILE

    def read(self) -> dict | None:
        """The directory's run.json, or None when there is none (or it cannot be read)."""
        try:
            return json.loads(self.run_file.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return None

    def another_run_lives_here(self) -> list[str]:
        """What a previous run left at the top of the directory (checkpoints and run files)."""
        if not self.output_dir.is_dir():
            return []
        found = [path.name for path in list_checkpoints(self.output_dir)]
        found += [name for name in RUN_ARTIFACTS if (self.output_dir / name).exists()]
        return found

    def begin(self, identity: dict, resume: str | None, overwrite: bool = False) -> dict:
        """Checks the directory against this run before anything is read or written.

        Args:
            identity: what makes this run the same run (`run_identity`).
            resume: None (a fresh run), "auto", or a checkpoint directory (forced: no identity check; refused
                when it lies outside `output_dir` and another run lives there).
            overwrite: a fresh run moves another run's files aside into `previous-<time>/`.

        Returns:
            `{"action": "fresh" | "resume" | "finished", "checkpoints": [...], "run": saved run.json}`:
            for "resume", the checkpoints to try, newest first. Asked again with the same arguments while this
            process holds the directory's lock, it gives the same answer without reading the directory again.

        Raises:
            LedgerError: another run lives here (a fresh run without `overwrite`, or a forced resume from
                another directory), or `resume="auto"` meets a run with another identity (the message lists
                the fields that differ).
        """
        held = _HELD.get(str((self.output_dir / LOCK_FILE).resolve()))
        asked = (identity, resume, overwrite)
        if held is not None and held[2] is not None and held[2][0] == asked:
            return dict(held[2][1])  # asked already under this lock (the command line, before the Loop)
        verdict = self._decide(identity, resume, overwrite)
        if held is not None:
            held[2] = (asked, dict(verdict))
        return verdict

    def _decide(self, identity: dict, resume: str | None, overwrite: bool) -> dict:
        saved = self.read()
        previous = self.another_run_lives_here()
        if previous and self._saved_nothing(saved) and (
                resume != "auto" or identity_differences(saved["identity"], identity)):
            self._start_over(saved, previous, identity)  # its files moved aside: nothing lives here now
            saved, previous = None, []
        if resume not in (None, "auto"):
            checkpoint = resolve_resume_checkpoint(resume, self.output_dir)  # a CheckpointError unless complete
            self._check_forced_checkpoint(checkpoint, saved, previous)
            return {"action": "resume", "checkpoints": [checkpoint], "run": saved}
        if resume == "auto" and previous:
            if saved is None:
                raise LedgerError(
                    f"--resume auto: {self.output_dir} holds {', '.join(previous)} but no {RUN_FILE}, so looptrain "
                    "cannot tell whether it is this run; resume a checkpoint explicitly with --resume DIR "
                    "(resume='<checkpoint dir>'), or pass another --output-dir")
            differences = identity_differences(saved.get("identity", {}), identity)
            if differences:
                raise LedgerError(
                    f"--resume auto: the run in {self.output_dir} is another run; these settings differ "
                    f"(saved -> now):\n  " + "\n  ".join(differences) + "\nResume it with its own settings (and its "
                    "data and tokenizer as they were), force this checkpoint with --resume DIR (resume='<checkpoint "
                    "dir>'), or start afresh: --overwrite (overwrite=True) moves this run aside, or pass another "
                    "--output-dir")
            if notice := older_identity_notice(self.output_dir, saved.get("identity", {}), identity):
                self.echo(notice)
            if saved.get("status") == "finished":
                return {"action": "finished", "checkpoints": [], "run": saved}
            checkpoints = list(reversed(list_checkpoints(self.output_dir)))
            return {"action": "resume" if checkpoints else "fresh", "checkpoints": checkpoints, "run": saved}
        if previous:
            if not overwrite:
                raise LedgerError(
                    f"{self.output_dir} already holds another run ({', '.join(previous)}); continue it with "
                    "--resume auto, move it aside with --overwrite (overwrite=True: nothing is deleted), or pass "
                    "another --output-dir")
            self._move_aside(previous)
        return {"action": "fresh", "checkpoints": [], "run": None}

    def _check_forced_checkpoint(self, checkpoint: Path, saved: dict | None, previous: list[str]) -> None:
        """A forced resume continues into this directory: its checkpoints, final/ and summary are overwritten, then
        rotated away. So the checkpoint must sit here, and be this directory's run's by its saved identity (a copy of
        another run's checkpoint put here is another run's)."""
        if not previous:
            return  # an empty directory: any checkpoint may start it
        safe = f"continue that run in a directory of its own: --resume {checkpoint} --output-dir NEW_DIR (new or empty)"
        if checkpoint.resolve().parent != self.output_dir.resolve():
            raise LedgerError(
                f"--resume {checkpoint}: that checkpoint is not in {self.output_dir}, which already holds "
                f"another run ({', '.join(previous)}); {safe}")
        theirs = checkpoint_identity(checkpoint)
        if saved is None or theirs is None or not isinstance(saved.get("identity"), dict):
            return  # a checkpoint saved without its identity (an older looptrain): its place decides
        ours = [saved["identity"], *saved.get("earlier_identities", [])]  # forced resumes may have changed it
        if any(not identity_differences(identity, theirs) for identity in ours):
            return
        differences = identity_differences(saved["identity"], theirs)
        raise LedgerError(
            f"--resume {checkpoint}: that checkpoint belongs to another run than the one in {self.output_dir} "
            f"({', '.join(previous)}), which it would overwrite; these settings differ (this directory's run -> the "
            "checkpoint's):\n  " + "\n  ".join(differences) + f"\nNothing was changed. To {safe}")

    def _saved_nothing(self, saved: dict | None) -> bool:
        """Whether the run here saved nothing a resume could continue from: no checkpoint, no final/, not finished
        (it failed, or was killed, before its first checkpoint)."""
        return (saved is not None and saved.get("status") != "finished" and isinstance(saved.get("identity"), dict)
                and not list_checkpoints(self.output_dir) and not (self.output_dir / "final").exists())

    def _start_over(self, saved: dict, previous: list[str], identity: dict) -> None:
        """A new run in the place of one that saved nothing: that run's files are moved aside, with a notice."""
        differences = identity_differences(saved["identity"], identity)
        settings = f" with other settings ({'; '.join(differences)})" if differences else ""
        ended = {"failed": "failed", "interrupted": "was interrupted", "running": "was killed"}
        self.echo(f"notice: the run in {self.output_dir} {ended.get(saved.get('status'), 'stopped')} at step "
                  f"{saved.get('step', '?')} without saving a checkpoint or final/: nothing of it can be resumed, so "
                  f"this run takes its place{settings}")
        self._move_aside(previous)

    def _move_aside(self, previous: list[str]) -> None:
        """Moves the run that lives here (`previous`, and the files of `MOVED_WITH_A_RUN` that exist) into a
        previous-<time>-<pid>/ directory, never deleting a byte of it."""
        names = previous + [name for name in MOVED_WITH_A_RUN if (self.output_dir / name).exists()]
        aside = self.output_dir / f"previous-{datetime.datetime.now():%Y%m%d-%H%M%S}-{os.getpid()}"
        aside.mkdir()
        for name in names:
            os.replace(self.output_dir / name, aside / name)
        self.echo(f"notice: moved the previous run's files ({', '.join(names)}) aside into {aside}")

    def finished_run_summary(self) -> dict:
        """`finished_run_summary` of this directory, said through this ledger's echo."""
        return finished_run_summary(self.output_dir, self.echo)

    def write(self, identity: dict, status: str, **fields: Any) -> None:
        """Records this run's identity and status ("running", "interrupted", "failed", "finished") in run.json.

        The run.json already here is this run's (another run's is moved aside or refused before): when a forced
        resume changed the identity, the earlier ones are kept (`earlier_identities`), so that the run's own older
        checkpoints are still recognised as its own.
        """
        earlier = []
        if (saved := self.read()) is not None and isinstance(saved.get("identity"), dict):
            earlier = [item for item in [saved["identity"], *saved.get("earlier_identities", [])]
                       if identity_differences(item, identity)]
        record = {"identity": identity, "status": status, "updated": _now(), **fields}
        if earlier:
            record["earlier_identities"] = earlier
        write_json_atomic(self.run_file, record)


def checkpoint_identity(checkpoint: str | os.PathLike) -> dict | None:
    """The identity of the run that saved `checkpoint` (its trainer_state.json), or None when it does not say."""
    identity = read_json_object(Path(checkpoint) / TRAINER_STATE_FILE).get("identity")
    return identity if isinstance(identity, dict) else None


def run_file_owner(path: str | os.PathLike) -> Path | None:
    """The run directory whose own file `path` is, or None.

    A run directory holds run.json, the lock, final/ or a checkpoint; its own files are those a run writes at its
    top (run.json, run_config.json, metrics.jsonl, summary.json, report.png, the lock) and everything under the
    directories it manages (final/, checkpoint-N/, previous-*/ and the temporary ones). Another command must never
    write there.
    """
    path = Path(path).resolve()
    for directory in path.parents:
        if not _is_run_directory(directory):
            continue
        first, *rest = path.relative_to(directory).parts
        own_file = not rest and first in (*RUN_ARTIFACTS, *MOVED_WITH_A_RUN, LOCK_FILE)
        managed = first == "final" or first.startswith(RUN_DIRECTORY_PREFIXES)
        return directory if own_file or (rest and managed) else None
    return None


def _is_run_directory(directory: Path) -> bool:
    return ((directory / RUN_FILE).is_file() or (directory / LOCK_FILE).is_file() or (directory / "final").is_dir()
            or bool(list_checkpoints(directory)))


def finished_run_summary(output_dir: str | os.PathLike, echo: Callable[[str], None] = print) -> dict:
    """A finished run's answer to being run again (`resume="auto"`): it says so, and returns its saved summary with
    ``already_finished``; nothing is trained, and every file is left as it is."""
    path = Path(output_dir) / "summary.json"
    summary = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
    echo(f"the run in {output_dir} finished at step {summary.get('optimizer_steps', '?')}: nothing to train; every "
         "file it wrote is left as it is")
    return {**summary, "already_finished": True}
