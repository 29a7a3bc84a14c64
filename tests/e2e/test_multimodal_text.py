"""The text model of image-and-text checkpoints (Gemma3ForConditionalGeneration,
Mistral3ForConditionalGeneration with a Mistral, a Ministral 3 or a Mistral 4 text model,
Qwen3_5ForConditionalGeneration, Qwen3VLForConditionalGeneration and
Qwen2_5_VLForConditionalGeneration), end to end against HF transformers, fp32 on CPU: tiny random
checkpoints with a vision tower give the HF model's greedy tokens and logprobs for text prompts
(the tower and projector left unread; the Qwen-VL models' multimodal rotary turns text tokens by
their positions alone), a Qwen2.5-VL file in its released flat layout does too, and a
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
    if text_type in ("ministral3", "mistral4"):  # YaRN and a query temperature; Mistral 4's
        text.update(ARCH_DEFAULTS[text_type])  # latent attention and experts
    if text_type == "mistral4":
        del text["sliding_window"]
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


# The Qwen-VL vision towers, tiny
_QWEN_VL_VISION = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2)


def _qwen3_vl(path):
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    rope = {"rope_type": "default", "mrope_section": [4, 2, 2], "mrope_interleaved": True}
    text = {**TEXT, "model_type": "qwen3_vl_text", "head_dim": 16, "rope_parameters": rope}
    vision = {**_QWEN_VL_VISION, "out_hidden_size": 64, "deepstack_visual_indexes": [0]}
    config = Qwen3VLConfig(text_config=text, vision_config=vision, tie_word_embeddings=True)
    return _save(Qwen3VLForConditionalGeneration(config), path)


def _qwen2_5_vl(path):
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    rope = {"rope_type": "default", "mrope_section": [2, 3, 3]}
    text = {**TEXT, "model_type": "qwen2_5_vl_text", "rope_parameters": rope}
    vision = {**_QWEN_VL_VISION, "out_hidden_size": 64, "fullatt_block_indexes": [0]}
    config = Qwen2_5_VLConfig(text_config=text, vision_config=vision)
    return _save(Qwen2_5_VLForConditionalGeneration(config), path)


@pytest.fixture(
    scope="module",
    params=[
        *("gemma3", "mistral3", "mistral3-ministral3", "mistral3-mistral4"),
        *("qwen3_5", "qwen3_vl", "qwen2_5_vl"),
    ],
)
def checkpoint(request, tmp_path_factory):
    make = {
        "gemma3": _gemma3,
        "mistral3": _mistral3,
        "mistral3-ministral3": lambda path: _mistral3(path, "ministral3"),
        "mistral3-mistral4": lambda path: _mistral3(path, "mistral4"),
        "qwen3_5": _qwen3_5,
        "qwen3_vl": _qwen3_vl,
        "qwen2_5_vl": _qwen2_5_vl,
    }[request.param]
    return make(tmp_path_factory.mktemp(request.param))


def test_text_model_gives_hfs_tokens(checkpoint):
    from safetensors import safe_open

    with safe_open(str(checkpoint / "model.safetensors"), "pt") as handle:
        # a real multimodal file
        assert any("vision_tower" in name or "visual." in name for name in handle.keys())
    prompts = random_prompts(3, 5, 40, seed=61)
    model_type = json.loads((checkpoint / "config.json").read_text())["model_type"]
    if model_type in ("mistral3", "qwen3_vl", "qwen2_5_vl"):
        # not an AutoModelForCausalLM: an image-text-to-text class
        from transformers import AutoModelForImageTextToText

        hf = AutoModelForImageTextToText.from_pretrained(str(checkpoint), dtype=torch.float32)
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


def test_a_flat_qwen2_5_vl_checkpoint(tmp_path):
    """Qwen2.5-VL's released files: the text model's fields at the top of config.json (the
    rotary as rope_scaling type "mrope"), its weights as model.layers.* beside visual.*."""
    from safetensors.torch import load_file, save_file

    from tokenbus.loader import load_arch, resolve_model

    source = _qwen2_5_vl(tmp_path / "new")
    flat = shutil.copytree(source, tmp_path / "flat")
    config = json.loads((flat / "config.json").read_text())
    text = config.pop("text_config")
    rope = text.pop("rope_parameters")
    text.pop("model_type")
    mrope = {"type": "mrope", "mrope_section": rope["mrope_section"]}
    config.update(text, rope_theta=rope["rope_theta"], rope_scaling=mrope)
    (flat / "config.json").write_text(json.dumps(config))
    # (transformers writes these names too; a newer layout's are mapped back to them)
    weights = {
        name.replace("model.language_model.", "model.").replace("model.visual.", "visual."): w
        for name, w in load_file(str(flat / "model.safetensors")).items()
    }
    assert (
        "model.layers.0.self_attn.q_proj.bias" in weights
        and "visual.merger.mlp.0.weight" in weights
    )
    save_file(weights, str(flat / "model.safetensors"), metadata={"format": "pt"})
    arch = load_arch(resolve_model(str(flat)))
    assert (arch.architecture, arch.attention_bias, arch.rope_scaling) == ("qwen2", True, None)
    prompts = random_prompts(3, 5, 40, seed=63)
    outputs = {}
    for path in (source, flat):
        llm = make_llm(path, **ENGINE)
        outputs[path] = [out.token_ids for out in greedy_outputs(llm, prompts, MAX_TOKENS)]
        assert_engine_clean(llm)
    assert outputs[flat] == outputs[source]


@pytest.mark.parametrize(
    ("family", "vl_arch"), [("qwen3", "qwen3vl"), ("qwen2", "qwen2vl"), ("qwen3_moe", "qwen3vlmoe")]
)
def test_a_qwen_vl_gguf_is_its_text_model(family, vl_arch, tmp_path):
    """llama.cpp's qwen3vl / qwen2vl / qwen3vlmoe GGUF (a Qwen-VL text model, its vision part in
    an mmproj file) is Qwen3's / Qwen2's / Qwen3-MoE's tensors with rotary sections: read as that
    family, with the plain file's tokens."""
    from tests.fixtures.tiny_gguf import write_gguf
    from tests.fixtures.tiny_models import TINY_QWEN3_MOE, cached_tiny_model
    from tokenbus.loader import load_arch, resolve_model

    hf_dir = cached_tiny_model(family, **(TINY_QWEN3_MOE if family == "qwen3_moe" else {}))
    paths = [write_gguf(hf_dir, tmp_path / "plain.gguf")]
    paths.append(write_gguf(hf_dir, tmp_path / f"{vl_arch}.gguf", gguf_arch=vl_arch))
    assert load_arch(resolve_model(str(paths[1]))).architecture == family
    prompts = random_prompts(3, 5, 40, seed=65)
    outputs = []
    for path in paths:
        llm = make_llm(path, **ENGINE)
        outputs.append([out.token_ids for out in greedy_outputs(llm, prompts, MAX_TOKENS)])
        assert_engine_clean(llm)
    assert outputs[0] == outputs[1]
