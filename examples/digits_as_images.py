"""Write the bundled digits as PNG files in the ImageFolder layout, to try ``--dataset imagefolder``.

    python examples/digits_as_images.py pics
    revtrain train --dataset imagefolder --data-dir pics --image-size 16 --epochs 2

writes ``pics/train/<digit>/<n>.png`` (1,437 images) and ``pics/val/<digit>/<n>.png`` (360), the
default digits split, each 8x8 grey image upscaled to 32x32 RGB. Your own images go the same
way: one folder per class under ``train/`` and ``val/``.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
from PIL import Image

from revtrain.data.digits import bundled_digits


def write_digits_as_images(out: str | Path, size: int = 32) -> Path:
    """Write the digits under ``out``; returns ``out``. Refuses a folder that is not empty."""
    out = Path(out)
    if out.exists() and any(out.iterdir()):
        raise SystemExit(f"{out} is not empty; give a new folder")
    data = bundled_digits()
    for split in ("train", "val"):
        for n in data[f"{'train' if split == 'train' else 'test'}_index"]:
            pixels = (data["images"][n].astype(np.float32) * (255 / 16)).round().astype(np.uint8)
            image = Image.fromarray(pixels, mode="L").resize((size, size), Image.Resampling.NEAREST).convert("RGB")
            folder = out / split / str(int(data["labels"][n]))
            folder.mkdir(parents=True, exist_ok=True)
            image.save(folder / f"{int(n):04d}.png")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("out", help="folder to create")
    parser.add_argument("--size", type=int, default=32, help="side of the written images")
    args = parser.parse_args()
    print(f"wrote {write_digits_as_images(args.out, args.size)}/train and /val")


if __name__ == "__main__":
    main()
