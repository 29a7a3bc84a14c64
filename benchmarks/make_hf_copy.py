"""Write the packaged SmolLM2 GGUF as a plain HF directory (fp32), for peers that need one.

Usage: .venv/bin/python benchmarks/make_hf_copy.py /tmp/smollm2-hf
"""

import sys

from transformers import AutoTokenizer

from tokenbus.bench.hf_peer import load_hf_model
from tokenbus.loader import resolve_model


def main(out_dir: str) -> None:
    loaded = load_hf_model(None, "float32")
    # transformers refuses to save a GGUF-loaded model: copy its (dequantized) weights into a
    # fresh model built from the same config, without the GGUF quantization marker.
    config = loaded.config
    config.architectures = ["LlamaForCausalLM"]  # GGUF-loaded configs leave it unset
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = type(loaded)(config)
    model.load_state_dict(loaded.state_dict())
    model.save_pretrained(out_dir)
    source = resolve_model(None)
    AutoTokenizer.from_pretrained(
        str(source.path.parent), gguf_file=source.path.name
    ).save_pretrained(out_dir)


if __name__ == "__main__":
    main(sys.argv[1])
