"""tierstore's runtime: offload an nn.Module's training state across GPU, pinned host memory and NVMe.

    from runtime import offload, load_config
    model, optimizer = offload(model, load_config("tiers.yaml"))
"""

from runtime.api import OffloadSession, offload
from runtime.checkpoint import CheckpointError, CheckpointRoot, bench_checkpoint, load_checkpoint, save_checkpoint
from runtime.config import ConfigError, TierstoreConfig, load_config

__all__ = ["CheckpointError", "CheckpointRoot", "ConfigError", "OffloadSession", "TierstoreConfig", "bench_checkpoint", "load_checkpoint",
           "load_config", "offload", "save_checkpoint"]
