"""The KV layout both connector halves key and check blocks by (L2, no torch).

Named from the resolved EngineConfig (engine/setup.resolve_config) and the model's shape
alone, so the EngineCore's scheduler half needs neither the worker nor a kernel to name it.
"""

from __future__ import annotations

from dataclasses import dataclass

from tokenbus.config import EngineConfig, kv_row_bytes
from tokenbus.model_arch import ModelArch

# The pool tensor's torch dtype (its name) for each K/V dtype a resolved config may name, where
# the two differ (model/kv_quant.py: fp8 as torch's fp8 types, q8_0 rows as bytes).
STORAGE_DTYPES = {"fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2", "q8_0": "uint8"}
KV_ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2}


@dataclass(frozen=True)
class KVLayout:
    """What must agree for two pools' blocks to be interchangeable (and what keys a store)."""

    model: str  # the model's path or name
    dtype: str  # the K/V element type: --kv-cache-dtype, resolved (a torch dtype, fp8_*, q8_0)
    quantization: str  # weights decide the K/V values: dequantized and quantized differ slightly
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    # "files", or "dummy seed N" (--load-format dummy): random weights' K/V match no one else's.
    weights: str = "files"

    @property
    def storage_dtype(self) -> str:
        """The torch dtype name of the pool's tensors (and of blocks read out of them)."""
        return STORAGE_DTYPES.get(self.dtype, self.dtype)

    @property
    def row_width(self) -> int:
        """The pool tensors' last dimension: head_dim, or a q8_0 row's bytes."""
        itemsize = 1 if self.dtype in STORAGE_DTYPES else KV_ITEMSIZE[self.dtype]
        return kv_row_bytes(self.dtype, self.head_dim) // itemsize

    @property
    def block_shape(self) -> list[int]:
        """One block's K/V over every layer: [num_layers, 2, block_size, Hkv, row_width]."""
        return [self.num_layers, 2, self.block_size, self.num_kv_heads, self.row_width]

    @property
    def block_nbytes(self) -> int:
        """Bytes of one block's K/V over every layer (block_shape of storage_dtype)."""
        row_bytes = kv_row_bytes(self.dtype, self.head_dim)
        return self.num_layers * 2 * self.block_size * self.num_kv_heads * row_bytes

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
    if len(set(map(arch.kv_shape, range(arch.num_hidden_layers)))) > 1:
        raise ValueError(
            f"kv_transfer_config: {arch.architecture}'s layers hold K/V of different shapes "
            f"{sorted(set(arch.layer_kv_shapes))} (KV heads, head size); moving or storing "
            "their blocks is not supported"
        )
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
