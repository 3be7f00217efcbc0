"""Spilled moments brought back into pinned memory, as far as the arena's room allows.

A plan whose pinned memory cannot hold every block's Adam moments keeps some blocks' on NVMe (``placement.moments:
auto``, ``runtime.planning.memory_plan.spill_moments``). When a placement adopted between steps moves the first blocks' state to
the GPU (``Controller.adopt_placement``, after the measured first step: ``runtime.planning.measured_placement``), the pinned
memory their master, moments and host gradient leave can hold spilled moments again: this module makes pinned
memory their home (``TierStore.move_home``: read from NVMe, the swap file dropped).

The arena places first fit, so room by bytes is not room by ranges: a block comes back only where both its moments
and the staging room of the blocks left on NVMe (``STAGING_BLOCKS`` of them, each moment as large as the largest
left: what their reads during the step allocate, ``runtime.update.worker``) can still be placed
(``RangeAllocator.could_place``). The controller packs the blocks' pinned state at the arena's end in forward order
(``PinnedArena.packed_at_end``), so the room the first blocks leave is one range with the arena's free room: laid out
from the arena's start, at 8B the embedding's state left 2.1 GB holes that hold two 0.87 GB moments and 0.36 GB that
nothing of that size used, and 6 of the 7 blocks the plan asked back came.

What it leaves out: deciding which blocks may come back (the adopted placement's plan: ``runtime.session``), moving
other state to pack the arena, and spilling more (the spill only shrinks between steps).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from runtime.core.blocks import Block
from runtime.planning.memory_plan import MOMENT_KINDS, STAGING_BLOCKS
from tierstore import TierName, TierStore

log = logging.getLogger(__name__)


def bring_moments_home(store: TierStore, blocks: Sequence[Block], indices: list[int],
                       staying: frozenset[int]) -> frozenset[int]:
    """Make pinned memory the home of these spilled blocks' moments again (read from NVMe), the largest blocks first,
    while the pinned arena can place them and still hold the staging room that the blocks left on NVMe need (counted
    for every block not yet brought back, which stays on NVMe should a later one not fit). ``staying``: the blocks
    whose moments stay on NVMe in any case. Stops at the first block that does not fit or cannot be read (its
    moments stay on NVMe; the log says so): it never raises. Between steps only (no copy of a moment in use).
    Returns the blocks whose moments stay on NVMe."""
    arena = store.tiers[TierName.HOST].arena  # the host tier is a HostTier
    still = set(staying) | set(indices)
    brought: list[int] = []
    # Largest first: while a large block waits its turn, every check counts staging room of its size.
    for index in sorted(indices, key=lambda i: (-blocks[i].numel, i)):
        still.discard(index)
        keys = [blocks[index].key(kind) for kind in MOMENT_KINDS]
        # one moment's stored bytes (optimizer.moment_dtype's), as each staging room holds one
        largest = max((store.record(blocks[i].key(MOMENT_KINDS[0])).meta.nbytes for i in still), default=0)
        room = [largest] * (len(MOMENT_KINDS) * min(STAGING_BLOCKS, len(still)))
        if not arena.could_place([store.record(key).meta.nbytes for key in keys] + room):
            still.add(index)
            break
        if not _move_both(store, blocks[index], keys, TierName.HOST):
            still.add(index)
            break
        brought.append(index)
    if indices:
        log.info("%d of the %d spilled blocks asked back have their moments in pinned memory again (read from NVMe); "
                 "%d blocks' moments stay on NVMe", len(brought), len(indices), len(still))
    return frozenset(still)


def _move_both(store: TierStore, block: Block, keys: list[str], to: TierName) -> bool:
    """Move one block's moments home to tier ``to``, both or neither: True when both moved. A failure (no room, a read
    error) moves back the one that had; should that fail too, the block's moments live in two tiers, which the
    updates allow (each key is read from its own home), and the log says so."""
    moved: list[tuple[str, TierName]] = []
    try:
        for key in keys:
            home = store.record(key).home
            store.move_home(key, to)
            moved.append((key, home))
    except Exception as error:
        log.warning("%s's moments stay where they were: moving them to %s failed (%r)", block.name, to.value, error)
        for key, home in moved:
            try:
                store.move_home(key, home)
            except Exception as undo_error:
                log.warning("%s stays in %s: moving it back to %s failed too (%r)", key, to.value, home.value,
                            undo_error)
        return False
    return True
