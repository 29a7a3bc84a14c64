"""The KV layout both connector halves key and check blocks by (L2, no torch).

Named from the resolved EngineConfig (engine/setup.resolve_config) and the model's shape
alone, so the EngineCore's scheduler half needs neither the worker nor a kernel to name it.
"""

from __future__ import annotations

from dataclasses import dataclass

from tokenbus.config import EngineConfig, ModelArch

# Bytes per element of each K/V dtype a resolved config may name (config.KV_CACHE_DTYPES).
KV_ITEMSIZES = {"float32": 4, "float16": 2, "bfloat16": 2}


@dataclass(frozen=True)
class KVLayout:
    """What must agree for two pools' blocks to be interchangeable (and what keys a store)."""

    model: str  # the model's path or name
    dtype: str  # torch dtype name of the K/V tensors
    quantization: str  # weights decide the K/V values: dequantized and quantized differ slightly
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    # "files", or "dummy seed N" (--load-format dummy): random weights' K/V match no one else's.
    weights: str = "files"

    @property
    def block_nbytes(self) -> int:
        """Bytes of one block's K/V over every layer: [num_layers, 2, block_size, Hkv, D]."""
        itemsize = KV_ITEMSIZES[self.dtype]
        return self.num_layers * 2 * self.block_size * self.num_kv_heads * self.head_dim * itemsize

    def describe(self) -> dict:
        return dict(self.__dict__)

    def fingerprint(self) -> str:
        """A short stable name for this layout (a directory per layout in a store)."""
        import hashlib
        import json

        encoded = json.dumps(self.describe(), sort_keys=True).encode()
        return hashlib.sha256(encoded).hexdigest()[:16]

    def mismatch(self, other: dict) -> str | None:
        """A sentence naming the fields where `other` (a peer's describe()) differs, or None."""
        mine = self.describe()
        diffs = [
            f"{key}: ours {mine[key]!r}, theirs {other.get(key)!r}"
            for key in mine
            if other.get(key) != mine[key]
        ]
        return "; ".join(diffs) or None


def kv_layout(config: EngineConfig, arch: ModelArch) -> KVLayout:
    """The layout of a resolved config's pool; `arch`: the shape this rank's pool holds."""
    if unresolved := config.unresolved_settings():
        raise ValueError(f"a KV layout needs a resolved config; still auto: {unresolved}")
    return KVLayout(
        model=config.model.model or "smollm2",
        dtype=config.cache.kv_cache_dtype,
        quantization=config.model.quantization,
        block_size=config.cache.block_size,
        num_layers=arch.num_hidden_layers,
        num_kv_heads=arch.num_key_value_heads,
        head_dim=arch.head_dim,
        weights=(
            f"dummy seed {config.model.seed}" if config.model.load_format == "dummy" else "files"
        ),
    )
