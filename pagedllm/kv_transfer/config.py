"""The checked ``--kv-transfer-config``: which connector, in which role, with which options."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from pagedllm.errors import InvalidParameterError

CONNECTORS = ("DiskConnector",)
ROLES = ("kv_both", "kv_producer", "kv_consumer")


@dataclass(slots=True, frozen=True)
class KVTransferConfig:
    """The checked ``--kv-transfer-config`` (vLLM's JSON object)."""

    kv_connector: str
    kv_role: str = "kv_both"
    kv_connector_extra_config: dict = field(default_factory=dict)

    @classmethod
    def parse(cls, raw: Any) -> KVTransferConfig | None:
        if raw is None:
            return None
        if isinstance(raw, str):
            try:
                raw = json.loads(raw)
            except json.JSONDecodeError as e:
                raise InvalidParameterError(
                    f"kv_transfer_config is not valid JSON: {e}", "kv_transfer_config"
                ) from None
        if not isinstance(raw, dict):
            raise InvalidParameterError("kv_transfer_config must be a JSON object", "kv_transfer_config")
        raw = dict(raw)
        name = raw.pop("kv_connector", None)
        if name not in CONNECTORS:
            raise InvalidParameterError(
                f"kv_transfer_config.kv_connector: unknown connector {name!r}; available: {', '.join(CONNECTORS)}",
                "kv_transfer_config.kv_connector",
            )
        role = raw.pop("kv_role", "kv_both")
        if role not in ROLES:
            raise InvalidParameterError(
                f"kv_transfer_config.kv_role must be one of {list(ROLES)}, got {role!r}", "kv_transfer_config.kv_role"
            )
        extra = raw.pop("kv_connector_extra_config", {})
        if not isinstance(extra, dict):
            raise InvalidParameterError(
                "kv_transfer_config.kv_connector_extra_config must be a JSON object",
                "kv_transfer_config.kv_connector_extra_config",
            )
        if raw:
            raise InvalidParameterError(
                f"kv_transfer_config: unknown keys {sorted(raw)}; valid: kv_connector, kv_role, "
                "kv_connector_extra_config",
                f"kv_transfer_config.{sorted(raw)[0]}",
            )
        config = cls(name, role, extra)
        config.disk_options()  # raises on a bad option
        return config

    def disk_options(self) -> tuple[str, float]:
        """DiskConnector's (path, max_size_gb)."""
        extra = dict(self.kv_connector_extra_config)
        where = "kv_transfer_config.kv_connector_extra_config"
        path = extra.pop("path", None)
        if not isinstance(path, str) or not path:
            raise InvalidParameterError(
                f"{where}.path: DiskConnector needs the directory to keep blocks in", f"{where}.path"
            )
        size = extra.pop("max_size_gb", 10)
        if isinstance(size, bool) or not isinstance(size, (int, float)) or not size > 0:
            raise InvalidParameterError(f"{where}.max_size_gb must be > 0, got {size!r}", f"{where}.max_size_gb")
        if extra:
            raise InvalidParameterError(
                f"{where}: unknown keys {sorted(extra)}; valid: path, max_size_gb", f"{where}.{sorted(extra)[0]}"
            )
        return path, float(size)
