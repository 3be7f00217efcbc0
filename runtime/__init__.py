"""tierstore's runtime: offload an nn.Module's training state across GPU, pinned host memory and NVMe.

    from runtime import offload, load_config
    model, optimizer = offload(model, load_config("tiers.yaml"))
"""

from runtime.api import OffloadSession, offload
from runtime.config import ConfigError, TierstoreConfig, load_config

__all__ = ["ConfigError", "OffloadSession", "TierstoreConfig", "load_config", "offload"]
