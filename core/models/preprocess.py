"""How a picture becomes a model input: the preprocessing a real model's package applies
(core/models/realmodels.py names one per model), or torchvision's ImageNet convention for any other
image model. Calibration (core/precision/calibration.py) applies it to pictures."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


@dataclass(frozen=True)
class ImagePreprocess:
    """How a picture becomes a model input: decoded as RGB (or as luma, PIL's "L", for
    ``GRAY``), resized to the input's height and width (bilinear), channels reordered to
    ``channels``, each value times ``scale``, minus ``mean`` and divided by ``std`` per channel
    (both listed in ``channels`` order), laid out as the input is (NCHW, or NHWC when its last
    dim is the channel count)."""

    channels: str = "RGB"  # or "BGR", or "GRAY" (one channel)
    scale: float = 1 / 255
    mean: tuple = IMAGENET_MEAN
    std: tuple = IMAGENET_STD

    @property
    def channel_count(self) -> int:
        return 1 if self.channels == "GRAY" else 3

    def apply(self, rgb: np.ndarray) -> np.ndarray:
        """HWC uint8 RGB (HW1 luma for GRAY) -> HWC float32 as the model takes it."""
        pixels = rgb[..., ::-1] if self.channels == "BGR" else rgb
        return ((pixels.astype(np.float32) * np.float32(self.scale) - np.asarray(self.mean, np.float32))
                / np.asarray(self.std, np.float32))

    def to_json(self) -> dict:
        return {"channels": self.channels, "scale": self.scale, "mean": list(self.mean), "std": list(self.std)}


IMAGENET = ImagePreprocess()
GRAYSCALE = ImagePreprocess("GRAY", 1 / 255, (0.0,), (1.0,))
