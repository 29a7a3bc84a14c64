"""Write an HF checkpoint as the released FP8 checkpoints are (Qwen3-FP8, DeepSeek-V3): each
decoder-layer projection as float8 e4m3 values and a `weight_scale_inv` per block (each block's
largest value mapped to 448), everything else as it is, and `quantization_config`
{"quant_method": "fp8", "weight_block_size": BLOCK}.

Usage: .venv/bin/python benchmarks/make_fp8_checkpoint.py SRC_DIR OUT_DIR [--block 128 128]

SmolLM2-135M (benchmarks/make_hf_copy.py) takes --block 64 64: its width, 576, is 4.5 blocks
of 128, and transformers' FP8 reader (the peer) needs blocks that divide every side.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import save_file

FP8_MAX = 448.0


def to_fp8(weight: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 values [rows, cols], fp32 scales [ceil(rows / br), ceil(cols / bc)])."""
    rows, cols = weight.shape
    br, bc = block
    grid = math.ceil(rows / br), math.ceil(cols / bc)
    padded = F.pad(weight.float(), (0, grid[1] * bc - cols, 0, grid[0] * br - rows))
    blocks = padded.view(grid[0], br, grid[1], bc)
    scales = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12) / FP8_MAX
    values = (blocks / scales[:, None, :, None]).view(padded.shape)[:rows, :cols]
    return values.to(torch.float8_e4m3fn), scales


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("src", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--block", type=int, nargs=2, default=(128, 128), metavar=("ROWS", "COLS"))
    args = parser.parse_args()
    block = tuple(args.block)
    shutil.copytree(args.src, args.out, ignore=shutil.ignore_patterns("*.safetensors*"))
    tensors = {}
    for file in sorted(args.src.glob("*.safetensors")):
        with safe_open(file, framework="pt") as handle:
            for name in handle.keys():
                tensor = handle.get_tensor(name)
                projection = name.startswith("model.layers.") and name.endswith("_proj.weight")
                if projection and tensor.dim() == 2:
                    tensors[name], scales = to_fp8(tensor, block)
                    tensors[name.removesuffix("weight") + "weight_scale_inv"] = scales
                else:
                    tensors[name] = tensor
    save_file({n: t.contiguous() for n, t in tensors.items()}, str(args.out / "model.safetensors"))
    config = json.loads((args.src / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "fp8",
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "weight_block_size": list(block),
    }
    (args.out / "config.json").write_text(json.dumps(config, indent=2))
    print(f"{args.out}: FP8 in blocks of {list(block)}")


if __name__ == "__main__":
    main()
