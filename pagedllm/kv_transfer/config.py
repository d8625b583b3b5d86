"""The checked ``--kv-transfer-config``: which connector, in which role, with which options."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from pagedllm.errors import InvalidParameterError

CONNECTORS = ("DiskConnector", "MooncakeConnector")
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
        if name == "DiskConnector":  # raises on a bad option
            config.disk_options()
        else:
            config.mooncake_options()
        return config

    def mooncake_options(self) -> MooncakeOptions:
        return _mooncake_options(self.kv_connector_extra_config)

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


@dataclass(slots=True, frozen=True)
class MooncakeOptions:
    """MooncakeConnector's ``kv_connector_extra_config``."""

    host: str = "127.0.0.1"  # the address the peer engine reaches this one at (transfer engine and side channel)
    protocol: str = "tcp"  # the Transfer Engine's transport: tcp, or rdma where the NICs have it
    side_channel_port: int = 0  # a producer's release channel (0: any free port; the proxy learns it per request)
    hold_timeout_s: float = 120.0  # a producer frees a finished prefill's blocks if no consumer pulled them by then


def _mooncake_options(extra: dict) -> MooncakeOptions:
    where = "kv_transfer_config.kv_connector_extra_config"
    extra = dict(extra)
    d = MooncakeOptions()
    host = extra.pop("host", d.host)
    if not isinstance(host, str) or not host:
        raise InvalidParameterError(f"{where}.host must be a host name or IP address, got {host!r}", f"{where}.host")
    protocol = extra.pop("protocol", d.protocol)
    if protocol not in ("tcp", "rdma"):
        raise InvalidParameterError(f"{where}.protocol must be tcp or rdma, got {protocol!r}", f"{where}.protocol")
    port = extra.pop("side_channel_port", d.side_channel_port)
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
        raise InvalidParameterError(
            f"{where}.side_channel_port must be a port number (0: any free one), got {port!r}",
            f"{where}.side_channel_port",
        )
    timeout = extra.pop("hold_timeout_s", d.hold_timeout_s)
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
        raise InvalidParameterError(
            f"{where}.hold_timeout_s must be > 0 seconds, got {timeout!r}", f"{where}.hold_timeout_s"
        )
    if extra:
        raise InvalidParameterError(
            f"{where}: unknown keys {sorted(extra)}; valid: host, protocol, side_channel_port, hold_timeout_s",
            f"{where}.{sorted(extra)[0]}",
        )
    return MooncakeOptions(host, protocol, port, float(timeout))
