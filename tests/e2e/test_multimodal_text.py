"""The text model of image-and-text checkpoints (Gemma3ForConditionalGeneration,
Mistral3ForConditionalGeneration with a Mistral or a Ministral 3 text model, and
Qwen3_5ForConditionalGeneration), end to end against
HF transformers, fp32 on CPU: tiny random checkpoints with a vision tower give the HF model's
greedy tokens and logprobs for text prompts (the tower and projector left unread), and a
released-style sparse text_config takes its config class's defaults."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from tests.e2e.oracle import assert_matches_hf, greedy_outputs, hf_greedy_logprobs, load_hf
from tests.e2e.utils import assert_engine_clean, make_llm, random_prompts
from tests.fixtures.tiny_models import ARCH_DEFAULTS, TINY_CONFIG, smollm2_tokenizer_dir

MAX_TOKENS = 8
ENGINE = dict(kv_cache_dtype="float32")
TEXT = {**TINY_CONFIG, "vocab_size": 49152}


def _save(model, path):
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            if name.endswith("norm.weight"):
                param.copy_((0.0 if "gemma" in type(model).__name__.lower() else 1.0) + 0.1 * noise)
            elif param.ndim == 1:
                param.copy_(0.2 * noise)
            else:
                param.copy_(noise / param.shape[-1] ** 0.5)
    model.save_pretrained(str(path))
    for file in smollm2_tokenizer_dir().iterdir():
        shutil.copy(file, path / file.name)
    return path


def _gemma3(path):
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    text = {**TEXT, **ARCH_DEFAULTS["gemma3"], "model_type": "gemma3_text"}
    vision = dict(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        image_size=28, patch_size=14,
    )  # fmt: skip
    config = Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4)
    return _save(Gemma3ForConditionalGeneration(config), path)


def _mistral3(path, text_type: str = "mistral"):
    from transformers import Mistral3Config, Mistral3ForConditionalGeneration

    text = {**TEXT, "model_type": text_type, "sliding_window": None}
    if text_type == "ministral3":  # Ministral 3: YaRN and its query temperature
        text.update(ARCH_DEFAULTS["ministral3"])
    vision = dict(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        image_size=28, patch_size=14, head_dim=16,
    )  # fmt: skip
    config = Mistral3Config(text_config=text, vision_config=vision, spatial_merge_size=1)
    return _save(Mistral3ForConditionalGeneration(config), path)


def _qwen3_5(path):
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    text = {**TEXT, **ARCH_DEFAULTS["qwen3_5"], "model_type": "qwen3_5_text"}
    vision = dict(
        depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
        patch_size=4, spatial_merge_size=2, num_position_embeddings=16,
    )  # fmt: skip
    config = Qwen3_5Config(text_config=text, vision_config=vision, tie_word_embeddings=True)
    return _save(Qwen3_5ForConditionalGeneration(config), path)


@pytest.fixture(scope="module", params=["gemma3", "mistral3", "mistral3-ministral3", "qwen3_5"])
def checkpoint(request, tmp_path_factory):
    make = {
        "gemma3": _gemma3,
        "mistral3": _mistral3,
        "mistral3-ministral3": lambda path: _mistral3(path, "ministral3"),
        "qwen3_5": _qwen3_5,
    }[request.param]
    return make(tmp_path_factory.mktemp(request.param))


def test_text_model_gives_hfs_tokens(checkpoint):
    from safetensors import safe_open

    with safe_open(str(checkpoint / "model.safetensors"), "pt") as handle:
        # a real multimodal file
        assert any("vision_tower" in name or ".visual." in name for name in handle.keys())
    prompts = random_prompts(3, 5, 40, seed=61)
    if json.loads((checkpoint / "config.json").read_text())["model_type"] == "mistral3":
        # not an AutoModelForCausalLM: its own class
        from transformers import Mistral3ForConditionalGeneration

        hf = Mistral3ForConditionalGeneration.from_pretrained(str(checkpoint), dtype=torch.float32)
    else:
        hf = load_hf(str(checkpoint))
    reference = [hf_greedy_logprobs(hf, prompt, MAX_TOKENS) for prompt in prompts]
    llm = make_llm(checkpoint, **ENGINE)
    assert_matches_hf(greedy_outputs(llm, prompts, MAX_TOKENS, 1), reference)
    assert_engine_clean(llm)


def test_a_sparse_text_config_takes_its_class_defaults(tmp_path):
    """Gemma 3 4B's config.json names few text fields; the rest are Gemma3TextConfig's."""
    from tokenbus.loader import load_arch, resolve_model

    model = tmp_path / "m"
    model.mkdir()
    text = {"model_type": "gemma3_text", "hidden_size": 2560, "num_hidden_layers": 34}
    config = {"model_type": "gemma3", "architectures": ["Gemma3ForConditionalGeneration"]}
    (model / "config.json").write_text(json.dumps({**config, "text_config": text}))
    arch = load_arch(resolve_model(str(model)))
    assert (arch.architecture, arch.hidden_size, arch.num_hidden_layers) == ("gemma3", 2560, 34)
    assert (arch.num_attention_heads, arch.num_key_value_heads, arch.head_dim) == (8, 4, 256)
    del config["model_type"]
    (model / "config.json").write_text(json.dumps({**config, "model_type": "gemma3"}))
    with pytest.raises(ValueError, match="needs its text_config"):
        load_arch(resolve_model(str(model)))


def test_a_qwen3_5_moe_text_config_without_a_dense_width(tmp_path):
    """Qwen3.5-35B-A3B's text_config names no intermediate_size (it has no dense MLP): the
    width a dense MLP would have is its shared expert's."""
    from tokenbus.loader import load_arch, resolve_model

    model = tmp_path / "m"
    model.mkdir()
    text = {
        "model_type": "qwen3_5_moe_text",
        "hidden_size": 2048,
        "num_hidden_layers": 40,
        "num_experts": 256,
        "num_experts_per_tok": 8,
        "moe_intermediate_size": 512,
        "shared_expert_intermediate_size": 512,
    }
    config = {"model_type": "qwen3_5_moe", "architectures": ["Qwen3_5MoeForConditionalGeneration"]}
    (model / "config.json").write_text(json.dumps({**config, "text_config": text}))
    arch = load_arch(resolve_model(str(model)))
    assert (arch.architecture, arch.intermediate_size, arch.num_experts) == (
        "qwen3_5_moe",
        512,
        256,
    )
    assert len(arch.recurrent_layers) == 30 and arch.rotary_dim == arch.head_dim // 4
