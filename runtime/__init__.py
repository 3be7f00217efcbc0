"""tierstore's runtime: offload an nn.Module's training state across GPU, pinned host memory and NVMe.

    from runtime import offload, load_config
    model, optimizer = offload(model, load_config("tiers.yaml"))

The packages, each importing only those below it (checked by ``lint-imports``; ``docs/design.md`` has the map):
``cli`` > ``bench`` > ``profiler`` > ``checkpoint`` > ``session`` > ``integrations`` > ``model`` > ``engine`` >
``update`` > ``planning`` > ``config`` > ``core`` and ``bundled``.
"""

from runtime.checkpoint import CheckpointError, CheckpointRoot, bench_checkpoint, load_checkpoint, save_checkpoint
from runtime.config import ConfigError, TierstoreConfig, load_config
from runtime.session import OffloadSession, offload

__all__ = ["CheckpointError", "CheckpointRoot", "ConfigError", "OffloadSession", "TierstoreConfig", "bench_checkpoint", "load_checkpoint",
           "load_config", "offload", "save_checkpoint"]
