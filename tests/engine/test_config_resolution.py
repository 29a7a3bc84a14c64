"""Every `auto` resolved once, into the frozen EngineConfig (engine/setup.resolve_config): what the
workers, the scheduler and the connectors read are facts, and naming a KV layout on the
scheduler side needs neither the worker nor torch."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import textwrap

import pytest

from tests.fixtures.tiny_gguf import write_gguf
from tests.fixtures.tiny_models import cached_tiny_model
from tokenbus.config import RESOLVED_SETTINGS, EngineConfig
from tokenbus.engine.setup import resolve_config
from tokenbus.engine_args import EngineArgs
from tokenbus.loader import resolve_model


@pytest.fixture(scope="module")
def gguf_source(tmp_path_factory):
    hf = cached_tiny_model("llama", hidden_size=256, intermediate_size=512)
    path = write_gguf(hf, tmp_path_factory.mktemp("gguf") / "tiny-q8_0.gguf", "Q8_0")
    return resolve_model(str(path))


def autos_left(config: EngineConfig) -> list[str]:
    """Every field of every sub-config still "auto", by "part.name"."""
    return [
        f"{part.name}.{f.name}"
        for part in dataclasses.fields(config)
        if dataclasses.is_dataclass(sub := getattr(config, part.name))
        for f in dataclasses.fields(sub)
        if getattr(sub, f.name) == "auto"
    ]


@pytest.mark.parametrize("kind", ["gguf", "hf"])
def test_a_resolved_config_has_no_auto_left(kind, gguf_source):
    source = gguf_source if kind == "gguf" else resolve_model(str(cached_tiny_model("llama")))
    config = EngineArgs(model=str(source.path)).to_config(256)
    assert len(config.unresolved_settings()) == len(RESOLVED_SETTINGS)
    resolved = resolve_config(config, source)
    assert resolved.unresolved_settings() == []
    # quant_activations' auto picks per call size (int16, bf16 for large calls on bf16 CPUs).
    assert autos_left(resolved) == ["model.quant_activations"]
    model, cache = resolved.model, resolved.cache
    assert model.device == "cpu" or model.device.startswith("cuda")
    assert model.dtype in ("float32", "bfloat16")
    assert model.quantization in ("gguf", "none")
    assert model.attention_backend in ("native", "torch")
    assert cache.kv_cache_dtype in ("float32", "float16", "bfloat16")
    # Everything else is the user's config, untouched.
    assert dataclasses.replace(
        resolved, model=config.model, cache=config.cache
    ) == dataclasses.replace(config)


def test_resolution_on_cpu_follows_the_documented_defaults(gguf_source):
    """A GGUF on CPU in float32: blocks kept quantized where the kernels build, then fp16 K/V."""
    config = resolve_config(
        EngineArgs(model=str(gguf_source.path), device="cpu").to_config(256), gguf_source
    )
    assert (config.model.device, config.model.dtype) == ("cpu", "float32")
    expected_kv = "float16" if config.model.quantization == "gguf" else "float32"
    assert config.cache.kv_cache_dtype == expected_kv
    dense = resolve_config(
        EngineArgs(model=str(gguf_source.path), device="cpu", quantization="none").to_config(256),
        gguf_source,
    )
    assert (dense.model.quantization, dense.cache.kv_cache_dtype) == ("none", "float32")
    explicit = EngineArgs(
        device="cpu", dtype="bfloat16", attention_backend="torch", kv_cache_dtype="bfloat16"
    ).to_config(256)
    resolved = resolve_config(explicit, None)  # no weights (the fake engines of tests)
    assert resolved.model.quantization == "none"
    assert (resolved.model.dtype, resolved.model.attention_backend) == ("bfloat16", "torch")
    assert resolved.cache.kv_cache_dtype == "bfloat16"


def test_the_worker_refuses_an_unresolved_config():
    from tests.fixtures.engine import make_fake_setup
    from tokenbus.worker.worker import Worker

    setup = make_fake_setup()
    with pytest.raises(ValueError, match=r"resolved config .*model\.device"):
        Worker(setup.config, None, setup.arch, None)


def test_the_scheduler_side_names_a_kv_layout_without_the_worker(tmp_path):
    """EngineCore's scheduler connector and its layout, in a fresh interpreter: no module of
    tokenbus.worker is imported on the way; the layout module itself needs no torch."""
    script = textwrap.dedent(
        f"""
        import sys
        from tokenbus.config import KVTransferConfig
        from tokenbus.model_arch import ModelArch
        from tokenbus.engine_args import EngineArgs
        from tokenbus.kv_transfer.layout import kv_layout

        args = EngineArgs(
            device="cpu", dtype="float32", quantization="none", attention_backend="torch",
            kv_cache_dtype="float32", load_format="safetensors",
        )
        arch = ModelArch("llama", 100, 8, 16, 1, 1, 1, 8, 1024)
        layout = kv_layout(args.to_config(256), arch)
        assert "torch" not in sys.modules, "the layout imported torch"
        assert layout.dtype == "float32" and layout.quantization == "none"

        from tokenbus.engine.core import _make_scheduler_connector
        from tokenbus.engine.setup import resolve_config

        kv = KVTransferConfig(
            "SharedStorageConnector",
            kv_connector_extra_config={{"shared_storage_path": {str(tmp_path)!r}}},
        )
        args.kv_transfer_config = kv
        config = resolve_config(args.to_config(256), None)
        connector = _make_scheduler_connector(config, arch)
        assert connector is not None
        workers = sorted(m for m in sys.modules if m.startswith("tokenbus.worker"))
        assert not workers, workers
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]


def test_a_kv_layout_refuses_an_unresolved_config():
    from tests.fixtures.engine import FakeSetup
    from tokenbus.kv_transfer.layout import kv_layout

    setup = FakeSetup(EngineArgs().to_config(256))
    with pytest.raises(ValueError, match="still auto"):
        kv_layout(setup.config, setup.arch)
