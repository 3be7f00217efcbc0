"""A path's share of its bandwidth ceiling, and how a share above 100% is shown: as what it is, a ceiling
probe that measured less than the store then moved, never as an achievement.

A path's rate is its bytes over the time it was busy (copies on one CUDA stream placed one after another,
file IOs on several threads as the union of their intervals); its ceiling is the best a raw probe reached on
the same path. A share above ``1 + CEILING_NOISE`` means the probe was too low (too short, disturbed, or a
single stream against the store's parallel IOs) or the store's bytes did not all touch the disk (the first
reads of a swap file set up with zeros: 1.9 GB/s against a 1.0 GB/s ceiling in the 8B run's second step, H100);
within the noise it is shown as 100%.

Pure arithmetic and text; nothing here touches torch or the session.
"""

from __future__ import annotations

CEILING_NOISE = 0.02  # repeated probes of one path on an idle machine agree to about this
OVER_CEILING_MARK = ">100%!"
OVER_CEILING_NOTE = ("! above the path's ceiling: the probe measured less than the store moved (too short a probe, "
                     "traffic beside it, writes a device cache absorbed: the disk ceiling's writes are fsync'd, the "
                     "store's are not, or reads of swap files never written since setup: a new file's zeros come "
                     "back without reading the disk), so the share means nothing. Re-measure with tierstore bench store --json FILE "
                     "and pass runtime.profiler.ceilings_from_store_bench(FILE) as the Profiler's ceilings")


def ceiling_share(rate_gbps: float | None, ceiling_gbps: float | None) -> float | None:
    """rate / ceiling, unclamped (the summary keeps the measured ratio); None without both figures."""
    return rate_gbps / ceiling_gbps if rate_gbps is not None and ceiling_gbps else None


def over_ceiling(share: float | None) -> bool:
    """True when a share is above its ceiling by more than measurement noise: the ceiling is wrong."""
    return share is not None and share > 1.0 + CEILING_NOISE


def share_text(share: float | None, none: str = "-") -> str:
    """A share as a person reads it: "87%", "100%" for one within the noise above it, ">100%!" beyond."""
    if share is None:
        return none
    if over_ceiling(share):
        return OVER_CEILING_MARK
    return format(min(share, 1.0), ".0%")
