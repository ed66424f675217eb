"""glibc malloc's thresholds (`looptrain.memory.allocator`): with them fixed, RSS follows the live tensors."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

from looptrain.memory import allocator

ROOT = Path(__file__).resolve().parent.parent
MIB = 2**20

# Frees a 16 MiB block (glibc then raises its mmap threshold to 16 MiB), allocates 96 blocks of 1 MiB and frees every
# other one, and prints how far RSS rose. From the heap the freed holes stay resident (~96 MiB); mmapped, each freed
# block goes back to the OS (~48 MiB, the 48 blocks alive).
HOLES = """
import sys, torch
from looptrain.memory import allocator
from looptrain.memory.meters import current_rss_bytes
if sys.argv[1] == "lean":
    print(allocator.keep_rss_lean(), file=sys.stderr)
big = torch.ones(4 * 2**20)
del big
before = current_rss_bytes()
blocks = [torch.ones(2**18) for _ in range(96)][::2]
print((current_rss_bytes() - before) / 2**20)
"""


def rss_rise_mib(mode: str, **environment: str) -> tuple[float, str]:
    clean = {key: value for key, value in os.environ.items() if key not in allocator.USER_VARIABLES}
    clean.pop("GLIBC_TUNABLES", None)
    finished = subprocess.run([sys.executable, "-c", HOLES, mode], capture_output=True, text=True, timeout=120,
                              env={**clean, "PYTHONPATH": str(ROOT), **environment})
    assert finished.returncode == 0, finished.stderr[-2000:]
    return float(finished.stdout.split()[-1]), finished.stderr


@pytest.mark.slow  # 7 s: fresh processes; .ci/run runs it, make test stays under 5 minutes
@pytest.mark.skipif(not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc", reason="glibc only")
def test_fixed_thresholds_return_freed_blocks_that_the_dynamic_threshold_keeps_resident():
    default, _ = rss_rise_mib("default")
    lean, said = rss_rise_mib("lean")
    assert default > 80, default  # the control: glibc's own behaviour keeps the 48 freed MiB resident
    assert 40 < lean < 60, lean  # the 48 live blocks, nothing more
    assert "mmap and trim thresholds fixed at 128 KiB" in said
    # A threshold the user set is theirs: it stays (here glibc's maximum, so the holes stay resident).
    kept, said = rss_rise_mib("lean", MALLOC_MMAP_THRESHOLD_=str(32 * MIB))
    assert kept > 70 and "left as set by MALLOC_MMAP_THRESHOLD_" in said, (kept, said)


def test_user_settings_are_named_and_left_alone(monkeypatch):
    monkeypatch.setattr(allocator, "_glibc", lambda: pytest.fail("mallopt must not be reached"))
    monkeypatch.setattr(allocator, "_applied", None)
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.trim_threshold=1048576:glibc.malloc.arena_max=2")
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "262144")
    assert allocator.user_malloc_settings() == ["MALLOC_MMAP_THRESHOLD_", "glibc.malloc.trim_threshold"]
    assert allocator.keep_rss_lean() == (
        "glibc malloc's thresholds are left as set by MALLOC_MMAP_THRESHOLD_, glibc.malloc.trim_threshold")
    assert allocator._applied is None


def test_another_c_library_is_left_as_it_is_and_said_so(monkeypatch):
    monkeypatch.setattr(allocator, "_glibc", lambda: None)
    monkeypatch.setattr(allocator, "_applied", None)
    for name in (*allocator.USER_VARIABLES, "GLIBC_TUNABLES"):
        monkeypatch.delenv(name, raising=False)
    assert allocator.keep_rss_lean().startswith("the C library is not glibc: its allocator is left as it is")
    assert allocator._applied is None
    with pytest.raises(ValueError, match="the malloc threshold must be positive, got 0"):
        allocator.keep_rss_lean(0)


def test_the_allocators_state_is_described_for_the_probe_cache(monkeypatch):
    """A probe's RSS and time depend on the allocator's thresholds, so its cache key carries them."""
    for name in (*allocator.USER_VARIABLES, "GLIBC_TUNABLES"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(allocator, "_applied", None)
    monkeypatch.setattr(allocator, "_glibc", lambda: object())
    assert allocator.describe() == "glibc: dynamic thresholds" and allocator.fixed_threshold() is None
    assert allocator.keeps_freed()  # here (and at 1 MiB) a run holds more than a probe of a fresh heap measured
    monkeypatch.setattr(allocator, "_glibc", lambda: None)
    assert allocator.describe() == "not glibc" and not allocator.keeps_freed()
    monkeypatch.setattr(allocator, "_glibc", lambda: object())
    monkeypatch.setenv("MALLOC_TRIM_THRESHOLD_", "131072")
    assert allocator.describe() == "as set: MALLOC_TRIM_THRESHOLD_=131072" and not allocator.keeps_freed()
    monkeypatch.setattr(allocator, "_applied", 131072)
    assert allocator.describe() == "glibc: thresholds fixed at 131072 bytes by looptrain" \
        and allocator.fixed_threshold() == 131072
    assert not allocator.keeps_freed()
    assert allocator.lean_environment() == {"MALLOC_MMAP_THRESHOLD_": "131072", "MALLOC_TRIM_THRESHOLD_": "131072"}


def test_fix_thresholds_goes_one_step_leaner_a_call_and_says_what_it_did_only_when_it_changed_something(monkeypatch):
    """The planner's `make_lean`: each call one step leaner, 1 MiB (large blocks mmapped, the heap trimmed by the
    run) then 128 KiB; a sentence when the thresholds changed now, None when nothing changed (then the planner does
    not measure its first probe again)."""
    calls = []

    class Libc:
        def mallopt(self, option, value):
            calls.append((option, value))
            return 1

        def malloc_trim(self, pad):
            calls.append(("trim", pad))
            return 1

    for name in (*allocator.USER_VARIABLES, "GLIBC_TUNABLES"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(allocator, "_applied", None)
    monkeypatch.setattr(allocator, "_glibc", lambda: Libc())
    assert allocator.fix_thresholds().startswith("glibc malloc's mmap threshold fixed at 1024 KiB and its trim "
                                                 "threshold at 128 KiB")
    assert calls == [(-3, 1048576), (-1, 131072), ("trim", 0)]  # M_MMAP_THRESHOLD, M_TRIM_THRESHOLD, malloc_trim
    assert allocator.fixed_threshold() == 1048576
    assert allocator.keeps_freed()  # blocks under 1 MiB stay in the heap: the run trims it
    assert allocator.lean_environment(1048576) == {"MALLOC_MMAP_THRESHOLD_": "1048576",
                                                   "MALLOC_TRIM_THRESHOLD_": "131072"}
    assert allocator.fix_thresholds().startswith("glibc malloc's mmap and trim thresholds fixed at 128 KiB")
    assert calls[3:] == [(-3, 131072), (-1, 131072), ("trim", 0)]
    assert allocator.fixed_threshold() == 131072 and not allocator.keeps_freed()
    assert allocator.fix_thresholds() is None and len(calls) == 6  # as lean as it goes: nothing changes
    monkeypatch.setattr(allocator, "_applied", None)
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "65536")
    assert allocator.fix_thresholds() is None and len(calls) == 6  # the user's threshold stands
