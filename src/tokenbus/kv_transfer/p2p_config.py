"""P2PConnector's settings and its scheduler → worker metadata (L2); see p2p.py."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import msgspec

DEFAULT_KV_PORT = 14579
LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")


@dataclass(frozen=True)
class P2PSettings:
    """kv_connector_extra_config of the P2PConnector, validated once."""

    host: str
    port: int
    advertise_host: str
    abort_timeout_s: float
    pull_timeout_s: float
    debug_delay_pull_s: float
    # Hosts a decoder may pull from: request params come from clients, and a decoder must not
    # be pointed at arbitrary hosts of its network. "*" allows any.
    peer_hosts: tuple[str, ...] = LOOPBACK_HOSTS

    def allows_peer(self, host: str) -> bool:
        return "*" in self.peer_hosts or host in self.peer_hosts

    @classmethod
    def from_extra(cls, extra: dict, port_offset: int = 0) -> P2PSettings:
        """`port_offset`: data-parallel engine d serves on kv_port + d."""
        host = extra.get("kv_host", "127.0.0.1")
        if not isinstance(host, str) or not host:
            raise ValueError("kv_connector_extra_config.kv_host must be a host name or address")
        port = extra.get("kv_port", DEFAULT_KV_PORT)
        if (
            not isinstance(port, int)
            or isinstance(port, bool)
            or not 0 < port + port_offset < 65536
        ):
            raise ValueError(
                f"kv_connector_extra_config.kv_port must be a port number, got {port!r}"
            )
        port += port_offset
        advertise_host = extra.get("kv_advertise_host", host)
        if not isinstance(advertise_host, str) or not advertise_host:
            raise ValueError(
                "kv_connector_extra_config.kv_advertise_host must be a host name or address"
            )
        peer_hosts = extra.get("kv_peer_hosts", list(LOOPBACK_HOSTS))
        if not isinstance(peer_hosts, list) or not all(
            isinstance(h, str) and h for h in peer_hosts
        ):
            raise ValueError(
                "kv_connector_extra_config.kv_peer_hosts must be a list of host names "
                'or addresses ("*": any)'
            )
        return cls(
            host,
            port,
            advertise_host,
            _seconds(extra, "abort_timeout_s", 120.0, positive=True),
            _seconds(extra, "pull_timeout_s", 10.0, positive=True),
            _seconds(extra, "debug_delay_pull_s", 0.0, positive=False),
            tuple(peer_hosts),
        )


def _seconds(extra: dict, key: str, default: float, positive: bool) -> float:
    value = extra.get(key, default)
    if (
        not isinstance(value, (int, float))
        or isinstance(value, bool)
        or value < 0
        or (positive and value == 0)
    ):
        raise ValueError(
            f"kv_connector_extra_config.{key} must be a "
            f"{'positive' if positive else 'non-negative'} number of seconds, got {value!r}"
        )
    return float(value)


# ---------------------------------------------------------------------- scheduler → worker
class LoadJob(msgspec.Struct, array_like=True):
    """Pull `remote_block_ids` of a prefiller's request into `local_block_ids` (same order)."""

    request_id: str
    local_block_ids: list[int]
    remote_engine_id: str
    remote_host: str
    remote_port: int
    remote_request_id: str
    remote_block_ids: list[int]
    prompt_digest: str  # of the decoder's prompt: the prefiller serves only the same prompt's KV


class SendSpec(msgspec.Struct, array_like=True):
    """A finished prefill's blocks that the prefiller may serve, and its prompt's digest."""

    block_ids: list[int]
    prompt_digest: str


class P2PMeta(msgspec.Struct, array_like=True, omit_defaults=True):
    loads: list[LoadJob] = []  # decoder: new loads
    sends: dict[str, SendSpec] = {}  # prefiller: request id → what it may serve now


def prompt_digest(prompt_token_ids: list[int]) -> str:
    """Names a prompt's tokens. A decoder's params come from a client, which could pair one
    prompt with another's prefill: the prefiller compares digests and refuses a mismatch."""
    return hashlib.sha256(msgspec.msgpack.encode(prompt_token_ids)).hexdigest()
