"""Where the Hydra configs live, and turning composed configs into typed dataclasses.

Hydra stays at the edge: entry points compose conf/, call `to_dataclass` for each group and pass
plain dataclasses to the package's functions, which never see an OmegaConf object.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")

PACKAGE_DIR = Path(__file__).resolve().parent


class ConfigError(ValueError):
    """A config value that is not allowed; the message names the key, the value and the rule."""


def config_dir() -> Path:
    """The conf/ directory: packaged inside tinylm/ in a wheel, at the repo root in a checkout."""
    for candidate in (PACKAGE_DIR / "conf", PACKAGE_DIR.parent / "conf"):
        if (candidate / "config.yaml").is_file():
            return candidate
    raise FileNotFoundError(
        f"tinylm's configs were not found in {PACKAGE_DIR / 'conf'} or "
        f"{PACKAGE_DIR.parent / 'conf'}; reinstall tinylm (pip install -e . from a checkout)")


def project_root() -> Path | None:
    """The checkout that holds conf/, or None when tinylm runs from an installed wheel."""
    root = PACKAGE_DIR.parent
    return root if (root / "conf" / "config.yaml").is_file() else None


def shipped_dir(in_checkout: str, in_wheel: str) -> Path:
    """A folder of files tinylm ships: `in_checkout` under the checkout's root, or `in_wheel`
    inside the installed package (pyproject's force-include maps one to the other)."""
    root = project_root()
    return root / in_checkout if root is not None else PACKAGE_DIR / in_wheel


def to_dataclass(cls: type[T], node: Any, prefix: str) -> T:
    """Build dataclass `cls` from a mapping (an OmegaConf node or dict) found at key `prefix`.

    Unknown keys are refused with one line naming them and the allowed keys; the dataclass's own
    __post_init__ checks the values. Errors come out as ConfigError.
    """
    from omegaconf import DictConfig, OmegaConf

    values = OmegaConf.to_container(node, resolve=True) if isinstance(node, DictConfig) else node
    values = dict(values or {})
    allowed = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(set(values) - set(allowed))
    if unknown:
        raise ConfigError(f"unknown config key {', '.join(f'{prefix}.{k}' for k in unknown)}; "
                          f"allowed under {prefix}: {', '.join(allowed)}")
    try:
        return cls(**values)
    except ConfigError:
        raise
    except (TypeError, ValueError) as err:
        raise ConfigError(str(err)) from err
