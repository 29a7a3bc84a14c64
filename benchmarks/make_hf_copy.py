"""Write the packaged SmolLM2 GGUF as a plain HF directory (fp32), for peers that need one.

Usage: .venv/bin/python benchmarks/make_hf_copy.py /tmp/smollm2-hf
"""

import sys

from transformers import AutoModelForCausalLM, AutoTokenizer

from tokenbus.loader import resolve_model


def main(out_dir: str) -> None:
    source = resolve_model(None)
    kwargs = {"gguf_file": source.path.name}
    loaded = AutoModelForCausalLM.from_pretrained(str(source.path.parent), **kwargs)
    # transformers refuses to save a GGUF-loaded model: copy its (dequantized) weights into a
    # fresh model built from the same config, without the GGUF quantization marker.
    config = loaded.config
    config.architectures = ["LlamaForCausalLM"]  # GGUF-loaded configs leave it unset
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = type(loaded)(config)
    model.load_state_dict(loaded.state_dict())
    model.save_pretrained(out_dir)
    AutoTokenizer.from_pretrained(str(source.path.parent), **kwargs).save_pretrained(out_dir)


if __name__ == "__main__":
    main(sys.argv[1])
