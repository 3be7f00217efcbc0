"""The RAM a process may use, read from fake /proc and /sys/fs/cgroup trees laid out as each kind of
machine lays them out: cgroup v2 and v1, nested limits (Slurm job and step, systemd slice), a container
without a cgroup namespace, a hybrid layout; and which paths are RAM-backed."""

from __future__ import annotations

from pathlib import Path

import pytest

from runtime.planning.hostmem import HostMemory, cgroup_limits, host_memory, ram_backed

GiB = 1 << 30
MACHINE = (512 * GiB, 400 * GiB)  # (total, available) of a large host


def write(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def tree(tmp_path: Path, proc_cgroup: str, files: dict[str, str]) -> tuple[Path, Path]:
    """A fake /proc (with self/cgroup) and /sys/fs/cgroup holding ``files``."""
    proc, cgroup = tmp_path / "proc", tmp_path / "cgroup"
    write(proc, {"self/cgroup": proc_cgroup})
    cgroup.mkdir()
    write(cgroup, files)
    return proc, cgroup


def test_v2_nested_limits_the_tightest_applies_and_usage_counts(tmp_path):
    # Slurm: a 64 GiB job with a 48 GiB step inside; the step has used 8 GiB, 2 GiB of it reclaimable cache.
    proc, cgroup = tree(tmp_path, "0::/system.slice/slurmstepd.scope/job_7/step_0\n", {
        "cgroup.controllers": "cpu memory\n",
        "system.slice/slurmstepd.scope/job_7/memory.max": f"{64 * GiB}\n",
        "system.slice/slurmstepd.scope/job_7/memory.current": f"{10 * GiB}\n",
        "system.slice/slurmstepd.scope/job_7/step_0/memory.max": f"{48 * GiB}\n",
        "system.slice/slurmstepd.scope/job_7/step_0/memory.current": f"{8 * GiB}\n",
        "system.slice/slurmstepd.scope/job_7/step_0/memory.stat": f"anon 100\ninactive_file {2 * GiB}\nactive_file 5\n",
        "system.slice/memory.max": "max\n",
        "system.slice/memory.current": f"{100 * GiB}\n",
    })
    limits = cgroup_limits(proc, cgroup)
    assert [(lim.limit_nbytes, lim.version) for lim in limits] == [(48 * GiB, 2), (64 * GiB, 2)]  # innermost first
    memory = host_memory(proc, cgroup, machine=MACHINE)
    assert memory.total_nbytes == 48 * GiB  # the headroom comes from the limit, not from the host's 512 GiB
    assert memory.headroom_nbytes == int(4.8 * GiB)
    # The step may take 48 - 8 + 2 (cache the kernel drops first) = 42 GiB, the job 64 - 10 = 54: the step binds.
    assert memory.available_nbytes == 42 * GiB
    step = cgroup / "system.slice/slurmstepd.scope/job_7/step_0"
    assert "cgroup v2" in memory.limit and f"memory.max of {step}" in memory.limit
    assert "42.00 GiB available" in memory.describe() and "48.00 GiB" in memory.describe()


def test_v1_nested_with_an_unlimited_root(tmp_path):
    proc, cgroup = tree(tmp_path, "12:pids:/a\n4:memory:/slurm/uid_1/job_2\n1:name=systemd:/a\n", {
        "memory/memory.limit_in_bytes": "9223372036854771712\n",
        "memory/memory.usage_in_bytes": f"{300 * GiB}\n",
        "memory/slurm/uid_1/job_2/memory.limit_in_bytes": f"{16 * GiB}\n",
        "memory/slurm/uid_1/job_2/memory.usage_in_bytes": f"{4 * GiB}\n",
        "memory/slurm/uid_1/job_2/memory.stat": f"inactive_file 7\ntotal_inactive_file {GiB}\n",
    })
    memory = host_memory(proc, cgroup, machine=MACHINE)
    assert (memory.total_nbytes, memory.available_nbytes) == (16 * GiB, 13 * GiB)
    assert "cgroup v1" in memory.limit and "memory.limit_in_bytes" in memory.limit


def test_container_without_a_cgroup_namespace_reads_its_own_mounted_subtree(tmp_path):
    # /proc/self/cgroup names the host's path, but only the container's cgroup is mounted (as the root).
    proc, cgroup = tree(tmp_path, "0::/kubepods/pod1/abc\n", {
        "cgroup.controllers": "memory\n",
        "memory.max": f"{8 * GiB}\n",
        "memory.current": f"{GiB}\n",
    })
    memory = host_memory(proc, cgroup, machine=MACHINE)
    assert (memory.total_nbytes, memory.available_nbytes) == (8 * GiB, 7 * GiB)


def test_hybrid_layout_uses_the_v1_memory_controller(tmp_path):
    # systemd's hybrid mode: a v2 line for a tree without the memory controller, and v1 memory.
    proc, cgroup = tree(tmp_path, "4:memory:/box\n0::/box\n", {
        "unified/cgroup.controllers": "",
        "memory/box/memory.limit_in_bytes": f"{32 * GiB}\n",
        "memory/box/memory.usage_in_bytes": f"{2 * GiB}\n",
    })
    assert [lim.version for lim in cgroup_limits(proc, cgroup)] == [1]


def test_no_limit_or_no_cgroup_files_means_the_machine(tmp_path):
    proc, cgroup = tree(tmp_path, "0::/\n", {"cgroup.controllers": "memory\n"})
    memory = host_memory(proc, cgroup, machine=MACHINE)
    assert (memory.total_nbytes, memory.available_nbytes) == MACHINE
    assert memory.limit.startswith("the machine's RAM")
    assert host_memory(tmp_path / "nothing", tmp_path / "nothing", machine=MACHINE).total_nbytes == MACHINE[0]


def test_a_limit_below_the_headroom_leaves_nothing_usable():
    memory = HostMemory(total_nbytes=GiB, available_nbytes=GiB, limit="x")
    assert memory.headroom_nbytes == 2 * GiB and memory.usable_nbytes == 0


def test_this_machine_reads_without_error():
    memory = host_memory()
    assert 0 < memory.available_nbytes <= memory.total_nbytes


@pytest.mark.parametrize("path,expected", [
    ("/dev/shm/run/x", "tmpfs"),
    ("/dev/shm", "tmpfs"),
    ("/data/my swap/x", None),  # an escaped space in the mount point
    ("/data/my swap/ram/y", "ramfs"),  # the deepest mount wins
    ("/devx/shm", None),  # a prefix of the name is not a mount point
    ("/home/u", None),
])
def test_ram_backed_finds_the_deepest_mount(tmp_path, path, expected):
    write(tmp_path, {"self/mountinfo": "\n".join([
        "22 1 254:0 / / rw,relatime - ext4 /dev/vda rw",
        "25 22 0:23 / /dev/shm rw,relatime - tmpfs tmpfs rw,size=100k",
        "26 22 259:1 / /data/my\\040swap rw - xfs /dev/nvme0n1 rw",
        "27 26 0:40 / /data/my\\040swap/ram rw shared:5 - ramfs ramfs rw",
    ]) + "\n"})
    assert ram_backed(path, proc=tmp_path) == expected


def test_ram_backed_on_this_machine(tmpfs_dir):
    if not str(tmpfs_dir).startswith("/dev/shm"):
        pytest.skip("no /dev/shm here")
    assert ram_backed(tmpfs_dir) == "tmpfs"
    assert ram_backed("/proc/self") is None  # procfs takes no RAM for files
