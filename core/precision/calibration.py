"""Calibration and held-out data for int8 plans.

``--calibration PATH`` is a folder of

- ``.npz`` files, one feed each: an array per model input, named as the input (a model with one
  input also takes ``.npy`` files, or an ``.npz`` with one array whatever its name);
- or images (``.jpg``, ``.jpeg``, ``.png``, ``.bmp``), for a model with one image input, made
  into inputs as ``ImagePreprocess`` says: a real model of ``kselect models`` as its package
  does, any other model as torchvision's ImageNet classifiers (RGB, [0, 1], ImageNet's mean and
  std), or, with one channel, as grayscale in [0, 1] (``GRAYSCALE``).

``--calibration samples`` takes, for a real model, the pinned sample pictures
(core/models/realmodels.SAMPLE_PICTURES) preprocessed as its package does: pictures, but not the
model's own data, and every output says so. From Python, any iterable of feeds (dicts of input
name -> array) does.

The feeds are split: the first half calibrates (onnxruntime.quantization's calibrators:
min-max, percentile or entropy), the second half is held out, to measure accuracy. The built-in
zoo has no data: for it alone, seeded random feeds stand in, and every output says
``synthetic``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import tempfile
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable

import numpy as np
import onnx

from kselect.core.errors import KselectError
from kselect.core.models.model import Model
from kselect.core.models.tasks import extract_tasks
from kselect.core.models.preprocess import GRAYSCALE, IMAGENET, ImagePreprocess
from kselect.core.models.realmodels import SAMPLE_PICTURES, fetch_sample_pictures, registry_entry

IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".bmp")
SAMPLES = "samples"  # --calibration samples: the real models' sample pictures

CHANNEL_ORDERS = ("RGB", "BGR", "GRAY")


def image_preprocess(model: Model, channels: str | None = None, scale: float | None = None, mean=None,
                     std=None) -> ImagePreprocess:
    """The model's preprocessing (a real model's package's, else ``IMAGENET``, or ``GRAYSCALE``
    for a one-channel image input) with the values given here in place of its own
    (``--image-channels``, ``--image-scale``, ...)."""
    given = {"channels": channels, "scale": scale, "mean": tuple(mean) if mean is not None else None,
             "std": tuple(std) if std is not None else None}
    if channels is not None and channels not in CHANNEL_ORDERS:
        raise KselectError(f"--image-channels {channels!r}: give RGB, BGR or GRAY")
    default = model_preprocess(model) or (GRAYSCALE if image_channels(model) == 1 else IMAGENET)
    preprocess = dataclasses.replace(default, **{k: v for k, v in given.items() if v is not None})
    if preprocess.channel_count != default.channel_count:  # the default's mean and std are for the other count
        fallback = GRAYSCALE if preprocess.channels == "GRAY" else IMAGENET
        preprocess = dataclasses.replace(preprocess, mean=given["mean"] or fallback.mean, std=given["std"] or fallback.std)
    count = preprocess.channel_count
    for name in ("mean", "std"):
        if len(getattr(preprocess, name)) != count:
            raise KselectError(f"--image-{name}: give {'one value' if count == 1 else 'three values, one per channel'} "
                               f"for --image-channels {preprocess.channels}")
    if any(v == 0 for v in preprocess.std) or not preprocess.scale > 0:
        raise KselectError("--image-std and --image-scale must be above 0")
    return preprocess


def channel_axis(shape: list[int], count: int) -> int | None:
    """Where a 4-D image input keeps its ``count`` channels: 1 (NCHW, preferred when both fit) or
    3 (NHWC); None if it is no such input."""
    if len(shape) != 4:
        return None
    return next((axis for axis in (1, 3) if shape[axis] == count), None)


def image_channels(model: Model) -> int | None:
    """The channel count of a one-input model's 4-D image input (1 or 3: NCHW, or NHWC), else None."""
    if len(model.input_shapes) != 1:
        return None
    shape = next(iter(model.input_shapes.values()))
    return next((count for count in (3, 1) if channel_axis(shape, count) is not None), None)


METHODS = {"minmax": "MinMax", "percentile": "Percentile", "entropy": "Entropy"}
SYNTHETIC_FEEDS = 48  # 16 calibrate, 32 held out


@dataclass
class Calibration:
    calibrate: list[dict]  # feeds that set the quantization ranges
    held_out: list[dict]  # feeds accuracy is measured on
    source: str  # the folder, "python", "synthetic" or the sample pictures
    synthetic: bool = False
    method: str = "minmax"
    ranges: dict = field(default_factory=dict)  # onnxruntime.quantization's calibration cache (JSON)
    sample_pictures: bool = False  # --calibration samples: pictures, not the model's own data
    preprocess: ImagePreprocess | None = None  # how pictures became inputs, when there were pictures

    @property
    def caveat(self) -> str:
        """What every output of an int8 tune says about data that is not the model's own."""
        if self.synthetic:
            return "SYNTHETIC: random inputs, not data"
        if self.sample_pictures:
            return "SAMPLE PICTURES, not the model's own data"
        return ""

    def describe(self) -> str:
        text = f"{len(self.calibrate)} calibration + {len(self.held_out)} held-out feeds from {self.source}"
        return text + (f" ({self.caveat})" if self.caveat else "")

    def to_json(self) -> dict:
        return {"source": self.source, "synthetic": self.synthetic, "sample_pictures": self.sample_pictures,
                "caveat": self.caveat, "method": self.method,
                "preprocess": self.preprocess.to_json() if self.preprocess else None,
                "calibration_feeds": len(self.calibrate), "held_out_feeds": len(self.held_out)}


def synthetic_feeds(model: Model, count: int = SYNTHETIC_FEEDS, seed: int = 0) -> list[dict]:
    rng = np.random.default_rng(seed)
    return [{name: rng.standard_normal(shape, dtype=np.float32) for name, shape in model.input_shapes.items()}
            for _ in range(count)]


def _image(path: Path, shape: list[int], preprocess: ImagePreprocess) -> np.ndarray:
    from PIL import Image, UnidentifiedImageError

    channels_last = channel_axis(shape, preprocess.channel_count) == 3
    height, width = (shape[1], shape[2]) if channels_last else (shape[2], shape[3])
    try:
        with warnings.catch_warnings():  # past Pillow's pixel limit an image is refused, never decoded
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            with Image.open(path) as image:
                mode = "L" if preprocess.channels == "GRAY" else "RGB"
                pixels = image.convert(mode).resize((width, height), Image.BILINEAR)
    except (Image.DecompressionBombError, Image.DecompressionBombWarning):
        raise KselectError(f"--calibration: image {path.name} has more than {Image.MAX_IMAGE_PIXELS:,} pixels: too "
                           "large to decode safely; give pictures of the size the model takes") from None
    except (OSError, UnidentifiedImageError) as exc:
        raise KselectError(f"--calibration: cannot read image {path.name}: {exc}") from None
    array = preprocess.apply(np.asarray(pixels).reshape(height, width, preprocess.channel_count))
    array = array if channels_last else array.transpose(2, 0, 1)
    return np.broadcast_to(array[None], shape).astype(np.float32)


def _feed_from_arrays(path: Path, model: Model) -> dict:
    names = list(model.input_shapes)
    try:
        if path.suffix == ".npy":
            arrays = {names[0]: np.load(path, allow_pickle=False)}
            if len(names) != 1:
                raise KselectError(f"--calibration: {path.name} is one array but the model has inputs "
                                   f"{', '.join(names)}: use .npz files with an array per input")
        else:
            with np.load(path, allow_pickle=False) as npz:
                arrays = {key: npz[key] for key in npz.files}
            if len(names) == 1 and len(arrays) == 1:
                arrays = {names[0]: next(iter(arrays.values()))}
    except (OSError, ValueError) as exc:
        raise KselectError(f"--calibration: cannot read {path.name}: {exc}") from None
    return arrays


def check_feed(feed: dict, model: Model, where: str) -> dict:
    missing = [name for name in model.input_shapes if name not in feed]
    if missing:
        raise KselectError(f"--calibration: {where} has no array for input {missing[0]!r} "
                           f"(it has {', '.join(feed) or 'none'})")
    checked = {}
    for name, shape in model.input_shapes.items():
        array = np.asarray(feed[name])
        if list(array.shape) != list(shape):
            raise KselectError(f"--calibration: {where}: input {name!r} has shape {list(array.shape)}, the model "
                               f"takes {list(shape)}")
        if not np.all(np.isfinite(array)):
            raise KselectError(f"--calibration: {where}: input {name!r} has NaN or infinite values")
        checked[name] = array.astype(np.float32)
    return checked


def load_feeds(path: str | Path, model: Model, preprocess: ImagePreprocess | None = None) -> list[dict]:
    """The feeds in a calibration folder (module docstring), checked against the model's inputs;
    images made inputs with ``preprocess`` (default: ``image_preprocess(model)``)."""
    folder = Path(path)
    if not folder.is_dir():
        raise KselectError(f"--calibration: {folder} is not a folder")
    files = sorted(p for p in folder.iterdir() if p.suffix.lower() in (".npy", ".npz", *IMAGE_SUFFIXES))
    odd = next((p for p in files if not p.is_file()), None)
    if odd is not None:  # reading a FIFO would wait forever, a device forever or for its whole size
        raise KselectError(f"--calibration: {odd} is not a regular file (a folder, FIFO, device or socket)")
    if not files:
        raise KselectError(f"--calibration: {folder} has no .npy, .npz or image files")
    return _feeds_from_files(files, model, preprocess or image_preprocess(model))


def model_preprocess(model: Model) -> ImagePreprocess | None:
    """How the package of a real model (``kselect models``) makes a picture its input."""

    entry = registry_entry(model)
    return entry.preprocess if entry else None


def sample_feeds(model: Model, preprocess: ImagePreprocess | None = None) -> list[dict]:
    """``--calibration samples``: the pinned sample pictures, made inputs as the real model's
    package does (or as ``preprocess`` says, for any model)."""

    preprocess = preprocess or model_preprocess(model)
    if preprocess is None:
        raise KselectError(f"--calibration samples: sample pictures are for the real models of `kselect models` that "
                           f"take a picture, or a model whose picture preprocessing is given (--image-scale, "
                           f"--image-mean, ...); give {model.name} a folder of its own data")
    return _feeds_from_files(fetch_sample_pictures(), model, preprocess)


def _feeds_from_files(files: list[Path], model: Model, preprocess: ImagePreprocess) -> list[dict]:
    images = [p for p in files if p.suffix.lower() in IMAGE_SUFFIXES]
    if images and len(model.input_shapes) != 1:
        raise KselectError(f"--calibration: images feed a model with one input; this one has "
                           f"{', '.join(model.input_shapes)}")
    feeds = []
    for file in files:
        if file in images:
            name, shape = next(iter(model.input_shapes.items()))
            if channel_axis(shape, preprocess.channel_count) is None:
                raise KselectError(f"--calibration: images with --image-channels {preprocess.channels} need an NCHW or "
                                   f"NHWC input with {preprocess.channel_count} channel(s); {name!r} is {shape}")
            feed = {name: _image(file, shape, preprocess)}
        else:
            feed = _feed_from_arrays(file, model)
        feeds.append(check_feed(feed, model, file.name))
    return feeds


def calibration_for(model: Model, data: "str | Path | Iterable[dict] | Calibration | None",
                    method: str = "minmax", preprocess: ImagePreprocess | None = None,
                    precisions: tuple[str, ...] = ("int8",)) -> Calibration:
    """Splits the feeds (half calibrate, half held out; a ``Calibration`` is taken as split);
    ``data`` None is allowed for the built-in zoo only (synthetic feeds); pictures become inputs
    with ``preprocess`` (default: ``image_preprocess(model)``). Refuses, in one line, data that
    does not fit the model, or no data for a model of the user's own, naming the reduced
    ``precisions`` the data is for."""
    if method not in METHODS:
        raise KselectError(f"--calibration-method {method!r}: choose from {', '.join(METHODS)}")
    if isinstance(data, Calibration):  # already split (a benchmark's own synthetic set, say)
        for i, feed in enumerate(data.calibrate + data.held_out):
            check_feed(feed, model, f"feed {i}")
        data.method = method
        return data
    if preprocess is not None and not isinstance(data, (str, Path)):
        raise KselectError("--image-channels, --image-scale, --image-mean and --image-std are for --calibration with "
                           "pictures (a folder of images, or samples)")
    if data is None:
        if model.source != "builtin":
            hint = " or, for a real model, --calibration samples" if model_preprocess(model) else ""
            what = " and ".join(precisions)
            use = "its ranges and the accuracy budget" if "int8" in precisions else "the accuracy budget"
            raise KselectError(f"{model.name}: {what} needs calibration data for {use} (--calibration FOLDER of "
                               f".npz/.npy feeds or images{hint}); synthetic data is for the built-in zoo only")
        feeds, source, synthetic = synthetic_feeds(model), "synthetic", True
    elif _means_samples(data):

        feeds, source, synthetic = sample_feeds(model, preprocess), SAMPLE_PICTURES.describe(), False
        preprocess = preprocess or model_preprocess(model)
    elif isinstance(data, (str, Path)):
        preprocess = preprocess or image_preprocess(model)
        feeds, source, synthetic = load_feeds(data, model, preprocess), str(data), False
        if not any(p.suffix.lower() in IMAGE_SUFFIXES for p in Path(data).iterdir()):
            preprocess = None  # arrays only: no picture was made an input
    else:
        feeds = [check_feed(feed, model, f"feed {i}") for i, feed in enumerate(data)]
        source, synthetic = "python", False
    if len(feeds) < 2:
        raise KselectError(f"--calibration: {len(feeds)} feed(s); at least 2 are needed (half calibrate, half "
                           f"measure accuracy)")
    half = (len(feeds) + 2) // 3 if synthetic else (len(feeds) + 1) // 2
    return Calibration(feeds[:half], feeds[half:], source, synthetic, method, sample_pictures=_means_samples(data),
                       preprocess=preprocess)


def _means_samples(data) -> bool:
    """``--calibration samples``, unless a folder of that name is there."""
    return isinstance(data, (str, Path)) and str(data) == SAMPLES and not Path(data).is_dir()


class _Reader:
    """onnxruntime.quantization's CalibrationDataReader over a list of feeds."""

    def __init__(self, feeds: list[dict]):
        self.feeds = iter(feeds)

    def get_next(self):
        return next(self.feeds, None)

    def rewind(self):  # not needed by the calibrators used here
        pass


def quantize_qdq(proto, output: Path, feeds: list[dict] | None = None, *, cache: Path | None = None,
                 method: str = "minmax", per_channel: bool = True, signed_activations: bool = False,
                 nodes_to_quantize: list[str] | None = None, op_types: list[str] | None = None,
                 unquantized_outputs: tuple[str, ...] = ()) -> None:
    """onnxruntime.quantization.quantize_static as kselect calls it: QDQ format, int8 weights,
    uint8 (or int8) activations, calibrated on ``feeds`` or read from the calibration ``cache``
    (written there when it does not exist yet); on a copy of the model at opset 13, quietly.
    ``op_types``: the op types it quantizes (default: every type it knows).
    ``unquantized_outputs``: op types whose outputs get no QuantizeLinear of their own (its
    ``OpTypesToExcludeOutputQuantization``), so the tensor is quantized once, after the op
    that follows (a convolution's Clip or Relu) instead of before and after it."""
    import onnxruntime.quantization as q

    with tempfile.TemporaryDirectory(prefix="kselect-quantize-") as tmp, quiet_quantizer():
        source = Path(tmp) / "model.onnx"
        source.write_bytes(quantizable(proto).SerializeToString())  # quantize_static changes a ModelProto
        q.quantize_static(source, output, _Reader(feeds) if feeds is not None else None,
                          quant_format=q.QuantFormat.QDQ, per_channel=per_channel,
                          activation_type=q.QuantType.QInt8 if signed_activations else q.QuantType.QUInt8,
                          weight_type=q.QuantType.QInt8, nodes_to_quantize=nodes_to_quantize,
                          op_types_to_quantize=op_types,
                          calibrate_method=getattr(q.CalibrationMethod, METHODS[method]),
                          calibration_cache_path=cache,
                          extra_options={"OpTypesToExcludeOutputQuantization": list(unquantized_outputs)})


def compute_ranges(model: Model, calibration: Calibration) -> dict:
    """The tensor ranges onnxruntime.quantization's calibrator finds on the calibration feeds, as
    its calibration cache (JSON), so every quantized variant of the model shares them."""
    with tempfile.TemporaryDirectory(prefix="kselect-calibrate-") as tmp:
        cache = Path(tmp) / "ranges.json"
        quantize_qdq(model.proto, Path(tmp) / "probe.onnx", calibration.calibrate, cache=cache,
                     method=calibration.method)
        calibration.ranges = json.loads(cache.read_text())
    return calibration.ranges


def plan_ranges(plan) -> dict[str, tuple[float, float]]:
    """Tensor name -> (lowest, highest) from a plan's calibration cache (``compute_ranges``'
    JSON, ``plan.extra["precision"]["ranges"]``): what a library's runner quantizes a plan's
    int8 ops with."""
    cache = ((getattr(plan, "extra", None) or {}).get("precision") or {}).get("ranges") or {}
    data = cache.get("data", cache) if isinstance(cache, dict) else {}
    return {name: (_cached_number(entry["lowest"]), _cached_number(entry["highest"])) for name, entry in data.items()
            if isinstance(entry, dict) and "lowest" in entry and "highest" in entry}


def _cached_number(value) -> float:
    if isinstance(value, dict):  # the cache's numpy arrays: {"data": [...], "dtype": ..., "CLS": "numpy.array"}
        value = value.get("data")
    return float(np.asarray(value, dtype=np.float64).reshape(-1)[0])


def nodes_to_quantize(model, int8: set[str]) -> list[str] | None:
    """The nodes the quantizer may quantize for a plan running ``int8`` in int8: all (None) when
    every tunable node is int8, as ONNX Runtime's own static quantization does; otherwise the
    int8 nodes and the untuned ops between them (a residual Add of two int8 branches, a pool
    after an int8 conv).

    A tunable op the plan keeps in float (backed off for accuracy, or with no int8 form in the
    plan's library) has its output quantized once where int8 ops take it on, as ONNX Runtime's
    quantizer does with the nodes it is told to exclude: the ReLU, residual Add, Resize and
    Concat between a float conv and the next int8 conv run in 8 bits, not in float behind ONNX
    Runtime's transposes to and from its NHWC int8 convs (docs/mixed-precision.md, "Export").
    Untuned ops that only float ops and model outputs read stay float (a detector's head after
    its last float conv)."""
    tasks = extract_tasks(model)
    tunable = {node for task in tasks for node in task.nodes}
    if tunable <= int8:
        return None
    graph = model.proto.graph
    writes, readers = {}, {}
    for node in graph.node:  # graph order is topological
        writes.update((output, node.name) for output in node.output)
        for name in node.input:
            readers.setdefault(name, []).append(node.name)
    activations = {node.name: [name for name in node.input if name and name not in model.initializers]
                   for node in graph.node}
    quantized, anchored = set(int8), set(int8)  # anchored: next to an int8 op through quantized ops
    for node in graph.node:
        inputs = activations[node.name]
        # every data input written by a quantized op or a tunable one (int8, or float: its output is quantized)
        if node.name not in tunable and inputs and all(writes.get(name) in quantized or writes.get(name) in tunable
                                                       for name in inputs):
            quantized.add(node.name)
            if any(writes.get(name) in anchored for name in inputs):
                anchored.add(node.name)
    outputs = {value.name for value in graph.output}
    for node in reversed(graph.node):  # readers first
        read_by = [reader for output in node.output for reader in readers.get(output, [])]
        if (node.name in quantized and node.name not in anchored and read_by and all(reader in anchored for reader in read_by)
                and not any(output in outputs for output in node.output)):
            anchored.add(node.name)
    return sorted(quantized & anchored)


@contextlib.contextmanager
def quiet_quantizer():
    """onnxruntime.quantization advises on the root logger (pre-processing); kselect's output
    stays its own."""
    import logging

    root = logging.getLogger()
    level = root.level
    root.setLevel(logging.ERROR)
    try:
        yield
    finally:
        root.setLevel(level)


QDQ_OPSET = 13  # per-channel DequantizeLinear (its axis attribute) needs opset 13


def quantizable(proto):
    """The model at an opset QDQ with per-channel weights needs (onnx's version converter, when
    the model is older), as onnxruntime.quantization expects but does not do itself."""
    from onnx import version_converter

    opset = next((o.version for o in proto.opset_import if o.domain in ("", "ai.onnx")), QDQ_OPSET)
    if opset >= QDQ_OPSET:
        return proto
    try:
        converted = version_converter.convert_version(_initializers_as_inputs(proto), QDQ_OPSET)
    except Exception as exc:  # the converter raises many kinds
        raise KselectError(f"int8 needs opset {QDQ_OPSET} (per-channel QDQ) and onnx cannot convert this opset-{opset} "
                           f"model: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}") from None
    declared = {value.name for value in proto.graph.input}
    inputs = [value for value in converted.graph.input if value.name in declared]
    del converted.graph.input[:]
    converted.graph.input.extend(inputs)
    converted.ir_version = max(converted.ir_version, onnx.helper.find_min_ir_version_for(
        [onnx.helper.make_opsetid("", QDQ_OPSET)]))
    return converted


def _initializers_as_inputs(proto):
    """A copy of the model whose weights are also graph inputs: onnx's version converter looks
    for them there, as IR version 3 (opset 8 and older) required, and calls them undefined
    otherwise."""
    copy = onnx.ModelProto()
    copy.CopyFrom(proto)
    declared = {value.name for value in copy.graph.input}
    copy.graph.input.extend(onnx.helper.make_tensor_value_info(weight.name, weight.data_type, weight.dims)
                            for weight in copy.graph.initializer if weight.name not in declared)
    return copy
