"""tierstore's YAML configuration: the schema, the kinds of values, the strict loader.

Owns: the frozen dataclasses of the schema with each field's spec and doc (``schema``), value kinds such as
byte sizes (``units``), and loading, validating and dumping a config with the file's line in every refusal
(``loader``). Leaves out: what a value means for placement (``planning``) or a step (``engine``); it imports
no other runtime package.
"""

from runtime.config.loader import ConfigError, TierstoreConfig, config_reference_markdown, load_config

__all__ = ["ConfigError", "TierstoreConfig", "config_reference_markdown", "load_config"]
