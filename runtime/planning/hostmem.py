"""How much host RAM this process may use, and whether a directory lives in RAM.

The machine's RAM (psutil) is not what a process in a container or a batch job may use: every cgroup above
it can set a lower memory limit (Docker and Kubernetes on the container, Slurm on the job and the step,
systemd on a slice). ``cgroup_limits`` reads ``/proc/self/cgroup`` and walks from this process's cgroup up
to the root of the mounted hierarchy, v2 (``memory.max``) or v1 (``memory.limit_in_bytes``), and
``host_memory`` keeps the tightest: the total the headroom is computed from, the bytes still available,
and a sentence naming the limit that applied. ``ram_backed`` tells whether a path is on tmpfs or ramfs,
whose files are RAM too (the ``tmp`` swap path is /dev/shm).

Every reader takes the ``/proc`` and ``/sys/fs/cgroup`` roots as arguments, so tests pass fake trees.
What it leaves out: ``memory.high`` (a throttle, not a limit), swap limits, NUMA.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import psutil

from runtime.config.units import approx_size

PROC = Path("/proc")
CGROUP_ROOT = Path("/sys/fs/cgroup")
UNLIMITED = 1 << 60  # v1 writes "no limit" as a page-rounded 2**63 - 1
RAM_FILE_SYSTEMS = ("tmpfs", "ramfs")


@dataclass(frozen=True)
class CgroupLimit:
    """A memory limit set on one cgroup of this process's hierarchy, with that cgroup's usage."""

    path: Path  # the cgroup's directory
    version: int  # 1 or 2
    limit_nbytes: int
    usage_nbytes: int
    reclaimable_nbytes: int  # inactive file cache the kernel drops before it refuses memory

    @property
    def available_nbytes(self) -> int:
        """Bytes the cgroup may still take."""
        return max(self.limit_nbytes - self.usage_nbytes + self.reclaimable_nbytes, 0)

    def describe(self) -> str:
        """E.g. ``cgroup v2 limit 64.00 GiB (memory.max of /sys/fs/cgroup/job)``."""
        name = "memory.max" if self.version == 2 else "memory.limit_in_bytes"
        return f"cgroup v{self.version} limit {approx_size(self.limit_nbytes)} ({name} of {self.path})"


@dataclass(frozen=True)
class HostMemory:
    """The RAM this process may use: the machine's, or less where a cgroup limits it."""

    total_nbytes: int  # the most it may ever use: the machine's RAM or the tightest cgroup limit
    available_nbytes: int  # of that, what is free now
    limit: str  # which limit bounds ``available_nbytes``, for a person

    @property
    def headroom_nbytes(self) -> int:
        """Left to the rest of the process and the OS: 10% of the total or 2 GiB, whichever is more."""
        return max(self.total_nbytes // 10, 2 << 30)

    @property
    def usable_nbytes(self) -> int:
        """What a plan may pin: available less headroom."""
        return max(self.available_nbytes - self.headroom_nbytes, 0)

    def describe(self) -> str:
        """One sentence with every number the usable figure comes from."""
        return (f"{approx_size(self.usable_nbytes)} usable: {approx_size(self.available_nbytes)} available under "
                f"{self.limit}, less {approx_size(self.headroom_nbytes)} headroom")


def host_memory(proc: Path = PROC, cgroup_root: Path = CGROUP_ROOT, machine: tuple[int, int] | None = None) -> HostMemory:
    """The RAM this process may use now. ``machine``: (total, available) instead of psutil's (for tests)."""
    if machine is None:
        vm = psutil.virtual_memory()
        machine = (vm.total, vm.available)
    total, available = machine
    limit = f"the machine's RAM ({approx_size(total)})"
    for cgroup in cgroup_limits(proc, cgroup_root):
        total = min(total, cgroup.limit_nbytes)
        if cgroup.available_nbytes < available:
            available, limit = cgroup.available_nbytes, cgroup.describe()
    return HostMemory(total_nbytes=total, available_nbytes=available, limit=limit)


def cgroup_limits(proc: Path = PROC, cgroup_root: Path = CGROUP_ROOT) -> list[CgroupLimit]:
    """Every memory limit on this process's cgroup and the ones above it, innermost first (empty when
    there is none or the files cannot be read)."""
    try:
        lines = (proc / "self" / "cgroup").read_text().splitlines()
    except OSError:
        return []
    found: list[CgroupLimit] = []
    for line in lines:
        hierarchy, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if hierarchy == "0" and controllers == "":
            mount, version = cgroup_root, 2
            if not (mount / "cgroup.controllers").exists():
                continue  # hybrid layout: the v2 tree holds no memory controller here
        elif "memory" in controllers.split(","):
            mount, version = cgroup_root / "memory", 1
        else:
            continue
        found += _walk(mount, path, version)
    return found


def _walk(mount: Path, path: str, version: int) -> list[CgroupLimit]:
    """Limits from the process's own cgroup directory up to the mount's root."""
    here = _own_directory(mount, path)
    out = []
    while here is not None:
        limit = _limit_at(here, version)
        if limit is not None:
            out.append(limit)
        here = here.parent if here != mount else None
    return out


def _own_directory(mount: Path, path: str) -> Path | None:
    """The directory of ``path`` (from /proc/self/cgroup) under the mount. A container without a cgroup
    namespace sees the host's full path but has only its own subtree mounted: leading parts that do not
    exist under the mount are dropped."""
    if not mount.is_dir():
        return None
    parts = [p for p in path.split("/") if p and p != ".."]
    for first in range(len(parts) + 1):
        candidate = mount.joinpath(*parts[first:])
        if candidate.is_dir():
            return candidate
    return None


def _limit_at(directory: Path, version: int) -> CgroupLimit | None:
    names = ("memory.max", "memory.current", "inactive_file") if version == 2 else \
        ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file")
    try:
        text = (directory / names[0]).read_text().strip()
        if text == "max" or int(text) >= UNLIMITED:
            return None
        usage = int((directory / names[1]).read_text().strip())
    except (OSError, ValueError):
        return None
    return CgroupLimit(directory, version, int(text), usage, _stat_value(directory / "memory.stat", names[2]))


def _stat_value(path: Path, key: str) -> int:
    try:
        for line in path.read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == key:
                return int(value)
    except (OSError, ValueError):
        pass
    return 0


def ram_backed(path: str | os.PathLike[str], proc: Path = PROC) -> str | None:
    """The file system type when ``path`` lies on tmpfs or ramfs (its files take RAM), else None."""
    try:
        lines = (proc / "self" / "mountinfo").read_text().splitlines()
    except OSError:
        return None
    target = os.path.realpath(path)
    best, fstype = "", None
    for line in lines:
        fields = line.split()
        if "-" not in fields:
            continue
        mount_point = _unescape(fields[4])
        kind = fields[fields.index("-") + 1]
        inside = target == mount_point or target.startswith(mount_point.rstrip("/") + "/")
        if inside and len(mount_point) >= len(best):  # the deepest mount wins; a later one hides an earlier
            best, fstype = mount_point, kind
    return fstype if fstype in RAM_FILE_SYSTEMS else None


def _unescape(field: str) -> str:
    """mountinfo writes space, tab, newline and backslash in paths as octal escapes."""
    for code, char in (("\\040", " "), ("\\011", "\t"), ("\\012", "\n"), ("\\134", "\\")):
        field = field.replace(code, char)
    return field
