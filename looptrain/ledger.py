"""The output directory as a ledger: one run at a time, a run's identity, and what a new run may do there.

An output directory holds hours of a user's compute, so no run may destroy, mix into or silently
resume another run's state:

- `OutputDirLock`: a lock held for the whole run (an `flock` on `output_dir/.looptrain.lock`, which
  the kernel releases when the process dies, so a killed run leaves no live lock). A second run gets
  an error naming the PID that holds it; a lock file left by a dead process is taken over with a notice.
- `run.json`: the run's identity (what makes it the same run: the schedule, the seed, and whatever
  the caller adds, such as the model and data files and their hashes) and its status.
- `RunLedger.begin` decides, before anything is read or written: a fresh run into a directory that
  holds another run refuses (or with `overwrite` moves that run aside, never deleting it);
  `resume="auto"` continues only a run with the same identity, from its newest checkpoint that can
  be read; a finished run is reported as finished (`finished_run_summary`) and left alone. The directory
  is asked once while its lock is held: the command line asks before it reads any data, and the Loop it
  then runs under the same lock is given that verdict.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import socket
from collections.abc import Callable
from pathlib import Path
from typing import Any

from looptrain.checkpoint import list_checkpoints, write_json_atomic

LOCK_FILE = ".looptrain.lock"
RUN_FILE = "run.json"
# What a run writes at the top of its output directory; their presence means a run lives there.
# (run_config.json is not among them: it is written just before a run begins.)
RUN_ARTIFACTS = (RUN_FILE, "metrics.jsonl", "summary.json", "final")
# Files that belong to a run but do not by themselves mean a run lives here; --overwrite moves them aside too.
MOVED_WITH_A_RUN = ("run_config.json",)
_HELD: dict[str, list] = {}  # locks this process holds: path -> [file descriptor, count, verdict] (re-entrant)


class LedgerError(RuntimeError):
    """The output directory belongs to another run, or is in use; the message says what to do."""


def file_fingerprint(path: str | os.PathLike, whole: bool = False, head_bytes: int = 1 << 20) -> dict:
    """A file's identity: its path, its size and the SHA-256 of its first `head_bytes` bytes (`head_sha256`); with
    `whole`, also the SHA-256 of its whole content (`sha256`, streamed: about 0.07 s per 100 MB on a CPU with SHA
    instructions), so that a change anywhere in the file counts, even at the same size."""
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
        self.path.parent.mkdir(parents=True, exist_ok=True)
        descriptor = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            holder = self._read(descriptor)
            if not _try_lock(descriptor):
                raise LedgerError(
                    f"{self.path.parent} is in use by another looptrain run (PID {holder.get('pid', '?')} on "
                    f"{holder.get('host', '?')}, since {holder.get('started', '?')}); wait for it to finish, or "
                    "pass another --output-dir (output_dir)"
                )
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
        _HELD[key] = [descriptor, 1, None]  # the verdict: (what was asked, RunLedger.begin's answer), once asked
        return self

    def __exit__(self, *exc_info) -> None:
        key = str(self.path.resolve())
        held = _HELD.get(key)
        if held is None:
            return
        held[1] -= 1
        if held[1] == 0:
            del _HELD[key]
            os.ftruncate(held[0], 0)  # an empty lock file: free (the file stays: unlinking races with openers)
            os.close(held[0])  # closing releases the flock

    @staticmethod
    def _read(descriptor: int) -> dict:
        try:
            return json.loads(os.pread(descriptor, 4096, 0).decode() or "{}")
        except (ValueError, UnicodeDecodeError):
            return {}


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
        if resume not in (None, "auto"):
            checkpoint = Path(resume)
            if previous and checkpoint.resolve().parent != self.output_dir.resolve():
                # A checkpoint of another directory would continue into this one: its checkpoints, final/ and
                # summary would be overwritten, then rotated away. Only the run's own checkpoints may be forced.
                raise LedgerError(
                    f"--resume {checkpoint}: that checkpoint is not in {self.output_dir}, which already holds "
                    f"another run ({', '.join(previous)}); resume it into its own directory, into an empty "
                    "--output-dir, or copy the checkpoint into this directory to continue this run from it")
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
            self._move_aside(previous + [name for name in MOVED_WITH_A_RUN if (self.output_dir / name).exists()])
        return {"action": "fresh", "checkpoints": [], "run": None}

    def _move_aside(self, names: list[str]) -> None:
        aside = self.output_dir / f"previous-{datetime.datetime.now():%Y%m%d-%H%M%S}-{os.getpid()}"
        aside.mkdir()
        for name in names:
            os.replace(self.output_dir / name, aside / name)
        self.echo(f"notice: moved the previous run's files ({', '.join(names)}) aside into {aside}")

    def finished_run_summary(self) -> dict:
        """`finished_run_summary` of this directory, said through this ledger's echo."""
        return finished_run_summary(self.output_dir, self.echo)

    def write(self, identity: dict, status: str, **fields: Any) -> None:
        """Records this run's identity and status ("running", "interrupted", "finished") in run.json."""
        record = {"identity": identity, "status": status, "updated": _now(), **fields}
        write_json_atomic(self.run_file, record)


def finished_run_summary(output_dir: str | os.PathLike, echo: Callable[[str], None] = print) -> dict:
    """A finished run's answer to being run again (`resume="auto"`): it says so, and returns its saved summary with
    ``already_finished``; nothing is trained, and every file is left as it is."""
    path = Path(output_dir) / "summary.json"
    summary = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
    echo(f"the run in {output_dir} finished at step {summary.get('optimizer_steps', '?')}: nothing to train; every "
         "file it wrote is left as it is")
    return {**summary, "already_finished": True}
