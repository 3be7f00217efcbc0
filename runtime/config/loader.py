"""Strict loading, validation and dumping of tierstore YAML configs.

This is the only module that reads YAML. A config is refused, with the YAML path and the 1-based
line of the culprit, when it holds an unknown or duplicate key, a value of the wrong type or out
of range, or settings that contradict each other; nothing the user wrote is silently dropped.

Scalars are read with YAML 1.2 core rules rather than PyYAML's YAML 1.1 defaults: only
``true``/``false`` are booleans (so ``direct_io: off`` is the text ``off``), ``1e-3`` is a number,
and there are no sexagesimal (``1:30``) or leading-zero octal (``010``) integers.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import stat
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from runtime.config.schema import (
    REFERENCE_INTRO,
    BlocksConfig,
    GpuTierConfig,
    HostTierConfig,
    LossScaleConfig,
    ModelConfig,
    NvmeTierConfig,
    OptimizerConfig,
    PlacementConfig,
    PrefetchConfig,
    ProfileConfig,
    TiersConfig,
    TierstoreConfig,
    TrainConfig,
    consistency_problems,
    join_path,
    reference_tables,
    unknown_key_message,
)
from runtime.config.units import Spec, SpecError, describe_value, parse_size
from tierstore import shared_directory_problem

__all__ = [
    "BlocksConfig",
    "ConfigError",
    "GpuTierConfig",
    "HostTierConfig",
    "LossScaleConfig",
    "ModelConfig",
    "NvmeTierConfig",
    "OptimizerConfig",
    "PlacementConfig",
    "PrefetchConfig",
    "ProfileConfig",
    "TiersConfig",
    "TierstoreConfig",
    "TrainConfig",
    "check_environment",
    "config_reference_markdown",
    "dump_config",
    "load_config",
    "parse_size",
]

logger = logging.getLogger(__name__)

ROOT = "<root>"
_KINDS = frozenset({"unknown_key", "duplicate_key", "wrong_type", "out_of_range", "bad_value",
                    "missing_key", "empty", "not_mapping", "yaml_syntax", "environment"})
# Bounds on what a config document may expand to: aliases can make a tiny file enormous.
_MAX_NODES = 100_000
_MAX_DEPTH = 64


class ConfigError(ValueError):
    """A config that cannot be used, located by YAML path and line.

    Attributes:
        message: what is wrong and what to write instead.
        yaml_path: dotted path of the culprit, e.g. ``tiers.nvme.io_threads``, or ``<root>``.
        line: 1-based line in the YAML file, or None (dict input, or no single line applies).
        kind: one of ``unknown_key``, ``duplicate_key``, ``wrong_type``, ``out_of_range``,
            ``bad_value``, ``missing_key``, ``empty``, ``not_mapping``, ``yaml_syntax``,
            ``environment``.
        source: the file the config came from, or None for dict input.
    """

    def __init__(self, message: str, yaml_path: str = ROOT, line: int | None = None,
                 kind: str = "bad_value", source: str | None = None) -> None:
        if kind not in _KINDS:
            raise RuntimeError(f"ConfigError kind {kind!r} is not one of {sorted(_KINDS)}")
        self.message = message
        self.yaml_path = yaml_path
        self.line = line
        self.kind = kind
        self.source = source
        super().__init__(str(self))

    def __str__(self) -> str:
        where = self.source or ""
        if self.line is not None:
            where = f"{where}:{self.line}" if where else f"line {self.line}"
        prefix = f"{where}: " if where else ""
        return f"{prefix}{self.yaml_path}: {self.message}"

    def __reduce__(self) -> tuple[Any, ...]:
        # Keep the attributes across pickling (e.g. from a worker process).
        return (ConfigError, (self.message, self.yaml_path, self.line, self.kind, self.source))


# --------------------------------------------------------------------------------------------
# YAML 1.2 core schema for plain scalars, shared by the loader and the dumper so that whatever
# the dumper leaves unquoted reads back as the same type.

_CORE_RESOLVERS: list[tuple[str, str, list[str]]] = [
    ("tag:yaml.org,2002:null", r"^(?:~|null|Null|NULL|)$", ["~", "n", "N", ""]),
    ("tag:yaml.org,2002:bool", r"^(?:true|True|TRUE|false|False|FALSE)$", list("tTfF")),
    ("tag:yaml.org,2002:int", r"^(?:[-+]?[0-9]+|0o[0-7]+|0x[0-9a-fA-F]+)$", list("-+0123456789")),
    ("tag:yaml.org,2002:float",
     r"^(?:[-+]?(?:\.[0-9]+|[0-9]+(?:\.[0-9]*)?)(?:[eE][-+]?[0-9]+)?"
     r"|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$", list("-+.0123456789")),
]


def _install_core_resolvers(cls: type[Any]) -> None:
    """Replace the YAML 1.1 implicit resolvers of ``cls`` by the YAML 1.2 core ones."""
    cls.yaml_implicit_resolvers = {}
    for tag, pattern, first in _CORE_RESOLVERS:
        cls.add_implicit_resolver(tag, re.compile(pattern), first)


class _Loader(yaml.SafeLoader):
    """SafeLoader with YAML 1.2 core scalars."""


class _Dumper(yaml.SafeDumper):
    """SafeDumper that quotes exactly the strings :class:`_Loader` would read as non-text."""


_install_core_resolvers(_Loader)
_install_core_resolvers(_Dumper)


def _construct_core_int(loader: yaml.SafeLoader, node: yaml.ScalarNode) -> int:
    # PyYAML's int constructor reads "010" as octal and "1:30" as base 60 (YAML 1.1).
    text = str(loader.construct_scalar(node)).replace("_", "")
    body = text.lstrip("+-")
    sign = -1 if text.startswith("-") else 1
    if body.startswith("0o"):
        return sign * int(body[2:], 8)
    if body.startswith("0x"):
        return sign * int(body[2:], 16)
    return sign * int(body, 10)


_Loader.add_constructor("tag:yaml.org,2002:int", _construct_core_int)


# --------------------------------------------------------------------------------------------
# Reading: YAML nodes -> plain data plus the line of every key and value.

@dataclasses.dataclass
class _Context:
    """Where a config came from, and the lines of its keys and values by YAML path."""

    source: str | None = None
    key_lines: dict[str, int] = dataclasses.field(default_factory=dict)
    value_lines: dict[str, int] = dataclasses.field(default_factory=dict)
    nodes_seen: int = 0

    def line(self, *paths: str, key: bool = False) -> int | None:
        """Return the line of the first of ``paths`` written in the file (key or value line)."""
        lines = self.key_lines if key else self.value_lines
        for path in paths:
            if path in lines:
                return lines[path]
        return None

    def error(self, kind: str, path: str, message: str, *, key: bool = False,
              line_paths: tuple[str, ...] = ()) -> ConfigError:
        """Build a ConfigError for ``path``, located at its line (or the first of line_paths)."""
        return ConfigError(message, path, self.line(path, *line_paths, key=key), kind,
                           self.source)


def _node_line(node: yaml.Node) -> int:
    return node.start_mark.line + 1


def _to_plain(node: yaml.Node, path: str, loader: _Loader, ctx: _Context,
              stack: tuple[int, ...] = ()) -> object:
    """Convert a composed node to plain data, recording lines and refusing duplicate keys."""
    ctx.nodes_seen += 1
    if ctx.nodes_seen > _MAX_NODES or len(stack) > _MAX_DEPTH:
        raise ConfigError("the document is too large or too deeply nested (aliases expand to "
                          f"more than {_MAX_NODES} values)", path or ROOT, _node_line(node),
                          "bad_value", ctx.source)
    if isinstance(node, yaml.ScalarNode):
        try:
            return loader.construct_object(node, deep=True)
        except (yaml.YAMLError, ValueError) as exc:
            # Only the problem: PyYAML's full text repeats the file and line over several lines.
            reason = exc.problem if isinstance(exc, yaml.MarkedYAMLError) else str(exc)
            raise ConfigError(f"cannot read the value {node.value!r}: {reason}", path or ROOT,
                              _node_line(node), "bad_value", ctx.source) from None
    if id(node) in stack:
        raise ConfigError("a YAML alias refers to a collection that contains it", path or ROOT,
                          _node_line(node), "bad_value", ctx.source)
    expected_tag = "map" if isinstance(node, yaml.MappingNode) else "seq"
    if node.tag != f"tag:yaml.org,2002:{expected_tag}":
        raise ConfigError(f"unsupported YAML tag {node.tag}; remove it", path or ROOT,
                          _node_line(node), "bad_value", ctx.source)
    inner = (*stack, id(node))
    if isinstance(node, yaml.SequenceNode):
        items = []
        for index, item in enumerate(node.value):
            sub = f"{path}[{index}]"
            ctx.key_lines.setdefault(sub, _node_line(item))
            ctx.value_lines.setdefault(sub, _node_line(item))
            items.append(_to_plain(item, sub, loader, ctx, inner))
        return items
    mapping: dict[str, object] = {}
    first_line: dict[str, int] = {}
    for key_node, value_node in node.value:
        if not isinstance(key_node, yaml.ScalarNode):
            raise ConfigError("a key must be a plain name, not a list or mapping",
                              path or ROOT, _node_line(key_node), "unknown_key", ctx.source)
        # The key's text as written: `on:` is the key "on", not the boolean true.
        key = str(key_node.value)
        sub = join_path(path, key)
        if key in first_line:
            raise ConfigError(
                f"duplicate key `{key}` (first on line {first_line[key]}); YAML would silently "
                "keep only the last one. Remove one of them.",
                sub, _node_line(key_node), "duplicate_key", ctx.source)
        first_line[key] = _node_line(key_node)
        ctx.key_lines[sub] = _node_line(key_node)
        ctx.value_lines[sub] = _node_line(value_node)
        mapping[key] = _to_plain(value_node, sub, loader, ctx, inner)
    return mapping


def _syntax_error(exc: Exception, text: str, source: str) -> ConfigError:
    line: int | None = None
    if isinstance(exc, yaml.MarkedYAMLError) and exc.problem_mark is not None:
        line = exc.problem_mark.line + 1
        message = "YAML syntax error: " + (exc.problem or str(exc))
        if exc.context:
            message += f" ({exc.context}"
            if exc.context_mark is not None:
                message += f" on line {exc.context_mark.line + 1}"
            message += ")"
    elif isinstance(exc, yaml.reader.ReaderError):
        line = text.count("\n", 0, exc.position) + 1
        message = f"YAML syntax error: {exc.reason} (character {exc.character!r})"
    else:
        message = f"YAML syntax error: {exc}"
    if "\\t" in message or "'\t'" in message:
        message += "; YAML does not allow tabs for indentation, use spaces"
    return ConfigError(message, ROOT, line, "yaml_syntax", source)


def _read_yaml(path: str | os.PathLike[str], ctx: _Context) -> object:
    """Read the YAML file at ``path`` into plain data, filling ``ctx`` with lines."""
    source = os.fspath(path)
    try:
        data = Path(source).read_bytes()
    except (OSError, ValueError) as exc:
        hint = (" load_config takes a file path or an already-parsed dict, not YAML text."
                if "\n" in source else "")
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise ConfigError(f"cannot read the config file {source!r}: {reason}.{hint}", ROOT, None,
                          "environment", None if hint else source) from None
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        raise ConfigError("the file is not UTF-8 text", ROOT, line, "yaml_syntax",
                          source) from None
    try:
        # The reader checks for forbidden characters as soon as the loader is built.
        loader = _Loader(text)
        node = loader.get_single_node()
    except yaml.YAMLError as exc:
        raise _syntax_error(exc, text, source) from None
    except RecursionError:
        raise ConfigError("YAML syntax error: the document is nested too deeply", ROOT, None,
                          "yaml_syntax", source) from None
    try:
        if node is None:
            raise ConfigError("the config file is empty; write `{}` to use all defaults", ROOT,
                              None, "empty", source)
        if not isinstance(node, yaml.MappingNode):
            raise ConfigError(
                "the top level must be a mapping of sections (e.g. `tiers:`, `optimizer:`), got "
                f"{_node_kind(node)}", ROOT, _node_line(node), "not_mapping", source)
        return _to_plain(node, "", loader, ctx)
    finally:
        loader.dispose()


def _node_kind(node: yaml.Node) -> str:
    if isinstance(node, yaml.SequenceNode):
        return "a list"
    return f"the value {node.value!r}"


# --------------------------------------------------------------------------------------------
# Validation: plain data -> frozen dataclasses.

def _inline_yaml(value: object) -> str:
    """Render a plain value the way it would be written after a key on one line."""
    text = yaml.dump(value, Dumper=_Dumper, default_flow_style=True, allow_unicode=True,
                     width=10_000)
    return text.removesuffix("\n").removesuffix("\n...").strip()


def _example(f: dataclasses.Field[Any]) -> str:
    spec: Spec = f.metadata["spec"]
    example = f.metadata.get("example")
    if example is None:
        example = None if f.default is None else spec.to_plain(f.default)
    return f"Write e.g. `{f.name}: {_inline_yaml(example)}`."


def _finish(message: str, hint: str) -> str:
    return f"{message}{'' if message.endswith(('.', '?', '!')) else '.'} {hint}"


def _build_leaf(f: dataclasses.Field[Any], value: object, path: str, ctx: _Context) -> object:
    spec: Spec = f.metadata["spec"]
    if value is None:
        if spec.nullable:
            return None
        raise ctx.error("wrong_type", path, _finish(
            f"expected {spec.describe()}, got null (an empty value)", _example(f)))
    try:
        return spec.check(value)
    except SpecError as exc:
        where = path if exc.index is None else f"{path}[{exc.index}]"
        raise ctx.error(exc.kind, where, _finish(exc.message, exc.hint or _example(f)),
                        line_paths=(path,)) from None


def _build_section(cls: type, raw: object, path: str, ctx: _Context) -> Any:
    """Validate ``raw`` against section ``cls``; a section written empty takes its defaults."""
    if raw is None:
        return cls()
    if not isinstance(raw, Mapping):
        names = ", ".join(f.name for f in dataclasses.fields(cls))
        kind = "not_mapping" if not path else "wrong_type"
        raise ctx.error(kind, path or ROOT,
                        f"expected a mapping with keys among {names}; got {describe_value(raw)}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    values: dict[str, object] = {}
    for key, value in raw.items():
        sub = join_path(path, str(key))
        if not isinstance(key, str) or key not in fields:
            raise ctx.error("unknown_key", sub, unknown_key_message(key, cls, path), key=True)
        f = fields[key]
        section = f.metadata.get("section")
        values[key] = (_build_section(section, value, sub, ctx) if section is not None
                       else _build_leaf(f, value, sub, ctx))
    return cls(**values)


# --------------------------------------------------------------------------------------------
# Environment checks: the file system behind the NVMe tier.

def _env_error(message: str) -> ConfigError:
    return ConfigError(message, "tiers.nvme.path", None, "environment")


def check_environment(cfg: TierstoreConfig) -> None:
    """Check that ``tiers.nvme.path`` is a safe, usable directory for swap files.

    Does nothing when the NVMe tier is disabled (null) or uses a fresh temporary directory
    (``tmp``). Otherwise the directory must exist, be a directory, be writable and searchable by
    this process, be ours and writable by nobody else (another user could plant links or replace
    swap files; a sticky bit does not prevent that), and neither contain nor lie inside ``train.checkpoint_dir``.

    Raises:
        ConfigError: of kind ``environment`` at ``tiers.nvme.path``, saying what to do.
    """
    path = cfg.tiers.nvme.path
    if path is None or path == "tmp":
        return
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise _env_error(f"the NVMe directory {path!r} does not exist. Create it "
                         f"(`mkdir -p {path}`), or write `path: tmp` for a temporary "
                         "directory.") from None
    except (OSError, ValueError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise _env_error(f"cannot use the NVMe directory {path!r}: {reason}.") from None
    if not stat.S_ISDIR(st.st_mode):
        raise _env_error(f"{path!r} is not a directory; tiers.nvme.path names the directory "
                         "that will hold the swap files.")
    if os.statvfs(path).f_flag & os.ST_RDONLY:  # access() says "not writable" too; chmod would not help
        raise _env_error(f"the NVMe directory {path!r} is on a read-only file system; pick a directory on a "
                         "writable one (fast local storage: an NVMe drive, or `path: tmp`).")
    if not os.access(path, os.W_OK | os.X_OK):
        raise _env_error(f"the NVMe directory {path!r} is not writable by this user (uid "
                         f"{os.getuid()}). Fix its permissions (`chmod u+wx {path}`) or choose "
                         "another directory.")
    problem = shared_directory_problem(st)  # a sticky bit does not stop planted links: refused too
    if problem is not None:
        raise _env_error(f"the NVMe directory {path!r} {problem}, so another user could plant links "
                         f"or replace swap files there. Use a private subdirectory (`mkdir -m 700 {path}/mine`"
                         f"{_own_chmod_hint(st, path)}), or write `path: tmp`.")
    checkpoint_dir = cfg.train.checkpoint_dir
    if checkpoint_dir is not None:
        swap = Path(os.path.realpath(path))
        ckpt = Path(os.path.realpath(checkpoint_dir))
        if swap == ckpt or swap.is_relative_to(ckpt) or ckpt.is_relative_to(swap):
            raise _env_error(f"tiers.nvme.path {path!r} and train.checkpoint_dir "
                             f"{checkpoint_dir!r} overlap; swap files are a disposable cache "
                             "and must not mix with checkpoints. Use two separate directories.")


# --------------------------------------------------------------------------------------------
# Public entry points.

def _apply_overrides(raw: dict[str, object], overrides: Mapping[str, object],
                     ctx: _Context) -> dict[str, object]:
    """Set dotted-path ``overrides`` in a copy of ``raw``; their values carry no line."""
    result = dict(raw)
    for dotted, value in overrides.items():
        parts = str(dotted).split(".")
        node = result
        for depth, part in enumerate(parts[:-1]):
            child = node.get(part)
            prefix = ".".join(parts[:depth + 1])
            if child is None:
                child = {}
            elif not isinstance(child, Mapping):
                raise ConfigError(f"cannot set override {dotted!r}: {prefix} is not a section",
                                  prefix, None, "wrong_type", "override")
            node[part] = child = dict(child)
            node = child
        node[parts[-1]] = value
        # An overridden value is no longer the one on the file's line.
        for lines in (ctx.key_lines, ctx.value_lines):
            for key in [k for k in lines if k == dotted or k.startswith(f"{dotted}.")
                        or k.startswith(f"{dotted}[")]:
                del lines[key]
    return result


def _written(raw: object, dotted: str) -> bool:
    """Whether the config as given (file and overrides) sets the dotted path ``dotted``."""
    node = raw
    for part in dotted.split("."):
        if not isinstance(node, Mapping) or part not in node:
            return False
        node = node[part]
    return True


def load_config(source: str | os.PathLike[str] | Mapping[str, Any] | None = None, *,
                overrides: Mapping[str, object] | None = None) -> TierstoreConfig:
    """Load and validate a tierstore config.

    Args:
        source: a path to a YAML file (a ``str`` is always a path, never YAML text), an
            already-parsed mapping (validated the same way; errors carry no line), or None for
            all defaults.
        overrides: optional dotted-path settings applied on top of ``source`` before
            validation, e.g. ``{"train.steps": 10}`` (what the CLI flags set).

    Returns:
        The validated, frozen :class:`TierstoreConfig`.

    Raises:
        ConfigError: for anything wrong with the config or, when ``tiers.nvme.path`` names a
            directory, with that directory (see :func:`check_environment`).
        TypeError: if ``source`` is of another type.
    """
    ctx = _Context()
    raw: object
    if source is None:
        raw = {}
    elif isinstance(source, (str, os.PathLike)):
        ctx.source = os.fspath(source)
        raw = _read_yaml(source, ctx)
    elif isinstance(source, Mapping):
        raw = source
    else:
        raise TypeError(f"load_config takes a path, a dict or None, not {type(source).__name__}")
    if overrides:
        if not isinstance(raw, Mapping):
            raise ctx.error("not_mapping", ROOT, f"the top level must be a mapping, got "
                            f"{describe_value(raw)}")
        raw = _apply_overrides(dict(raw), overrides, ctx)
    cfg: TierstoreConfig = _build_section(TierstoreConfig, raw, "", ctx)
    problems = consistency_problems(cfg, written=lambda dotted: _written(raw, dotted))
    if problems:
        first = problems[0]
        raise ctx.error(first.kind, first.path, first.message, line_paths=first.line_paths)
    if cfg.dtype != "fp16" and cfg.optimizer.loss_scale != LossScaleConfig():
        # Not an error: switching dtype back and forth should not force editing this section.
        logger.warning("optimizer.loss_scale is set but dtype is %s; loss scaling applies to "
                       "fp16 only and is ignored", cfg.dtype)
    try:
        check_environment(cfg)
    except ConfigError as exc:
        raise ConfigError(exc.message, exc.yaml_path, ctx.line(exc.yaml_path), exc.kind,
                          ctx.source) from None
    logger.debug("loaded config from %s", ctx.source or "a mapping")
    return cfg


def _plain(obj: Any) -> dict[str, object]:
    """The config as plain YAML-ready data, in schema order."""
    out: dict[str, object] = {}
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if "section" in f.metadata:
            out[f.name] = _plain(value)
        else:
            out[f.name] = None if value is None else f.metadata["spec"].to_plain(value)
    return out


def dump_config(cfg: TierstoreConfig) -> str:
    """Return ``cfg`` as YAML text that :func:`load_config` reads back to an equal config.

    Every field is written, sizes in the largest exact binary unit (``64MiB``).
    """
    if not isinstance(cfg, TierstoreConfig):
        raise TypeError(f"dump_config takes a TierstoreConfig, not {type(cfg).__name__}")
    body = yaml.dump(_plain(cfg), Dumper=_Dumper, sort_keys=False, default_flow_style=None,
                     allow_unicode=True, width=100)
    return "# tierstore config; reference: docs/config.md\n" + body


def config_reference_markdown() -> str:
    """Return the config reference (``docs/config.md``), generated from the schema."""
    out = [REFERENCE_INTRO.rstrip("\n")]
    out.extend(reference_tables(_inline_yaml))
    out.append("\n## Defaults as YAML\n\n```yaml\n" + dump_config(TierstoreConfig()) + "```")
    return "\n".join(out) + "\n"


def _own_chmod_hint(st: os.stat_result, path: str) -> str:
    """The chmod that would make a directory private, offered only for one of this user's without the sticky bit:
    a sticky directory (/tmp) is shared on purpose, and taking its write bits away would break the system."""
    if st.st_uid == os.geteuid() and not st.st_mode & stat.S_ISVTX:
        return f"; or, if nobody else needs it, `chmod go-w {path}`"
    return ""
