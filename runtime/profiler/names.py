"""What the profiler's outputs call the device, its paths and its stall causes: "GPU" on a CUDA run; on a CPU-only
run the compute device is the CPU, so the same paths are "pinned -> device" copies in memory, and no row or line
speaks of a GPU (issue 41). "pinned" stays the host tier's name, as the config and the docs call it (without CUDA
its arena is not page-locked: tiers.host.pin), so a run's NVMe rows read the same on both.

A summary saved before ``device_type`` was recorded is taken as a GPU run's (the text it was written with).
Pure text; nothing here touches torch or the session.
"""

from __future__ import annotations

from runtime.core.events import STALL_CAPACITY, STALL_FETCH_HOST, STALL_FETCH_NVME, STALL_GRAD_SUM, STALL_UPDATE

PATHS = ("h2d", "d2h", "read", "write")
GPU_PATH_NAMES = {"h2d": "pinned -> GPU", "d2h": "GPU -> pinned", "read": "NVMe -> pinned", "write": "pinned -> NVMe"}
CPU_PATH_NAMES = {**GPU_PATH_NAMES, "h2d": "pinned -> device", "d2h": "device -> pinned"}
GPU_CAUSE_NAMES = {STALL_FETCH_HOST: "fetch host", STALL_FETCH_NVME: "fetch NVMe", STALL_UPDATE: "Adam not done",
                   STALL_CAPACITY: "GPU full", STALL_GRAD_SUM: "sum buffer"}
CPU_CAUSE_NAMES = {**GPU_CAUSE_NAMES, STALL_CAPACITY: "device full"}
# The header's line on a CPU-only run: what "device" means in the rows below it.
CPU_DEVICE_NOTE = ("the device is the CPU (no CUDA): 'device' is the compute memory outside the host arena ('pinned', "
                   "not page-locked without CUDA), its copies are memory copies, and the optimizer.gpu_* and tiers.gpu.* "
                   "settings apply to it")


def on_gpu(device_type: str | None) -> bool:
    """True for a CUDA run, and for a summary that does not say (saved before the device type was recorded)."""
    return device_type in (None, "cuda")


def path_names(device_type: str | None) -> dict[str, str]:
    """Path kind -> its name for a person (see the module doc)."""
    return GPU_PATH_NAMES if on_gpu(device_type) else CPU_PATH_NAMES


def cause_names(device_type: str | None) -> dict[str, str]:
    """Stall cause -> its name for a person (see the module doc)."""
    return GPU_CAUSE_NAMES if on_gpu(device_type) else CPU_CAUSE_NAMES


def device_word(device_type: str | None) -> str:
    """"GPU", or "device" where the device is the CPU."""
    return "GPU" if on_gpu(device_type) else "device"

