"""ctypes binding over the system XNNPack: Debian 12's ``libxnnpack0`` (snapshot 0.0~git20220216,
``libXNNPACK.so.0``, "the 2022 API") or Debian 13's ``libxnnpack0.20241108`` (0.0~git20241108,
``libXNNPACK.so.0.20241108``, "the 2024 API"), told apart at load time by
``xnn_reshape_convolution2d_nhwc_f32``.

Only the public operator API of ``/usr/include/xnnpack.h`` is used here (f32 operators a CNN
needs; further down, the 8-bit and the f16 (half precision) conv / deconv / fc operators and their
conversions, bound only when the build has them: on both APIs, under the 2024 names (qc8 is
``..._qs8_qc8w``; the conversions are ``xnn_create_unary_elementwise_nc``'s convert, the 8-bit
sigmoid, leaky relu and multiply its unary / binary operators on qint8 / quint8); the 8-bit add
and pooling operators on the 2022 API only).  Every operator object
packs its weights once at creation; ``run(x, out=None)`` binds the arrays and runs
(``xnn_run_operator``) on C-contiguous float32 numpy arrays (float16 for an f16 operator).
Binding the arrays is ``xnn_setup_*(op, shapes, pointers, pool)`` on the 2022 API and
``xnn_reshape_*(op, shapes, pool)`` then ``xnn_setup_*(op, workspace, pointers)`` on the 2024
one (:meth:`Operator._bind_arrays`); on the 2024 API the elementwise operators are
``xnn_create_binary_elementwise_nd`` / ``xnn_create_unary_elementwise_nc`` and global average
pooling is an average pooling over the whole window (:class:`GlobalAveragePooling`).  Native
objects are freed by ``close()``, by the context manager, or in ``__del__``.

Threading: a :class:`Threadpool` wraps ``pthreadpool_create(n)``; ``threadpool=None`` runs on the
calling thread only.  An operator keeps a reference to its pool, so the pool outlives it.

Layouts (as XNNPack wants them; the constructors convert from ONNX's OIHW by default):

* ``Convolution2DNHWC``: input NHWC, output NHWC, weights OIHW (``weight_layout="OIHW"``) or
  OHWI (= XNNPack's GOKI for grouped convs).
* ``Convolution2DNCHW``: input NCHW (or NHWC for the 3x3/s2/C=3 first-layer path), output NCHW.
  This build supports only: 1x1 stride-1 unpadded dense (SpMM), 3x3 s2 p1 C=3 with NHWC input,
  and depthwise 3x3 (s1 p1 / s2 p1 with top pad 0 or 1) and 5x5 (s1 p2 / s2 p2 with top pad 1
  or 2), no dilation.  Anything else raises ``XNNPackError(xnn_status_unsupported_parameter)``;
  :func:`nchw_convolution_supported` predicts that without calling the library.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import functools
import math
import platform
import subprocess
from typing import Sequence

import numpy as np

from kselect.plugins.xnnpack import tileshim_build

LIBXNNPACK = "libXNNPACK.so.0"
LIBPTHREADPOOL = "libpthreadpool.so.0"
DEBIAN_PACKAGE = "libxnnpack0"
INSTALL_HINT = "apt-get install libxnnpack-dev"
# Debian 13's build: a soname of its own, and the 2024 API (operators reshaped before setup)
LIBXNNPACK_2024 = "libXNNPACK.so.0.20241108"
DEBIAN_PACKAGE_2024 = "libxnnpack0.20241108"
API_2022, API_2024 = 2022, 2024

# Flags from xnnpack.h (this snapshot).
XNN_FLAG_DEPTHWISE_CONVOLUTION = 0x00000001
XNN_FLAG_TRANSPOSE_WEIGHTS = 0x00000001
XNN_FLAG_INPUT_NHWC = 0x00000002
XNN_FLAG_TENSORFLOW_SAME_PADDING = 0x00000004
XNN_MAX_TENSOR_DIMS = 6

STATUS_NAMES = {
    0: "xnn_status_success",
    1: "xnn_status_uninitialized",
    2: "xnn_status_invalid_parameter",
    3: "xnn_status_invalid_state",
    4: "xnn_status_unsupported_parameter",
    5: "xnn_status_unsupported_hardware",
    6: "xnn_status_out_of_memory",
}

_F32_OPS = [
    "convolution2d_nhwc_f32", "convolution2d_nchw_f32", "fully_connected_nc_f32",
    "max_pooling2d_nhwc_f32", "average_pooling2d_nhwc_f32", "global_average_pooling_nwc_f32",
    "add_nd_f32", "clamp_nc_f32", "softmax_nc_f32", "copy_nc_x32",
]
REQUIRED_SYMBOLS = (
    ["xnn_initialize", "xnn_run_operator", "xnn_delete_operator"]
    + [f"xnn_{kind}_{op}" for op in _F32_OPS for kind in ("create", "setup")]
)
REQUIRED_POOL_SYMBOLS = ["pthreadpool_create", "pthreadpool_destroy", "pthreadpool_get_threads_count"]
_OPS_2024 = [
    "convolution2d_nhwc_f32", "convolution2d_nchw_f32", "deconvolution2d_nhwc_f32", "fully_connected_nc_f32",
    "max_pooling2d_nhwc_f32", "average_pooling2d_nhwc_f32", "binary_elementwise_nd",
    "unary_elementwise_nc", "softmax_nc_f32", "copy_nc_x32", "resize_bilinear2d_nhwc_f32",
]
REQUIRED_SYMBOLS_2024 = (
    ["xnn_initialize", "xnn_run_operator", "xnn_delete_operator"]
    + [f"xnn_{kind}_{op}" for op in _OPS_2024 for kind in ("create", "reshape", "setup")]
)


class XNNPackError(RuntimeError):
    """A non-success ``xnn_status`` (``status``: int, ``status_name``: e.g. xnn_status_invalid_parameter)."""

    def __init__(self, status: int, function: str, detail: str = ""):
        self.status = int(status)
        self.status_name = STATUS_NAMES.get(self.status, f"xnn_status_unknown({self.status})")
        self.function = function
        msg = f"{function} failed: {self.status_name}"
        if detail:
            msg += f" ({detail})"
        super().__init__(msg)


class XNNPackUnavailable(RuntimeError):
    """The library (or a symbol this binding needs) is not usable on this machine."""


# --------------------------------------------------------------------------------------------
# Library loading
# --------------------------------------------------------------------------------------------

_sz = ctypes.c_size_t
_u32 = ctypes.c_uint32
_f32 = ctypes.c_float
_vp = ctypes.c_void_p
_op_out = ctypes.POINTER(ctypes.c_void_p)
_szp = ctypes.POINTER(ctypes.c_size_t)

_PROTOS = {
    "xnn_initialize": [_vp],
    "xnn_deinitialize": [],
    "xnn_run_operator": [_vp, _vp],
    "xnn_delete_operator": [_vp],
    "xnn_create_convolution2d_nhwc_f32": [_u32] * 11 + [_sz] * 4 + [_vp, _vp, _f32, _f32, _u32, _op_out],
    "xnn_setup_convolution2d_nhwc_f32": [_vp, _sz, _sz, _sz, _vp, _vp, _vp],
    "xnn_create_convolution2d_nchw_f32": [_u32] * 11 + [_sz] * 4 + [_vp, _vp, _f32, _f32, _u32, _op_out],
    "xnn_setup_convolution2d_nchw_f32": [_vp, _sz, _sz, _sz, _vp, _vp, _vp],
    "xnn_create_fully_connected_nc_f32": [_sz] * 4 + [_vp, _vp, _f32, _f32, _u32, _op_out],
    "xnn_setup_fully_connected_nc_f32": [_vp, _sz, _vp, _vp, _vp],
    "xnn_create_max_pooling2d_nhwc_f32": [_u32] * 10 + [_sz] * 3 + [_f32, _f32, _u32, _op_out],
    "xnn_setup_max_pooling2d_nhwc_f32": [_vp, _sz, _sz, _sz, _vp, _vp, _vp],
    "xnn_create_average_pooling2d_nhwc_f32": [_u32] * 8 + [_sz] * 3 + [_f32, _f32, _u32, _op_out],
    "xnn_setup_average_pooling2d_nhwc_f32": [_vp, _sz, _sz, _sz, _vp, _vp, _vp],
    "xnn_create_global_average_pooling_nwc_f32": [_sz] * 3 + [_f32, _f32, _u32, _op_out],
    "xnn_setup_global_average_pooling_nwc_f32": [_vp, _sz, _sz, _vp, _vp, _vp],
    "xnn_create_add_nd_f32": [_f32, _f32, _u32, _op_out],
    "xnn_setup_add_nd_f32": [_vp, _sz, _szp, _sz, _szp, _vp, _vp, _vp, _vp],
    "xnn_create_clamp_nc_f32": [_sz] * 3 + [_f32, _f32, _u32, _op_out],
    "xnn_setup_clamp_nc_f32": [_vp, _sz, _vp, _vp, _vp],
    "xnn_create_softmax_nc_f32": [_sz] * 3 + [_u32, _op_out],
    "xnn_setup_softmax_nc_f32": [_vp, _sz, _vp, _vp, _vp],
    "xnn_create_copy_nc_x32": [_sz] * 3 + [_u32, _op_out],
    "xnn_setup_copy_nc_x32": [_vp, _sz, _vp, _vp, _vp],
}
# Elementwise operators the whole-model executor uses (all in the 2022 snapshot).
_BINARY = ("add", "multiply", "subtract", "divide", "maximum", "minimum")
_BINARY_RANGED = ("add", "multiply", "subtract", "divide")  # these take an output range at create
for _kind in _BINARY:
    _PROTOS[f"xnn_create_{_kind}_nd_f32"] = ([_f32, _f32] if _kind in _BINARY_RANGED else []) + [_u32, _op_out]
    _PROTOS[f"xnn_setup_{_kind}_nd_f32"] = [_vp, _sz, _szp, _sz, _szp, _vp, _vp, _vp, _vp]
_UNARY = {"sigmoid": [], "hardswish": [], "leaky_relu": [_f32], "elu": [_f32]}  # extra create parameters
for _kind, _extra in _UNARY.items():
    _PROTOS[f"xnn_create_{_kind}_nc_f32"] = [_sz] * 3 + _extra + [_u32, _op_out]
    _PROTOS[f"xnn_setup_{_kind}_nc_f32"] = [_vp, _sz, _vp, _vp, _vp]
_PROTOS["xnn_create_deconvolution2d_nhwc_f32"] = [_u32] * 11 + [_sz] * 4 + [_vp, _vp, _f32, _f32, _u32, _op_out]
_PROTOS["xnn_setup_deconvolution2d_nhwc_f32"] = [_vp, _sz, _sz, _sz, _u32, _u32, _vp, _vp, _vp]
_PROTOS["xnn_create_prelu_nc_f32"] = [_sz] * 3 + [_vp, _u32, _op_out]
_PROTOS["xnn_setup_prelu_nc_f32"] = [_vp, _sz, _vp, _vp, _vp]
_PROTOS["xnn_create_resize_bilinear2d_nhwc_f32"] = [_sz] * 3 + [_u32, _op_out]
_PROTOS["xnn_setup_resize_bilinear2d_nhwc_f32"] = [_vp] + [_sz] * 5 + [_vp, _vp, _vp]
XNN_FLAG_ALIGN_CORNERS = 0x00000008
XNN_FLAG_TENSORFLOW_LEGACY_MODE = 0x00000004

# The 2024 API (xnnpack.h of 0.0~git20241108). Convolution, deconvolution and fully connected take
# a code cache and a weights cache (none here); reshape takes the shapes and the pool and, for some
# operators, returns a workspace size and alignment and the output's height and width.
_i32 = ctypes.c_int32
_CACHES = [_vp, _vp]
_CONV_CREATE_2024 = [_u32] * 11 + [_sz] * 4 + [_vp, _vp, _f32, _f32, _u32] + _CACHES + [_op_out]
_PROTOS_2024 = {
    "xnn_initialize": [_vp],
    "xnn_deinitialize": [],
    "xnn_run_operator": [_vp, _vp],
    "xnn_delete_operator": [_vp],
    "xnn_create_convolution2d_nhwc_f32": _CONV_CREATE_2024,
    "xnn_reshape_convolution2d_nhwc_f32": [_vp, _sz, _sz, _sz, _szp, _szp, _szp, _szp, _vp],
    "xnn_setup_convolution2d_nhwc_f32": [_vp, _vp, _vp, _vp],
    "xnn_create_convolution2d_nchw_f32": _CONV_CREATE_2024,
    "xnn_reshape_convolution2d_nchw_f32": [_vp, _sz, _sz, _sz, _szp, _szp, _vp],
    "xnn_setup_convolution2d_nchw_f32": [_vp, _vp, _vp],
    "xnn_create_deconvolution2d_nhwc_f32": _CONV_CREATE_2024,
    "xnn_reshape_deconvolution2d_nhwc_f32": [_vp, _sz, _sz, _sz, _u32, _u32, _szp, _szp, _vp],
    "xnn_setup_deconvolution2d_nhwc_f32": [_vp, _vp, _vp],
    "xnn_create_fully_connected_nc_f32": [_sz] * 4 + [_vp, _vp, _f32, _f32, _u32] + _CACHES + [_op_out],
    "xnn_reshape_fully_connected_nc_f32": [_vp, _sz, _vp],
    "xnn_setup_fully_connected_nc_f32": [_vp, _vp, _vp],
    "xnn_create_max_pooling2d_nhwc_f32": [_u32] * 10 + [_f32, _f32, _u32, _op_out],
    "xnn_reshape_max_pooling2d_nhwc_f32": [_vp] + [_sz] * 6 + [_szp, _szp, _vp],
    "xnn_setup_max_pooling2d_nhwc_f32": [_vp, _vp, _vp],
    "xnn_create_average_pooling2d_nhwc_f32": [_u32] * 8 + [_f32, _f32, _u32, _op_out],
    "xnn_reshape_average_pooling2d_nhwc_f32": [_vp] + [_sz] * 6 + [_szp] * 4 + [_vp],
    "xnn_setup_average_pooling2d_nhwc_f32": [_vp, _vp, _vp, _vp],
    "xnn_create_binary_elementwise_nd": [_i32, _i32, _vp, _vp, _vp, _u32, _op_out],
    "xnn_reshape_binary_elementwise_nd": [_vp, _sz, _szp, _sz, _szp, _vp],
    "xnn_setup_binary_elementwise_nd": [_vp, _vp, _vp, _vp],
    "xnn_create_unary_elementwise_nc": [_i32, _i32, _i32, _vp, _vp, _vp, _u32, _op_out],
    "xnn_reshape_unary_elementwise_nc": [_vp] + [_sz] * 4 + [_vp],
    "xnn_setup_unary_elementwise_nc": [_vp, _vp, _vp],
    "xnn_create_softmax_nc_f32": [_u32, _op_out],
    "xnn_reshape_softmax_nc_f32": [_vp] + [_sz] * 4 + [_vp],
    "xnn_setup_softmax_nc_f32": [_vp, _vp, _vp],
    "xnn_create_copy_nc_x32": [_u32, _op_out],
    "xnn_reshape_copy_nc_x32": [_vp] + [_sz] * 4 + [_vp],
    "xnn_setup_copy_nc_x32": [_vp, _vp, _vp],
    "xnn_create_resize_bilinear2d_nhwc_f32": [_sz, _sz, _u32, _op_out],
    "xnn_reshape_resize_bilinear2d_nhwc_f32": [_vp] + [_sz] * 6 + [_szp, _szp, _vp],
    "xnn_setup_resize_bilinear2d_nhwc_f32": [_vp, _vp, _vp, _vp],
}
# every convolution, deconvolution and fully connected operator of the 2024 API, whatever its type
_TAKES_CACHES_2024 = ("xnn_create_convolution2d_", "xnn_create_deconvolution2d_", "xnn_create_fully_connected_nc_")
# enum xnn_datatype of the 2024 header
XNN_DATATYPE_FP32, XNN_DATATYPE_FP16, XNN_DATATYPE_QINT8, XNN_DATATYPE_QUINT8 = 1, 2, 3, 4
# enum xnn_binary_operator and enum xnn_unary_operator of the 2024 header
_BINARY_2024 = {"add": 0, "subtract": 1, "multiply": 2, "divide": 3, "maximum": 4, "minimum": 5, "prelu": 8}
_UNARY_2024 = {"convert": 0, "clamp": 1, "elu": 5, "hardswish": 9, "leaky_relu": 10, "sigmoid": 13}


_DATATYPES_2024 = {"qs8": XNN_DATATYPE_QINT8, "qu8": XNN_DATATYPE_QUINT8}


class _QuantizationParams(ctypes.Structure):
    """``struct xnn_quantization_params`` of the 2024 header: a tensor's grid."""
    _fields_ = [("zero_point", ctypes.c_int32), ("scale", ctypes.c_float)]


class _Lib:
    """The loaded libraries, with prototypes set; ``xnn_initialize`` called once."""

    def __init__(self) -> None:
        # kselect's pthreadpool shim (tileshim.c) goes first, so XNNPack's parallel-loop calls
        # bind to it; it forwards to libpthreadpool. Optional: never fails the load.
        tileshim_build.preload()
        try:
            # Load pthreadpool first (global) so XNNPack resolves its PLT calls against it.
            self.pool = ctypes.CDLL(LIBPTHREADPOOL, mode=ctypes.RTLD_GLOBAL)
        except OSError as e:
            raise XNNPackUnavailable(
                f"libpthreadpool0 not installed ({LIBPTHREADPOOL}: {e}): "
                "apt-get install libpthreadpool-dev") from e
        self.xnn = self._load_xnnpack()
        self.api = API_2024 if hasattr(self.xnn, "xnn_reshape_convolution2d_nhwc_f32") else API_2022
        self.package = DEBIAN_PACKAGE_2024 if self.soname == LIBXNNPACK_2024 else DEBIAN_PACKAGE
        required, prototypes = ((REQUIRED_SYMBOLS_2024, _PROTOS_2024) if self.api == API_2024
                                else (REQUIRED_SYMBOLS, _PROTOS))
        missing = [s for s in required if not hasattr(self.xnn, s)]
        missing += [s for s in REQUIRED_POOL_SYMBOLS if not hasattr(self.pool, s)]
        if missing:
            raise XNNPackUnavailable(
                f"{self.soname} lacks needed symbol(s) {', '.join(missing)} "
                f"(installed {self.package} {library_version(self.package)!r}; this binding targets the "
                "0.0~git20220216 and 0.0~git20241108 APIs)")
        for name, argtypes in prototypes.items():
            fn = getattr(self.xnn, name)
            fn.argtypes = argtypes
            fn.restype = ctypes.c_int
        self.pool.pthreadpool_create.argtypes = [_sz]
        self.pool.pthreadpool_create.restype = _vp
        self.pool.pthreadpool_destroy.argtypes = [_vp]
        self.pool.pthreadpool_destroy.restype = None
        self.pool.pthreadpool_get_threads_count.argtypes = [_vp]
        self.pool.pthreadpool_get_threads_count.restype = _sz
        status = self.xnn.xnn_initialize(None)
        if status != 0:
            raise XNNPackUnavailable(
                f"xnn_initialize failed: {STATUS_NAMES.get(status, status)}"
                + (" (this CPU lacks SSE2?)" if status == 5 else ""))

    def _load_xnnpack(self) -> ctypes.CDLL:
        """Debian 12's soname, else Debian 13's; the first one's error when neither loads."""
        first_error = None
        for soname in (LIBXNNPACK, LIBXNNPACK_2024):
            try:
                xnn = ctypes.CDLL(soname, mode=ctypes.RTLD_GLOBAL)
            except OSError as e:
                first_error = first_error or e
                continue
            self.soname = soname
            return xnn
        raise XNNPackUnavailable(
            f"{DEBIAN_PACKAGE} not installed ({LIBXNNPACK}: {first_error}): {INSTALL_HINT}") from first_error


_LIB: _Lib | None = None
_LIB_ERROR: XNNPackUnavailable | None = None


def lib() -> _Lib:
    """The loaded, initialized library; raises :class:`XNNPackUnavailable` with the reason."""
    global _LIB, _LIB_ERROR
    if _LIB is None:
        if _LIB_ERROR is not None:
            raise _LIB_ERROR
        try:
            _LIB = _Lib()
        except XNNPackUnavailable as e:
            _LIB_ERROR = e
            raise
    return _LIB


def availability() -> tuple[bool, str]:
    """``(True, "libxnnpack0 <version>")`` or ``(False, reason)`` -- never raises."""
    try:
        lib()
    except XNNPackUnavailable as e:
        return False, str(e)
    except Exception as e:  # pragma: no cover - defensive
        return False, f"{type(e).__name__}: {e}"
    return True, f"{lib().package} {library_version() or 'unknown version'}"


def api() -> int:
    """``API_2022`` or ``API_2024``: the API of the loaded build."""
    return lib().api


def installed_package() -> str:
    """The Debian package of the loaded build (``libxnnpack0`` until one is loaded)."""
    return _LIB.package if _LIB is not None else DEBIAN_PACKAGE


def library_version(package: str | None = None) -> str | None:
    """Debian version of ``package`` (default: the loaded build's; the library has no version call),
    or None."""
    return _package_version(package or installed_package())


@functools.lru_cache(maxsize=None)
def _package_version(package: str) -> str | None:
    try:
        out = subprocess.run(
            ["dpkg-query", "-W", "-f=${Version}", package],
            capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    if out.returncode != 0 or not out.stdout.strip():
        return None
    return out.stdout.strip()


def _check(status: int, function: str, detail: str = "") -> None:
    if status != 0:
        raise XNNPackError(status, function, detail)


_addressof = ctypes.addressof
_from_buffer = ctypes.c_char.from_buffer


def _ptr(a: np.ndarray) -> int:
    """Data address of a C-contiguous array (~1 us; ``a.ctypes.data`` costs ~3 us)."""
    try:
        return _addressof(_from_buffer(a))
    except (TypeError, ValueError):  # read-only or empty buffer
        return a.ctypes.data


def _as_f32(a, name: str, dtype=np.float32) -> np.ndarray:
    """``a`` checked to be a C-contiguous array of ``dtype`` (float32, or float16 for an f16 operator)."""
    a = np.asarray(a)
    if a.dtype != dtype:
        raise TypeError(f"{name}: expected {np.dtype(dtype).name}, got {a.dtype}")
    if not a.flags.c_contiguous:
        raise ValueError(f"{name}: expected a C-contiguous array")
    return a


def _out(out, shape: tuple, name: str = "out", dtype=np.float32) -> np.ndarray:
    if out is None:
        return np.empty(shape, dtype=dtype)
    out = _as_f32(out, name, dtype)
    if tuple(out.shape) != tuple(shape):
        raise ValueError(f"{name}: expected shape {tuple(shape)}, got {tuple(out.shape)}")
    if not out.flags.writeable:
        raise ValueError(f"{name}: not writeable")
    return out


# --------------------------------------------------------------------------------------------
# Threadpool
# --------------------------------------------------------------------------------------------

class Threadpool:
    """``pthreadpool_create(num_threads)``; 0 means one thread per logical CPU."""

    def __init__(self, num_threads: int):
        if num_threads < 0:
            raise ValueError("num_threads must be >= 0")
        self._lib = lib()
        handle = self._lib.pool.pthreadpool_create(int(num_threads))
        if not handle:
            raise MemoryError("pthreadpool_create returned NULL")
        self._handle = handle

    @property
    def handle(self) -> int:
        if not self._handle:
            raise ValueError("threadpool is closed")
        return self._handle

    @property
    def threads_count(self) -> int:
        return int(self._lib.pool.pthreadpool_get_threads_count(self.handle))

    def close(self) -> None:
        h, self._handle = getattr(self, "_handle", None), None
        if h:
            self._lib.pool.pthreadpool_destroy(h)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass

    def __repr__(self):
        return f"Threadpool({self.threads_count if self._handle else 'closed'})"


def _pool_handle(pool: Threadpool | None):
    return None if pool is None else pool.handle


# --------------------------------------------------------------------------------------------
# Operators
# --------------------------------------------------------------------------------------------

def _pair(v, name: str) -> tuple[int, int]:
    if isinstance(v, (int, np.integer)):
        return int(v), int(v)
    v = tuple(int(x) for x in v)
    if len(v) != 2:
        raise ValueError(f"{name}: expected an int or 2 ints, got {v}")
    return v


def _pads(p) -> tuple[int, int, int, int]:
    """Padding as (top, left, bottom, right) from an int, (ph, pw), or ONNX (t, l, b, r)."""
    if isinstance(p, (int, np.integer)):
        return (int(p),) * 4
    p = tuple(int(x) for x in p)
    if len(p) == 2:
        return p[0], p[1], p[0], p[1]
    if len(p) == 4:
        return p
    raise ValueError(f"padding: expected int, (h, w) or (top, left, bottom, right), got {p}")


def conv_output_size(size: int, kernel: int, stride: int, dilation: int, pad_before: int,
                     pad_after: int) -> int:
    eff = (kernel - 1) * dilation + 1
    padded = size + pad_before + pad_after
    return max(0, (padded - eff) // stride + 1) if padded >= eff else 0


class Operator:
    """Base: owns one ``xnn_operator_t``."""

    _setup_name = ""
    dtype = np.float32  # the element type of its input and output tensors (float16 for an f16 operator)

    def __init__(self, threadpool: Threadpool | None = None):
        self._lib = lib()
        self._op = ctypes.c_void_p()
        self.threadpool = threadpool
        self._last = None

    def _create(self, fn_name: str, *args) -> None:
        if self._lib.api == API_2024 and fn_name.startswith(_TAKES_CACHES_2024):
            args += (None, None)  # no code cache, no weights cache
        fn = getattr(self._lib.xnn, fn_name)
        _check(fn(*args, ctypes.byref(self._op)), fn_name, self._describe())
        self._run_fn = self._lib.xnn.xnn_run_operator
        self._setup_fn = getattr(self._lib.xnn, fn_name.replace("xnn_create_", "xnn_setup_"))
        self._setup_name = fn_name.replace("xnn_create_", "xnn_setup_")
        if self._lib.api == API_2024:
            self._reshape_name = fn_name.replace("xnn_create_", "xnn_reshape_")
            self._reshape_fn = getattr(self._lib.xnn, self._reshape_name)
            self._workspace = None

    def _bind_arrays(self, pointers: tuple, threadpool, shapes: tuple, shapes_2024: tuple | None = None, *,
                     workspace: bool = False, output_dims: int = 0) -> None:
        """Binds the operator to its arrays' ``pointers`` for arrays of these ``shapes``.

        2022 API: ``xnn_setup_*(op, *shapes, *pointers, pool)``. 2024 API: ``xnn_reshape_*(op,
        *shapes_2024 (default shapes), [&workspace size, &alignment], [&output dims], pool)``, then
        ``xnn_setup_*(op, [workspace], *pointers)``; ``workspace`` and ``output_dims`` say which of
        the bracketed arguments this operator's reshape has.
        """
        pool = self._pool(threadpool)
        if self._lib.api == API_2022:
            _check(self._setup_fn(self.handle, *shapes, *pointers, pool), self._setup_name)
            return
        results = [_sz() for _ in range(2 * workspace + output_dims)]
        _check(self._reshape_fn(self.handle, *(shapes if shapes_2024 is None else shapes_2024),
                                *(ctypes.byref(r) for r in results), pool), self._reshape_name)
        workspace_args = ()
        if workspace:
            size, alignment = results[0].value, max(1, results[1].value)
            self._workspace = np.empty(size + alignment, np.uint8) if size else None
            address = None
            if self._workspace is not None:
                base = _ptr(self._workspace)
                address = base + (-base) % alignment
            workspace_args = (address,)
        _check(self._setup_fn(self.handle, *workspace_args, *pointers), self._setup_name)

    @property
    def handles(self) -> tuple[int, ...]:
        """The native operators ``xnn_run_operator`` runs, in order, for one run of this one."""
        return (self.handle,)

    def _describe(self) -> str:
        return ""

    @property
    def handle(self) -> int:
        if not self._op:
            raise ValueError(f"{type(self).__name__} is closed")
        return self._op.value

    def _pool(self, threadpool):
        pool = self.threadpool if threadpool is None else threadpool
        return None if pool is None else pool.handle

    def setup(self, *args, **kwargs) -> np.ndarray:
        """``xnn_setup_*`` for these arrays (returns the output array); then :meth:`execute`."""
        self._last = None
        return self._setup(*args, **kwargs)

    def _setup(self, *args, **kwargs):
        raise NotImplementedError

    def run(self, x, out=None, threadpool=None) -> np.ndarray:
        """setup (skipped when x, out and pool are the very objects of the last call) + run."""
        if not self._cached(x, out, threadpool):
            out = self._setup(x, out, threadpool)
            self._remember(x, out, threadpool)
        self.execute(threadpool)
        return out

    def execute(self, threadpool: Threadpool | None = None) -> None:
        """``xnn_run_operator`` alone (after a setup with the same pointers)."""
        op = self._op.value
        if not op:
            raise ValueError(f"{type(self).__name__} is closed")
        pool = self.threadpool if threadpool is None else threadpool
        status = self._run_fn(op, None if pool is None else pool.handle)
        if status:
            raise XNNPackError(status, "xnn_run_operator")

    def _setup_nhwc(self, x, channels: int, out, threadpool) -> np.ndarray:
        """``xnn_setup_*(op, N, H, W, x, out, pool)`` of an NHWC operator with ``channels`` inputs."""
        x = _as_f32(x, "x", self.dtype)
        if x.ndim != 4 or x.shape[3] != channels:
            raise ValueError(f"x: expected (N, H, W, {channels}), got {x.shape}")
        out = _out(out, self.output_shape(x.shape), dtype=self.dtype)
        self._bind_arrays((_ptr(x), _ptr(out)), threadpool, x.shape[:3], self._reshape_shapes_2024(x.shape),
                          **self._reshape_results_2024)
        return out

    # what this NHWC operator's xnn_reshape_* takes beyond (N, H, W), and returns (2024 API)
    _reshape_results_2024 = {"workspace": True, "output_dims": 2}

    def _reshape_shapes_2024(self, input_shape) -> tuple:
        return tuple(input_shape[:3])

    def _cached(self, x, out, threadpool) -> bool:
        """True when the last setup used these very arrays (same shape) and pool."""
        last = self._last
        return (last is not None and out is not None and last[0] is x and last[1] is out
                and last[2] == x.shape and last[3] is threadpool)

    def _remember(self, x, out, threadpool) -> None:
        # Holding x and out keeps their buffers alive, so their addresses cannot be reused.
        self._last = (x, out, x.shape, threadpool)

    def close(self) -> None:
        op = getattr(self, "_op", None)
        if op:
            self._lib.xnn.xnn_delete_operator(op)
            self._op = ctypes.c_void_p()
        self._last = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass


class _Conv2DBase(Operator):
    def __init__(self, weights, bias=None, *, stride=1, dilation=1, padding=0, groups=1,
                 depthwise_flag: bool = False, weight_layout: str = "OIHW",
                 output_min: float = -math.inf, output_max: float = math.inf,
                 flags: int = 0, threadpool: Threadpool | None = None):
        super().__init__(threadpool)
        w = np.asarray(weights, dtype=np.float32)
        if w.ndim != 4:
            raise ValueError("weights must be 4-D (OIHW or OHWI)")
        if weight_layout == "OIHW":
            O, Ig, kh, kw = w.shape
        elif weight_layout == "OHWI":
            O, kh, kw, Ig = w.shape
        else:
            raise ValueError("weight_layout must be 'OIHW' or 'OHWI'")
        groups = int(groups)
        if groups < 1 or O % groups:
            raise ValueError(f"output channels {O} not divisible by groups {groups}")
        self.groups = groups
        self.group_input_channels = Ig
        self.group_output_channels = O // groups
        self.input_channels = Ig * groups
        self.output_channels = O
        self.kernel = (kh, kw)
        self.stride = _pair(stride, "stride")
        self.dilation = _pair(dilation, "dilation")
        self.padding = _pads(padding)  # top, left, bottom, right
        self.output_min, self.output_max = float(output_min), float(output_max)
        self.weight_layout = weight_layout
        self._w_oihw = w if weight_layout == "OIHW" else None
        self._w_ohwi = w if weight_layout == "OHWI" else None
        if bias is not None:
            b = np.ascontiguousarray(bias, dtype=np.float32).reshape(-1)
            if b.size != O:
                raise ValueError(f"bias has {b.size} elements, expected {O}")
        else:
            b = None
        self._bias = b
        self.flags = int(flags) | (XNN_FLAG_DEPTHWISE_CONVOLUTION if depthwise_flag else 0)

    def _ohwi(self) -> np.ndarray:
        if self._w_ohwi is None:
            self._w_ohwi = np.ascontiguousarray(self._w_oihw.transpose(0, 2, 3, 1))
        return np.ascontiguousarray(self._w_ohwi)

    def _oihw(self) -> np.ndarray:
        if self._w_oihw is None:
            self._w_oihw = np.ascontiguousarray(self._w_ohwi.transpose(0, 3, 1, 2))
        return np.ascontiguousarray(self._w_oihw)

    def _create_conv(self, fn_name: str, kernel_array: np.ndarray, flags: int):
        t, l, b, r = self.padding
        bias = self._bias
        self._create(
            fn_name, t, r, b, l, self.kernel[0], self.kernel[1], self.stride[0], self.stride[1],
            self.dilation[0], self.dilation[1], self.groups, self.group_input_channels,
            self.group_output_channels, self.input_channels, self.output_channels,
            _ptr(kernel_array), None if bias is None else _ptr(bias),
            self.output_min, self.output_max, flags)
        # XNNPack copied/packed the weights: drop our copies.
        self._w_oihw = self._w_ohwi = None
        self._bias = None

    def _describe(self) -> str:
        return (f"{type(self).__name__} k={self.kernel} s={self.stride} d={self.dilation} "
                f"pad(t,l,b,r)={self.padding} groups={self.groups} "
                f"cin/g={self.group_input_channels} cout/g={self.group_output_channels}")

    def output_hw(self, h: int, w: int) -> tuple[int, int]:
        t, l, b, r = self.padding
        return (conv_output_size(h, self.kernel[0], self.stride[0], self.dilation[0], t, b),
                conv_output_size(w, self.kernel[1], self.stride[1], self.dilation[1], l, r))


class Convolution2DNHWC(_Conv2DBase):
    """``xnn_create_convolution2d_nhwc_f32``: dense, grouped and depthwise (groups == C_in);
    ``datatype="f16"``: ``xnn_create_convolution2d_nhwc_f16`` on float16 tensors, weights and bias
    still given in float32 (``_creation``).

    ``weights``: OIHW (ONNX; default) or OHWI, shape (C_out, C_in/groups, kh, kw).
    ``padding``: int, (ph, pw) or ONNX order (top, left, bottom, right).
    Input (N, H, W, C_in) -> output (N, OH, OW, C_out).
    """

    def __init__(self, weights, bias=None, *, datatype: str = "f32", **kw):
        super().__init__(weights, bias, **kw)
        create, extra_flags, self.dtype = _creation("convolution2d_nhwc", datatype)
        if self.flags & XNN_FLAG_DEPTHWISE_CONVOLUTION:
            # Depthwise flag: kernel [1, kh, kw, groups * depth_multiplier] (HWG).
            kernel = np.ascontiguousarray(self._oihw().reshape(self.output_channels, -1).T)
        else:
            # XNNPack NHWC kernel layout: [groups, group_output_channels, kh, kw, group_input_channels].
            kernel = self._ohwi()
        self._create_conv(create, kernel, self.flags | extra_flags)

    def output_shape(self, input_shape) -> tuple:
        n, h, w, c = input_shape
        return (n, *self.output_hw(h, w), self.output_channels)

    def _setup(self, x: np.ndarray, out=None, threadpool=None) -> np.ndarray:
        return self._setup_nhwc(x, self.input_channels, out, threadpool)


def nchw_convolution_supported(kernel, stride=1, dilation=1, padding=0, groups=1,
                               input_channels=None, output_channels=None,
                               input_nhwc: bool = False) -> tuple[bool, str]:
    """Which NCHW convolutions this build (convolution-nchw.c @ 20220216) accepts.

    Returns ``(ok, path)`` with path one of "spmm", "conv2d_hwc2chw", "dwconv2d_chw_3x3",
    "dwconv2d_chw_3x3s2", "dwconv2d_chw_5x5", "dwconv2d_chw_5x5s2", or a reason.
    """
    kh, kw = _pair(kernel, "kernel")
    sh, sw = _pair(stride, "stride")
    dh, dw = _pair(dilation, "dilation")
    t, l, b, r = _pads(padding)
    any_pad = (t | l | b | r) != 0
    gi = None if input_channels is None else input_channels // groups
    go = None if output_channels is None else output_channels // groups
    is_1x1 = kh == kw == 1 and sh == sw == 1
    is_3x3 = kh == kw == 3 and dh == dw == 1
    is_5x5 = kh == kw == 5 and dh == dw == 1
    dw_ok = gi == 1 and go == 1
    if is_1x1 and not any_pad and not input_nhwc and groups == 1:
        return True, "spmm"
    if is_3x3 and sh == sw == 2 and (t, l, b, r) == (1, 1, 1, 1) and input_nhwc and groups == 1:
        # The build accepts any C_in here but its kernel reads 3 channels: other counts give
        # silently wrong results (measured), so they are refused before creation.
        if gi is not None and gi != 3:
            return False, "the 3x3/s2 HWC->CHW kernel is written for 3 input channels (XNNPack accepts others and computes garbage)"
        return True, "conv2d_hwc2chw"
    if is_3x3 and sh == sw == 1 and (t, l, b, r) == (1, 1, 1, 1) and not input_nhwc and dw_ok:
        return True, "dwconv2d_chw_3x3"
    if is_3x3 and sh == sw == 2 and t in (0, 1) and (l, b, r) == (1, 1, 1) and not input_nhwc and dw_ok:
        return True, "dwconv2d_chw_3x3s2"
    if is_5x5 and sh == sw == 1 and (t, l, b, r) == (2, 2, 2, 2) and not input_nhwc and dw_ok:
        return True, "dwconv2d_chw_5x5"
    if is_5x5 and sh == sw == 2 and t in (1, 2) and (l, b, r) == (2, 2, 2) and not input_nhwc and dw_ok:
        return True, "dwconv2d_chw_5x5s2"
    return False, ("unsupported by xnn_create_convolution2d_nchw_f32 in this build: only 1x1/s1/unpadded "
                   "dense, 3x3/s2/p1 with NHWC input (C_in=3 micro-kernel), and depthwise 3x3 "
                   "(s1 p1; s2 p1 with top 0|1) or 5x5 (s1 p2; s2 p2 with top 1|2) are implemented")


class Convolution2DNCHW(_Conv2DBase):
    """``xnn_create_convolution2d_nchw_f32`` (SpMM for 1x1, CHW depthwise, 3x3s2 HWC->CHW).

    Input (N, C_in, H, W) -- or (N, H, W, C_in) with ``input_nhwc=True`` -- -> (N, C_out, OH, OW).
    Shapes this build does not implement raise ``XNNPackError`` with
    ``status_name == "xnn_status_unsupported_parameter"`` at creation.
    Note: the 3x3s2 HWC->CHW micro-kernel is written for 3 input channels.
    """

    def __init__(self, weights, bias=None, *, input_nhwc: bool = False, **kw):
        super().__init__(weights, bias, **kw)
        self.input_nhwc = bool(input_nhwc)
        ok, self.path = nchw_convolution_supported(
            self.kernel, self.stride, self.dilation, self.padding, self.groups,
            self.input_channels, self.output_channels, self.input_nhwc)
        flags = self.flags | (XNN_FLAG_INPUT_NHWC if self.input_nhwc else 0)
        if not ok and self.input_nhwc and "3 input channels" in self.path:
            raise XNNPackError(4, "xnn_create_convolution2d_nchw_f32", self.path)
        if ok and self.path == "conv2d_hwc2chw":
            kernel = self._ohwi()  # xnn_pack_f32_dconv_oki_w: [O][kh][kw][I]
        elif self.flags & XNN_FLAG_DEPTHWISE_CONVOLUTION:
            kernel = np.ascontiguousarray(self._oihw().reshape(self.output_channels, -1).T)  # HWG
        else:
            kernel = self._oihw()  # spmm: [O][I]; dwconv ghw: [G][kh][kw]
        self._create_conv("xnn_create_convolution2d_nchw_f32", kernel, flags)

    def output_shape(self, input_shape) -> tuple:
        if self.input_nhwc:
            n, h, w, c = input_shape
        else:
            n, c, h, w = input_shape
        return (n, self.output_channels, *self.output_hw(h, w))

    def _setup(self, x: np.ndarray, out=None, threadpool=None) -> np.ndarray:
        x = _as_f32(x, "x")
        c = x.shape[3] if self.input_nhwc else x.shape[1]
        if x.ndim != 4 or c != self.input_channels:
            raise ValueError(f"x: expected {self.input_channels} channels, got shape {x.shape}")
        n, h, w = (x.shape[0], x.shape[1], x.shape[2]) if self.input_nhwc else (x.shape[0], x.shape[2], x.shape[3])
        out = _out(out, self.output_shape(x.shape))
        self._bind_arrays((_ptr(x), _ptr(out)), threadpool, (n, h, w), output_dims=2)
        return out


class _DeconvGeometry:
    """Shared by the float and 8-bit deconvolutions (ONNX's ConvTranspose in NHWC): the geometry
    from ONNX's attributes, XNNPack's kernel layout, the output shape and the setup call."""

    def _set_geometry(self, w: np.ndarray, stride, dilation, padding, groups, adjustment) -> np.ndarray:
        """Checks ONNX's (C_in, C_out / groups, kh, kw) weights and sets the geometry; returns the
        weights in XNNPack's layout."""
        if w.ndim != 4:
            raise ValueError("weights must be 4-D (C_in, C_out / groups, kh, kw)")
        cin, cout_g, kh, kw = w.shape
        groups = int(groups)
        if groups < 1 or cin % groups:
            raise ValueError(f"input channels {cin} not divisible by groups {groups}")
        self.groups, self.input_channels, self.output_channels = groups, cin, cout_g * groups
        self.kernel, self.stride, self.dilation = (kh, kw), _pair(stride, "stride"), _pair(dilation, "dilation")
        self.padding = _pads(padding)
        self.adjustment = _pair(adjustment, "adjustment")
        # XNNPack's layout: [groups][C_out / groups][kh][kw][C_in / groups]
        return np.ascontiguousarray(w.reshape(groups, cin // groups, cout_g, kh, kw).transpose(0, 2, 3, 4, 1))

    def _geometry_args(self) -> tuple:
        """``xnn_create_deconvolution2d_nhwc_*``'s arguments from the padding to the output channels."""
        t, l, b, r = self.padding
        groups, cin, cout = self.groups, self.input_channels, self.output_channels
        return (t, r, b, l, *self.kernel, *self.stride, *self.dilation, groups, cin // groups, cout // groups, cin,
                cout)

    def _describe_geometry(self) -> str:
        return (f"k={self.kernel} s={self.stride} d={self.dilation} pad(t,l,b,r)={self.padding} groups={self.groups} "
                f"adjustment={self.adjustment}")

    def output_shape(self, input_shape) -> tuple:
        n, h, w, _ = input_shape
        t, l, b, r = self.padding
        size = [self.stride[axis] * (hw - 1) + self.adjustment[axis] + (self.kernel[axis] - 1) * self.dilation[axis] + 1
                for axis, hw in enumerate((h, w))]
        return (n, size[0] - t - b, size[1] - l - r, self.output_channels)

    def _check_input(self, x: np.ndarray) -> np.ndarray:
        if x.ndim != 4 or x.shape[3] != self.input_channels:
            raise ValueError(f"x: expected (N, H, W, {self.input_channels}), got {x.shape}")
        return x

    def _setup_deconv(self, x: np.ndarray, out: np.ndarray, threadpool) -> np.ndarray:
        self._bind_arrays((_ptr(x), _ptr(out)), threadpool, (*x.shape[:3], *self.adjustment), output_dims=2)
        return out


class Deconvolution2DNHWC(_DeconvGeometry, Operator):
    """``xnn_create_deconvolution2d_nhwc_f32``: ONNX's ConvTranspose in NHWC; ``datatype="f16"``:
    ``xnn_create_deconvolution2d_nhwc_f16`` on float16 tensors, weights and bias still given in
    float32 (``_creation``).

    ``weights``: ONNX's (C_in, C_out / groups, kh, kw); ``padding``: ONNX's pads (top, left,
    bottom, right), cropped from the output; ``adjustment``: ONNX's output_padding (h, w).
    Input (N, H, W, C_in) -> output (N, OH, OW, C_out).
    """

    def __init__(self, weights, bias=None, *, stride=1, dilation=1, padding=0, groups=1, adjustment=(0, 0),
                 output_min: float = -math.inf, output_max: float = math.inf, threadpool: Threadpool | None = None,
                 datatype: str = "f32"):
        super().__init__(threadpool)
        create, flags, self.dtype = _creation("deconvolution2d_nhwc", datatype)
        kernel = self._set_geometry(np.asarray(weights, dtype=np.float32), stride, dilation, padding, groups,
                                    adjustment)
        b = None if bias is None else np.ascontiguousarray(bias, dtype=np.float32).reshape(-1)
        if b is not None and b.size != self.output_channels:
            raise ValueError(f"bias has {b.size} elements, expected {self.output_channels}")
        self._create(create, *self._geometry_args(), _ptr(kernel), None if b is None else _ptr(b), float(output_min),
                     float(output_max), flags)

    def _describe(self) -> str:
        return f"{type(self).__name__} {self._describe_geometry()}"

    def _setup(self, x: np.ndarray, out=None, threadpool=None) -> np.ndarray:
        x = self._check_input(_as_f32(x, "x", self.dtype))
        return self._setup_deconv(x, _out(out, self.output_shape(x.shape), dtype=self.dtype), threadpool)


class FullyConnected(Operator):
    """``xnn_create_fully_connected_nc_f32``: y = x @ W.T + b; ``datatype="f16"``:
    ``xnn_create_fully_connected_nc_f16`` on float16 tensors, weights and bias still given in
    float32 (``_creation``).

    ``weights``: (C_out, C_in) (ONNX Gemm transB=1 / MatMul weight transposed); pass
    ``transpose_weights=True`` for (C_in, C_out).  Input (..., C_in) -> (..., C_out).
    """

    def __init__(self, weights, bias=None, *, transpose_weights: bool = False,
                 output_min: float = -math.inf, output_max: float = math.inf,
                 threadpool: Threadpool | None = None, datatype: str = "f32"):
        super().__init__(threadpool)
        create, flags, self.dtype = _creation("fully_connected_nc", datatype)
        w = np.ascontiguousarray(weights, dtype=np.float32)
        if w.ndim != 2:
            raise ValueError("weights must be 2-D")
        if transpose_weights:
            self.input_channels, self.output_channels = w.shape
        else:
            self.output_channels, self.input_channels = w.shape
        b = None if bias is None else np.ascontiguousarray(bias, dtype=np.float32).reshape(-1)
        if b is not None and b.size != self.output_channels:
            raise ValueError("bias size mismatch")
        self._create(create, self.input_channels, self.output_channels,
                     self.input_channels, self.output_channels, _ptr(w),
                     None if b is None else _ptr(b), float(output_min), float(output_max),
                     flags | (XNN_FLAG_TRANSPOSE_WEIGHTS if transpose_weights else 0))

    def _setup(self, x, out=None, threadpool=None) -> np.ndarray:
        x = _as_f32(x, "x", self.dtype)
        if x.ndim < 1 or x.shape[-1] != self.input_channels:
            raise ValueError(f"x: expected (..., {self.input_channels}), got {x.shape}")
        out = _out(out, x.shape[:-1] + (self.output_channels,), dtype=self.dtype)
        batch = x.size // self.input_channels
        self._bind_arrays((_ptr(x), _ptr(out)), threadpool, (batch,))
        return out


class _Pool2DBase(Operator):
    def _setup(self, x, out=None, threadpool=None) -> np.ndarray:
        return self._setup_nhwc(x, self.channels, out, threadpool)

    def _reshape_shapes_2024(self, input_shape) -> tuple:
        return (*input_shape[:3], self.channels, self.channels, self.channels)

    def output_shape(self, input_shape) -> tuple:
        n, h, w, c = input_shape
        t, l, b, r = self.padding
        return (n, conv_output_size(h, self.pool[0], self.stride[0], self.dilation[0], t, b),
                conv_output_size(w, self.pool[1], self.stride[1], self.dilation[1], l, r), c)


class MaxPooling2D(_Pool2DBase):
    """``xnn_create_max_pooling2d_nhwc_f32`` (NHWC; padding is -inf, as ONNX MaxPool)."""

    def __init__(self, channels: int, pool, *, stride=None, dilation=1, padding=0,
                 output_min: float = -math.inf, output_max: float = math.inf,
                 threadpool: Threadpool | None = None):
        super().__init__(threadpool)
        self.channels = int(channels)
        self.pool = _pair(pool, "pool")
        self.stride = self.pool if stride is None else _pair(stride, "stride")
        self.dilation = _pair(dilation, "dilation")
        self.padding = _pads(padding)
        t, l, b, r = self.padding
        # the 2022 API takes the channels (and pixel strides) at creation, the 2024 one at reshape
        channels = (self.channels,) * 3 if api() == API_2022 else ()
        self._create("xnn_create_max_pooling2d_nhwc_f32", t, r, b, l, self.pool[0], self.pool[1],
                     self.stride[0], self.stride[1], self.dilation[0], self.dilation[1],
                     *channels, float(output_min), float(output_max), 0)

    _reshape_results_2024 = {"output_dims": 2}


class AveragePooling2D(_Pool2DBase):
    """``xnn_create_average_pooling2d_nhwc_f32`` (NHWC).

    With padding, XNNPack divides by the number of non-padding pixels in each window
    (ONNX ``count_include_pad=0``); without padding all windows are full.
    """

    def __init__(self, channels: int, pool, *, stride=None, padding=0,
                 output_min: float = -math.inf, output_max: float = math.inf,
                 threadpool: Threadpool | None = None):
        super().__init__(threadpool)
        self.channels = int(channels)
        self.pool = _pair(pool, "pool")
        self.stride = self.pool if stride is None else _pair(stride, "stride")
        self.dilation = (1, 1)
        self.padding = _pads(padding)
        t, l, b, r = self.padding
        channels = (self.channels,) * 3 if api() == API_2022 else ()
        self._create("xnn_create_average_pooling2d_nhwc_f32", t, r, b, l, self.pool[0], self.pool[1],
                     self.stride[0], self.stride[1], *channels, float(output_min), float(output_max), 0)


class GlobalAveragePooling(Operator):
    """``xnn_create_global_average_pooling_nwc_f32``: (N, W, C) or (N, H, W, C) -> (N, C)."""

    def __init__(self, channels: int, *, output_min: float = -math.inf,
                 output_max: float = math.inf, threadpool: Threadpool | None = None):
        super().__init__(threadpool)
        self.channels = int(channels)
        if api() == API_2022:
            self._create("xnn_create_global_average_pooling_nwc_f32", self.channels, self.channels,
                         self.channels, float(output_min), float(output_max), 0)
        else:
            # The 2024 build's mean (xnn_create_reduce_nd over W of (N, W, C)) crashed in its run in
            # the arm64 root: an average pooling over the whole (1, W) window is made at setup, when
            # W is known; a window of one pixel (which XNNPack's pooling refuses) is a copy.
            if output_min != -math.inf or output_max != math.inf:
                raise ValueError("global average pooling takes no output range on the 2024 API")
            self._width = None

    def _setup(self, x, out=None, threadpool=None) -> np.ndarray:
        x = _as_f32(x, "x")
        if x.ndim not in (3, 4) or x.shape[-1] != self.channels:
            raise ValueError(f"x: expected (N, W, {self.channels}) or (N, H, W, {self.channels})")
        n = x.shape[0]
        width = x.size // (n * self.channels) if n else 0
        out = _out(out, (n, self.channels))
        if api() == API_2022:
            self._bind_arrays((_ptr(x), _ptr(out)), threadpool, (n, width))
            return out
        self._create_for_width_2024(width)
        c = self.channels
        if width == 1:
            self._bind_arrays((_ptr(x), _ptr(out)), threadpool, (), (n, c, c, c))
        else:
            self._bind_arrays((_ptr(x), _ptr(out)), threadpool, (), (n, 1, width, c, c, c), workspace=True,
                              output_dims=2)
        return out

    def _create_for_width_2024(self, width: int) -> None:
        if self._op and width == self._width:
            return
        self.close()
        if width == 1:
            self._create("xnn_create_copy_nc_x32", 0)
        else:
            self._create("xnn_create_average_pooling2d_nhwc_f32", 0, 0, 0, 0, 1, width, 1, width, -math.inf,
                         math.inf, 0)
        self._width = width


class Binary(Operator):
    """``xnn_create_<kind>_nd_f32`` (add, multiply, subtract, divide, maximum, minimum) with numpy
    broadcasting (up to 6 dims); add to divide clamp their output to [output_min, output_max]."""

    _clamp = None  # the 2024 API's clamp after a ranged operator (Clamp)

    def __init__(self, kind: str, *, output_min: float = -math.inf, output_max: float = math.inf,
                 threadpool: Threadpool | None = None):
        super().__init__(threadpool)
        if kind not in _BINARY:
            raise ValueError(f"unknown binary operator {kind!r}")
        ranged = (float(output_min), float(output_max)) if kind in _BINARY_RANGED else ()
        if not ranged and (output_min != -math.inf or output_max != math.inf):
            raise ValueError(f"{kind} takes no output range")
        self.kind = kind
        self._shape_cache: dict = {}
        self._clamp = None
        if api() == API_2022:
            self._create(f"xnn_create_{kind}_nd_f32", *ranged, 0)
            return
        # The 2024 API's binary operators do not clamp: a clamp runs after, in place on the output
        self._create("xnn_create_binary_elementwise_nd", _BINARY_2024[kind], XNN_DATATYPE_FP32, None, None, None, 0)
        if ranged and ranged != (-math.inf, math.inf):
            self._clamp = Clamp(1, *ranged, threadpool=threadpool)

    @property
    def handles(self) -> tuple[int, ...]:
        return (self.handle,) + (() if self._clamp is None else (self._clamp.handle,))

    def execute(self, threadpool: Threadpool | None = None) -> None:
        super().execute(threadpool)
        if self._clamp is not None:
            self._clamp.execute(threadpool)

    def close(self) -> None:
        super().close()
        clamp, self._clamp = getattr(self, "_clamp", None), None
        if clamp is not None:
            clamp.close()

    def _describe(self) -> str:
        return self.kind

    def _shapes(self, sa: tuple, sb: tuple):
        key = (sa, sb)
        c = self._shape_cache.get(key)
        if c is None:
            if len(sa) > XNN_MAX_TENSOR_DIMS or len(sb) > XNN_MAX_TENSOR_DIMS:
                raise ValueError(f"{self.kind}_nd supports at most {XNN_MAX_TENSOR_DIMS} dims")
            out_shape = np.broadcast_shapes(sa, sb)
            c = ((_sz * max(1, len(sa)))(*(sa or (1,))), (_sz * max(1, len(sb)))(*(sb or (1,))),
                 max(1, len(sa)), max(1, len(sb)), out_shape)
            self._shape_cache[key] = c
        return c

    def _setup(self, a, b, out=None, threadpool=None) -> np.ndarray:
        a = _as_f32(a, "a")
        b = _as_f32(b, "b")
        sa, sb, na, nb, oshape = self._shapes(a.shape, b.shape)
        out = _out(out, oshape)
        self._bind_arrays((_ptr(a), _ptr(b), _ptr(out)), threadpool, (na, sa, nb, sb))
        if self._clamp is not None:
            flat = out.reshape(-1)
            self._clamp.bind_rows(flat, flat, 1, flat.size, threadpool)
        return out

    def run(self, a, b, out=None, threadpool=None) -> np.ndarray:
        last = self._last
        if not (last is not None and out is not None and last[0] is a and last[1] is b
                and last[2] is out and last[3] == (a.shape, b.shape) and last[4] is threadpool):
            out = self._setup(a, b, out, threadpool)
            self._last = (a, b, out, (a.shape, b.shape), threadpool)
        self.execute(threadpool)
        return out


class Add(Binary):
    """``xnn_create_add_nd_f32`` with numpy broadcasting (up to 6 dims)."""

    def __init__(self, *, output_min: float = -math.inf, output_max: float = math.inf,
                 threadpool: Threadpool | None = None):
        super().__init__("add", output_min=output_min, output_max=output_max, threadpool=threadpool)


class _RowwiseNC(Operator):
    def _setup(self, x, out=None, threadpool=None) -> np.ndarray:
        x = _as_f32(x, "x")
        if x.ndim < 1 or x.shape[-1] != self.channels:
            raise ValueError(f"x: expected (..., {self.channels}), got {x.shape}")
        out = _out(out, x.shape)
        self.bind_rows(x, out, x.size // self.channels, self.channels, threadpool)
        return out

    def bind_rows(self, x: np.ndarray, out: np.ndarray, rows: int, channels: int, threadpool=None) -> None:
        """Binds to ``rows`` rows of ``channels`` values (the 2022 API took the channels at creation)."""
        self._bind_arrays((_ptr(x), _ptr(out)), threadpool, (rows,), self._rows_2024(rows, channels))

    def _rows_2024(self, rows: int, channels: int) -> tuple:
        """xnn_reshape_*'s shape arguments: (batch, channels, input stride, output stride)."""
        return rows, channels, channels, channels


class Clamp(_RowwiseNC):
    """``xnn_create_clamp_nc_f32`` over the last axis (Relu = Clamp(c, 0, inf), Relu6, ...)."""

    def __init__(self, channels: int, output_min: float = -math.inf, output_max: float = math.inf,
                 *, threadpool: Threadpool | None = None):
        super().__init__(threadpool)
        self.channels = int(channels)
        if api() == API_2022:
            self._create("xnn_create_clamp_nc_f32", self.channels, self.channels, self.channels,
                         float(output_min), float(output_max), 0)
        else:
            _create_unary_2024(self, "clamp", float(output_min), float(output_max))


class Softmax(_RowwiseNC):
    """``xnn_create_softmax_nc_f32`` over the last axis."""

    def __init__(self, channels: int, *, threadpool: Threadpool | None = None):
        super().__init__(threadpool)
        self.channels = int(channels)
        channels = (self.channels,) * 3 if api() == API_2022 else ()
        self._create("xnn_create_softmax_nc_f32", *channels, 0)

    def _rows_2024(self, rows: int, channels: int) -> tuple:
        return channels, channels, channels, rows


class Unary(_RowwiseNC):
    """``xnn_create_<kind>_nc_f32`` over the last axis: sigmoid, hardswish, leaky_relu (``param``:
    the negative slope), elu (``param``: alpha)."""

    def __init__(self, kind: str, channels: int, param: float | None = None, *,
                 threadpool: Threadpool | None = None):
        super().__init__(threadpool)
        if kind not in _UNARY:
            raise ValueError(f"unknown unary operator {kind!r}")
        self.kind = kind
        self.channels = int(channels)
        extra = (float(param),) if _UNARY[kind] else ()
        if api() == API_2022:
            self._create(f"xnn_create_{kind}_nc_f32", self.channels, self.channels, self.channels, *extra, 0)
        else:
            _create_unary_2024(self, kind, *extra)

    def _describe(self) -> str:
        return self.kind


def _create_unary_2024(op: Operator, kind: str, *params: float, datatypes=(XNN_DATATYPE_FP32, XNN_DATATYPE_FP32),
                       grids=(None, None)) -> None:
    """``xnn_create_unary_elementwise_nc`` of ``kind`` from and to ``datatypes`` (float32 by
    default), with its parameters (clamp: min, max; elu: alpha; leaky_relu: negative slope) in
    ``union xnn_unary_params`` and, for an 8-bit input or output, its grid (zero point, scale)."""
    op._params = (_f32 * 2)(*params)
    op._grids = [None if grid is None else _QuantizationParams(int(grid[0]), float(grid[1])) for grid in grids]
    op._create("xnn_create_unary_elementwise_nc", _UNARY_2024[kind], *datatypes, ctypes.addressof(op._params),
               *(None if grid is None else ctypes.addressof(grid) for grid in op._grids), 0)


class PReLU(_RowwiseNC):
    """``xnn_create_prelu_nc_f32`` (2024 API: the binary operator prelu of x and the slopes): one
    negative slope per channel (the last axis)."""

    def __init__(self, slopes: np.ndarray, *, threadpool: Threadpool | None = None):
        super().__init__(threadpool)
        self.slopes = np.ascontiguousarray(slopes, dtype=np.float32).reshape(-1)
        self.channels = self.slopes.size
        if api() == API_2022:
            self._create("xnn_create_prelu_nc_f32", self.channels, self.channels, self.channels, _ptr(self.slopes), 0)
        else:
            self._create("xnn_create_binary_elementwise_nd", _BINARY_2024["prelu"], XNN_DATATYPE_FP32,
                         None, None, None, 0)

    def bind_rows(self, x: np.ndarray, out: np.ndarray, rows: int, channels: int, threadpool=None) -> None:
        if api() == API_2022:
            return super().bind_rows(x, out, rows, channels, threadpool)
        self._shapes_2024 = (_sz * 2)(rows, channels), (_sz * 1)(channels)
        self._bind_arrays((_ptr(x), _ptr(self.slopes), _ptr(out)), threadpool, (),
                          (2, self._shapes_2024[0], 1, self._shapes_2024[1]))


class ResizeBilinear(Operator):
    """``xnn_create_resize_bilinear2d_nhwc_f32``: (N, H, W, C) -> (N, OH, OW, C); ``align_corners``
    or half-pixel centres (ONNX's half_pixel), or ``legacy`` (ONNX's asymmetric)."""

    def __init__(self, channels: int, output_hw: tuple[int, int], *, align_corners: bool = False,
                 legacy: bool = False, threadpool: Threadpool | None = None):
        super().__init__(threadpool)
        self.channels = int(channels)
        self.output_hw = tuple(int(v) for v in output_hw)
        flags = (XNN_FLAG_ALIGN_CORNERS if align_corners else 0) | (XNN_FLAG_TENSORFLOW_LEGACY_MODE if legacy else 0)
        # the 2022 API takes the channels at creation and the output size at setup, the 2024 one the reverse
        sizes = (self.channels,) * 3 if api() == API_2022 else self.output_hw
        self._create("xnn_create_resize_bilinear2d_nhwc_f32", *sizes, flags)

    def output_shape(self, input_shape) -> tuple:
        return (input_shape[0], *self.output_hw, self.channels)

    def _setup(self, x, out=None, threadpool=None) -> np.ndarray:
        x = _as_f32(x, "x")
        out = _out(out, self.output_shape(x.shape))
        self._bind_arrays((_ptr(x), _ptr(out)), threadpool, (*x.shape[:3], *self.output_hw),
                          (*x.shape[:3], self.channels, self.channels, self.channels), workspace=True)
        return out


class Concatenate:
    """Concatenation built from ``xnn_create_copy_nc_x32`` with strides.

    This snapshot has no concatenate operator (``xnn_create_concatenate*`` appeared later), so
    each input becomes a strided copy: inputs are viewed as (outer, inner_i) with
    inner_i = prod(shape[axis:]), copied into columns [off_i, off_i + inner_i) of an
    (outer, sum inner) output.  One copy operator per input, created once for the given shapes.
    """

    def __init__(self, input_shapes: Sequence[Sequence[int]], axis: int,
                 *, threadpool: Threadpool | None = None):
        self._lib = lib()
        shapes = [tuple(int(d) for d in s) for s in input_shapes]
        if not shapes:
            raise ValueError("need at least one input")
        nd = len(shapes[0])
        ax = axis + nd if axis < 0 else axis
        if not 0 <= ax < nd:
            raise ValueError(f"axis {axis} out of range for rank {nd}")
        for s in shapes:
            if len(s) != nd or s[:ax] != shapes[0][:ax] or s[ax + 1:] != shapes[0][ax + 1:]:
                raise ValueError(f"shapes {shapes} do not concatenate along axis {axis}")
        self.axis = ax
        self.input_shapes = shapes
        self.output_shape = shapes[0][:ax] + (sum(s[ax] for s in shapes),) + shapes[0][ax + 1:]
        self.outer = int(np.prod(shapes[0][:ax], dtype=np.int64))
        self.inners = [int(np.prod(s[ax:], dtype=np.int64)) for s in shapes]
        self.out_stride = sum(self.inners)
        self.offsets = [sum(self.inners[:i]) for i in range(len(self.inners))]
        self.threadpool = threadpool
        self._last = None
        self._ops: list[_CopyNC] = []
        try:
            for inner in self.inners:
                self._ops.append(_CopyNC(inner, inner, self.out_stride, threadpool))
        except Exception:
            self.close()
            raise

    def run(self, inputs: Sequence[np.ndarray], out=None, threadpool=None) -> np.ndarray:
        if len(inputs) != len(self._ops):
            raise ValueError(f"expected {len(self._ops)} inputs, got {len(inputs)}")
        last = self._last
        if (last is not None and out is not None and last[1] is out and last[3] is threadpool
                and all(a is b for a, b in zip(last[0], inputs))
                and last[2] == [x.shape for x in inputs]):
            for op in self._ops:
                op.execute(threadpool)
            return out
        self._last = None
        out = _out(out, self.output_shape)
        base = _ptr(out)
        for x, shape, op, off in zip(inputs, self.input_shapes, self._ops, self.offsets):
            x = _as_f32(x, "input")
            if tuple(x.shape) != shape:
                raise ValueError(f"input shape {x.shape}, expected {shape}")
            op.setup_raw(self.outer, _ptr(x), base + 4 * off, threadpool)
            op.execute(threadpool)
        self._last = (list(inputs), out, [x.shape for x in inputs], threadpool)
        return out

    def close(self) -> None:
        self._last = None
        for op in getattr(self, "_ops", []):
            op.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass


class _CopyNC(Operator):
    def __init__(self, channels: int, input_stride: int, output_stride: int,
                 threadpool: Threadpool | None = None):
        super().__init__(threadpool)
        self.channels = channels
        self.strides = (input_stride, output_stride)
        layout = (channels, input_stride, output_stride) if api() == API_2022 else ()
        self._create("xnn_create_copy_nc_x32", *layout, 0)

    def setup_raw(self, batch: int, x_ptr: int, out_ptr: int, threadpool=None) -> None:
        self._bind_arrays((x_ptr, out_ptr), threadpool, (batch,), (batch, self.channels, *self.strides))


# --------------------------------------------------------------------------------------------
# 8-bit operators (qc8, qs8, qu8): optional symbols, prototypes set on first use
# --------------------------------------------------------------------------------------------
# The 2022 snapshot's int8 conv / fully connected operators (xnnpack.h at ae108ef; the 2024 API
# has the same ones, qc8 named qs8_qc8w, with the same create arguments plus the caches):
#   qc8: int8 activations, int8 weights with one scale per output channel (convolution only: no
#        per-channel fully connected operator in this snapshot);
#   qs8: int8 activations, int8 weights with one scale;
#   qu8: uint8 activations, uint8 weights with one scale and a weight zero point.
# Every one takes int32 bias (scale input_scale * kernel_scale), an output zero point and scale,
# and an output clamp [output_min, output_max] in the output's integers.

INT8_VARIANTS = ("qc8", "qs8", "qu8")
_i8, _u8 = ctypes.c_int8, ctypes.c_uint8
_CONV_GEOMETRY = [_u32] * 11 + [_sz] * 4
_INT8_PROTOS = {
    "xnn_create_convolution2d_nhwc_qc8": _CONV_GEOMETRY + [_i8, _f32, _vp, _vp, _vp, _i8, _f32, _i8, _i8, _u32, _op_out],
    "xnn_create_convolution2d_nhwc_qs8": _CONV_GEOMETRY + [_i8, _f32, _f32, _vp, _vp, _i8, _f32, _i8, _i8, _u32, _op_out],
    "xnn_create_convolution2d_nhwc_qu8": _CONV_GEOMETRY + [_u8, _f32, _u8, _f32, _vp, _vp, _u8, _f32, _u8, _u8, _u32,
                                                           _op_out],
    "xnn_create_fully_connected_nc_qs8": [_sz] * 4 + [_i8, _f32, _f32, _vp, _vp, _i8, _f32, _i8, _i8, _u32, _op_out],
    "xnn_create_fully_connected_nc_qu8": [_sz] * 4 + [_u8, _f32, _u8, _f32, _vp, _vp, _u8, _f32, _u8, _u8, _u32, _op_out],
}
for _variant in INT8_VARIANTS:
    _INT8_PROTOS[f"xnn_setup_convolution2d_nhwc_{_variant}"] = [_vp, _sz, _sz, _sz, _vp, _vp, _vp]
for _variant in ("qs8", "qu8"):
    _INT8_PROTOS[f"xnn_setup_fully_connected_nc_{_variant}"] = [_vp, _sz, _vp, _vp, _vp]
# Quantize (f32 -> 8-bit) and dequantize (8-bit -> f32): the boundaries between float and 8-bit
# operators in a whole model (executor.py).
_INT8_PROTOS["xnn_create_convert_nc_f32_qs8"] = [_sz] * 3 + [_f32, _i8, _i8, _i8, _u32, _op_out]
_INT8_PROTOS["xnn_create_convert_nc_f32_qu8"] = [_sz] * 3 + [_f32, _u8, _u8, _u8, _u32, _op_out]
_INT8_PROTOS["xnn_create_convert_nc_qs8_f32"] = [_sz] * 3 + [_f32, _i8, _u32, _op_out]
_INT8_PROTOS["xnn_create_convert_nc_qu8_f32"] = [_sz] * 3 + [_f32, _u8, _u32, _op_out]
for _kind in ("f32_qs8", "f32_qu8", "qs8_f32", "qu8_f32"):
    _INT8_PROTOS[f"xnn_setup_convert_nc_{_kind}"] = [_vp, _sz, _vp, _vp, _vp]


def _int8_name(function: str, variant: str) -> str:
    """``function`` (e.g. "xnn_create_convolution2d_nhwc") of an 8-bit variant: the 2024 API names
    qc8 (int8 activations, per-channel int8 weights) qs8_qc8w."""
    return f"{function}_{'qs8_qc8w' if variant == 'qc8' and api() == API_2024 else variant}"


def _with_caches(create: list) -> list:
    """A 2022 create function's arguments as the 2024 API has them: a code and a weights cache
    before the operator out-pointer."""
    return create[:-1] + _CACHES + create[-1:]


# The 2024 API: the same create arguments plus the caches; reshape and setup as the f32
# operators'; quantize and dequantize are xnn_create_unary_elementwise_nc's convert between
# float32 and an 8-bit type with its quantization (bound with the f32 operators).
_INT8_PROTOS_2024 = {}
for _variant, _name in (("qc8", "qs8_qc8w"), ("qs8", "qs8"), ("qu8", "qu8")):
    _INT8_PROTOS_2024[f"xnn_create_convolution2d_nhwc_{_name}"] = \
        _with_caches(_INT8_PROTOS[f"xnn_create_convolution2d_nhwc_{_variant}"])
    _INT8_PROTOS_2024[f"xnn_reshape_convolution2d_nhwc_{_name}"] = _PROTOS_2024["xnn_reshape_convolution2d_nhwc_f32"]
    _INT8_PROTOS_2024[f"xnn_setup_convolution2d_nhwc_{_name}"] = _PROTOS_2024["xnn_setup_convolution2d_nhwc_f32"]
for _variant in ("qs8", "qu8"):
    _INT8_PROTOS_2024[f"xnn_create_fully_connected_nc_{_variant}"] = \
        _with_caches(_INT8_PROTOS[f"xnn_create_fully_connected_nc_{_variant}"])
    _INT8_PROTOS_2024[f"xnn_reshape_fully_connected_nc_{_variant}"] = _PROTOS_2024["xnn_reshape_fully_connected_nc_f32"]
    _INT8_PROTOS_2024[f"xnn_setup_fully_connected_nc_{_variant}"] = _PROTOS_2024["xnn_setup_fully_connected_nc_f32"]


@functools.lru_cache(maxsize=None)
def int8_availability() -> tuple[bool, str]:
    """Whether the loaded build has the 8-bit conv / fully connected operators (prototypes set)."""
    ok, why = availability()
    if not ok:
        return False, why
    return _bind(_INT8_PROTOS, "qc8 / qs8 / qu8 convolution, qs8 / qu8 fully connected", _INT8_PROTOS_2024)


def _bind(prototypes: dict, what: str, prototypes_2024: dict | None = None) -> tuple[bool, str]:
    """Sets the prototypes of optional functions of the loaded build (``prototypes_2024`` on the
    2024 API); (False, why) when one lacks."""
    if api() == API_2024:
        if prototypes_2024 is None:
            return False, f"{what}: bound for the 2022 API only, not for {LIBXNNPACK_2024}'s"
        prototypes = prototypes_2024
    xnn = lib().xnn
    missing = [name for name in prototypes if not hasattr(xnn, name)]
    if missing:
        return False, f"{lib().soname} lacks {', '.join(missing)}"
    for name, argtypes in prototypes.items():
        fn = getattr(xnn, name)
        fn.argtypes = argtypes
        fn.restype = ctypes.c_int
    return True, what


def _optional_int8(prototypes: dict, what: str, prototypes_2024: dict | None = None) -> tuple[bool, str]:
    """Optional 8-bit operators on top of the conv / fc ones: (False, why) when those or these lack."""
    ok, why = int8_availability()
    if not ok:
        return False, why
    return _bind(prototypes, what, prototypes_2024)


# The 8-bit operators an activation after an int8 conv / fc runs on (int8.py, the executor):
# sigmoid (a 256-entry lookup table) and multiply, both in lut-elementwise-nc.c /
# binary-elementwise-nd.c at ae108ef. Optional: without them only folding activations run in int8.
_INT8_ACTIVATION_PROTOS = {}
for _kind, _q in (("qs8", _i8), ("qu8", _u8)):
    _INT8_ACTIVATION_PROTOS[f"xnn_create_sigmoid_nc_{_kind}"] = [_sz] * 3 + [_q, _f32, _q, _f32, _q, _q, _u32, _op_out]
    _INT8_ACTIVATION_PROTOS[f"xnn_setup_sigmoid_nc_{_kind}"] = [_vp, _sz, _vp, _vp, _vp]
    _INT8_ACTIVATION_PROTOS[f"xnn_create_multiply_nd_{_kind}"] = [_q, _f32, _q, _f32, _q, _f32, _q, _q, _u32, _op_out]
    _INT8_ACTIVATION_PROTOS[f"xnn_setup_multiply_nd_{_kind}"] = [_vp, _sz, _szp, _sz, _szp, _vp, _vp, _vp, _vp]
# XNNPack's 8-bit sigmoid writes only this grid: [0, 1) in 256 steps, zero point -128 (qs8) / 0 (qu8)
SIGMOID_OUTPUT_SCALE = 1.0 / 256.0


@functools.lru_cache(maxsize=None)
def int8_activation_availability() -> tuple[bool, str]:
    """Whether the loaded build has the 8-bit sigmoid and multiply operators (prototypes set)."""
    # the 2024 API's unary sigmoid and binary multiply (xnn_create_unary_elementwise_nc,
    # xnn_create_binary_elementwise_nd on qint8 / quint8) are bound with the f32 operators
    return _optional_int8(_INT8_ACTIVATION_PROTOS, "qs8 / qu8 sigmoid and multiply", {})


# The 8-bit leaky relu after an int8 conv / fc (lut-elementwise-nc.c at ae108ef: a 256-entry table
# built at creation): qu8 only in this snapshot, slope in (0, 1], input / output scale ratio in
# [2^-8, 2^8).
_INT8_LEAKY_RELU_PROTOS = {
    "xnn_create_leaky_relu_nc_qu8": [_sz] * 3 + [_f32, _u8, _f32, _u8, _f32, _u8, _u8, _u32, _op_out],
    "xnn_setup_leaky_relu_nc_qu8": [_vp, _sz, _vp, _vp, _vp],
}


@functools.lru_cache(maxsize=None)
def int8_leaky_relu_availability() -> tuple[bool, str]:
    """Whether the loaded build has the 8-bit (qu8) leaky relu operator (prototypes set)."""
    # the 2024 API's: xnn_create_unary_elementwise_nc's leaky_relu on quint8 (bound with the f32 operators)
    return _optional_int8(_INT8_LEAKY_RELU_PROTOS, "qu8 leaky relu", {})


# The 8-bit transposed convolution (deconvolution-nhwc.c): qs8 and qu8 only, one weight scale (no
# per-channel form in this snapshot); the same quantization arguments as the convolution's.
_INT8_DECONV_PROTOS = {
    "xnn_create_deconvolution2d_nhwc_qs8": _INT8_PROTOS["xnn_create_convolution2d_nhwc_qs8"],
    "xnn_create_deconvolution2d_nhwc_qu8": _INT8_PROTOS["xnn_create_convolution2d_nhwc_qu8"],
}
for _variant in ("qs8", "qu8"):
    _INT8_DECONV_PROTOS[f"xnn_setup_deconvolution2d_nhwc_{_variant}"] = [_vp, _sz, _sz, _sz, _u32, _u32, _vp, _vp, _vp]
INT8_DECONV_VARIANTS = ("qs8", "qu8")
_INT8_DECONV_PROTOS_2024 = {}
for _variant in INT8_DECONV_VARIANTS:
    _INT8_DECONV_PROTOS_2024[f"xnn_create_deconvolution2d_nhwc_{_variant}"] = \
        _with_caches(_INT8_DECONV_PROTOS[f"xnn_create_deconvolution2d_nhwc_{_variant}"])
    for _kind in ("reshape", "setup"):
        _INT8_DECONV_PROTOS_2024[f"xnn_{_kind}_deconvolution2d_nhwc_{_variant}"] = \
            _PROTOS_2024[f"xnn_{_kind}_deconvolution2d_nhwc_f32"]


@functools.lru_cache(maxsize=None)
def int8_deconvolution_availability() -> tuple[bool, str]:
    """Whether the loaded build has the 8-bit deconvolution operators (prototypes set)."""
    return _optional_int8(_INT8_DECONV_PROTOS, "qs8 / qu8 deconvolution", _INT8_DECONV_PROTOS_2024)


# The 8-bit operators the executor runs between int8 conv / fc ops of a whole model: a residual
# add, max pooling and global average pooling (binary-elementwise-nd.c, max-pooling-nhwc.c,
# global-average-pooling-nwc.c at ae108ef). Max pooling takes no quantization: its output is on
# its input's grid. Optional: without them those ops run in float.
_INT8_GRAPH_PROTOS = {}
for _kind, _q, _x in (("qs8", _i8, "s8"), ("qu8", _u8, "u8")):
    _INT8_GRAPH_PROTOS[f"xnn_create_add_nd_{_kind}"] = [_q, _f32, _q, _f32, _q, _f32, _q, _q, _u32, _op_out]
    _INT8_GRAPH_PROTOS[f"xnn_setup_add_nd_{_kind}"] = [_vp, _sz, _szp, _sz, _szp, _vp, _vp, _vp, _vp]
    _INT8_GRAPH_PROTOS[f"xnn_create_max_pooling2d_nhwc_{_x}"] = [_u32] * 10 + [_sz] * 3 + [_q, _q, _u32, _op_out]
    _INT8_GRAPH_PROTOS[f"xnn_setup_max_pooling2d_nhwc_{_x}"] = [_vp, _sz, _sz, _sz, _vp, _vp, _vp]
    _INT8_GRAPH_PROTOS[f"xnn_create_global_average_pooling_nwc_{_kind}"] = \
        [_sz] * 3 + [_q, _f32, _q, _f32, _q, _q, _u32, _op_out]
    _INT8_GRAPH_PROTOS[f"xnn_setup_global_average_pooling_nwc_{_kind}"] = [_vp, _sz, _sz, _vp, _vp, _vp]
# Scale ratios the operators accept (they refuse others at creation): each input scale / output
# scale of an add in [2**-10, 2**8), input scale / output scale of a global average pooling in
# [2**-8, 2**8), both computed in float32.
ADD_SCALE_RATIO = (2.0 ** -10, 2.0 ** 8)
GLOBAL_AVERAGE_SCALE_RATIO = (2.0 ** -8, 2.0 ** 8)


@functools.lru_cache(maxsize=None)
def int8_graph_availability() -> tuple[bool, str]:
    """Whether the loaded build has the 8-bit add, max pooling and global average pooling
    operators (prototypes set). Not on the 2024 API: it has no 8-bit global average pooling
    operator (only a qu8 average pooling and the reduce operator), and its binary add takes no
    output clamp (a folded Relu)."""
    if availability()[0] and api() == API_2024:
        return False, ("qs8 / qu8 add, max pooling and global average pooling: not on the 2024 API (no 8-bit global "
                       "average pooling operator; its add takes no output clamp): those ops run in float")
    return _optional_int8(_INT8_GRAPH_PROTOS, "qs8 / qu8 add, s8 / u8 max pooling, qs8 / qu8 global average pooling")


def _require_int8_graph() -> None:
    ok, why = int8_graph_availability()
    if not ok:
        raise XNNPackUnavailable(why)


def _type_range(datatype: str) -> tuple[int, int]:
    return (-128, 127) if datatype == "qs8" else (0, 255)


def _require_int8() -> None:
    ok, why = int8_availability()
    if not ok:
        raise XNNPackUnavailable(why)


def _require_int8_activations() -> None:
    ok, why = int8_activation_availability()
    if not ok:
        raise XNNPackUnavailable(why)


def int8_dtype(variant: str):
    """numpy type of the activations (and weights) of a variant."""
    if variant not in INT8_VARIANTS:
        raise ValueError(f"unknown 8-bit variant {variant!r} (one of {INT8_VARIANTS})")
    return np.uint8 if variant == "qu8" else np.int8


def _as_q(a, variant: str, name: str) -> np.ndarray:
    a = np.asarray(a)
    if a.dtype != int8_dtype(variant):
        raise TypeError(f"{name}: expected {np.dtype(int8_dtype(variant)).name} for {variant}, got {a.dtype}")
    if not a.flags.c_contiguous:
        raise ValueError(f"{name}: expected a C-contiguous array")
    return a


class _QuantizedOperator(Operator):
    """Shared by the 8-bit operators: the variant, the quantization of input and output."""

    def _quant_args(self, variant, weights, bias, input_zero_point, input_scale, kernel_scale, output_zero_point,
                    output_scale, output_min, output_max, kernel_zero_point, channels):
        self.variant = variant
        w = _as_q(weights, variant, "weights")
        b = None
        if bias is not None:
            b = np.ascontiguousarray(bias, dtype=np.int32).reshape(-1)
            if b.size != channels:
                raise ValueError(f"bias has {b.size} elements, expected {channels}")
        if variant == "qc8":
            scales = np.ascontiguousarray(kernel_scale, dtype=np.float32).reshape(-1)
            if scales.size != channels:
                raise ValueError(f"qc8 needs one kernel scale per output channel ({channels}), got {scales.size}")
            kernel = [float(input_scale), _ptr(scales)]
            self._keep = (w, b, scales)
        elif variant == "qs8":
            kernel = [float(input_scale), float(kernel_scale)]
            self._keep = (w, b)
        else:
            kernel = [float(input_scale), int(kernel_zero_point), float(kernel_scale)]
            self._keep = (w, b)
        return ([int(input_zero_point)] + kernel + [_ptr(w), None if b is None else _ptr(b), int(output_zero_point),
                                                    float(output_scale), int(output_min), int(output_max), 0])

    def _release(self) -> None:
        self._keep = None  # XNNPack packed weights, bias and scales at creation


class QConvolution2DNHWC(_QuantizedOperator):
    """``xnn_create_convolution2d_nhwc_{qc8,qs8,qu8}`` (2024 API: ``_{qs8_qc8w,qs8,qu8}``): dense,
    grouped and depthwise (groups == C_in).

    ``weights``: OIHW int8 (qc8, qs8) or uint8 (qu8, with ``kernel_zero_point``); ``kernel_scale``:
    one per output channel (qc8) or one (qs8, qu8); ``bias``: int32 at input_scale * kernel_scale.
    Input (N, H, W, C_in) -> output (N, OH, OW, C_out), both int8 (qc8, qs8) or uint8 (qu8).
    """

    def __init__(self, variant: str, weights, bias=None, *, input_zero_point: int, input_scale: float, kernel_scale,
                 output_zero_point: int, output_scale: float, output_min: int, output_max: int,
                 kernel_zero_point: int = 0, stride=1, dilation=1, padding=0, groups=1,
                 threadpool: Threadpool | None = None):
        super().__init__(threadpool)
        _require_int8()
        w = _as_q(weights, variant, "weights")
        if w.ndim != 4:
            raise ValueError("weights must be 4-D (OIHW)")
        O, Ig, kh, kw = w.shape
        groups = int(groups)
        if groups < 1 or O % groups:
            raise ValueError(f"output channels {O} not divisible by groups {groups}")
        self.groups, self.group_input_channels, self.group_output_channels = groups, Ig, O // groups
        self.input_channels, self.output_channels = Ig * groups, O
        self.kernel = (kh, kw)
        self.stride, self.dilation = _pair(stride, "stride"), _pair(dilation, "dilation")
        self.padding = _pads(padding)
        # XNNPack's NHWC kernel layout: [groups][group_output_channels][kh][kw][group_input_channels]
        ohwi = np.ascontiguousarray(w.transpose(0, 2, 3, 1))
        quant = self._quant_args(variant, ohwi, bias, input_zero_point, input_scale, kernel_scale, output_zero_point,
                                 output_scale, output_min, output_max, kernel_zero_point, O)
        t, l, b, r = self.padding
        self._create(_int8_name("xnn_create_convolution2d_nhwc", variant), t, r, b, l, kh, kw, *self.stride,
                     *self.dilation, groups, Ig, O // groups, self.input_channels, O, *quant)
        self._release()

    def _describe(self) -> str:
        return (f"{type(self).__name__} {getattr(self, 'variant', '')} k={self.kernel} s={self.stride} "
                f"d={self.dilation} pad(t,l,b,r)={self.padding} groups={self.groups}")

    def output_shape(self, input_shape) -> tuple:
        n, h, w, _ = input_shape
        t, l, b, r = self.padding
        return (n, conv_output_size(h, self.kernel[0], self.stride[0], self.dilation[0], t, b),
                conv_output_size(w, self.kernel[1], self.stride[1], self.dilation[1], l, r), self.output_channels)

    def _setup(self, x, out=None, threadpool=None) -> np.ndarray:
        x = _as_q(x, self.variant, "x")
        if x.ndim != 4 or x.shape[3] != self.input_channels:
            raise ValueError(f"x: expected (N, H, W, {self.input_channels}), got {x.shape}")
        shape = self.output_shape(x.shape)
        out = np.empty(shape, int8_dtype(self.variant)) if out is None else _as_q(out, self.variant, "out")
        if tuple(out.shape) != shape:
            raise ValueError(f"out: expected shape {shape}, got {tuple(out.shape)}")
        self._bind_arrays((_ptr(x), _ptr(out)), threadpool, x.shape[:3], workspace=True, output_dims=2)
        return out


class QDeconvolution2DNHWC(_DeconvGeometry, _QuantizedOperator):
    """``xnn_create_deconvolution2d_nhwc_{qs8,qu8}``: ONNX's ConvTranspose on 8-bit NHWC data.

    ``weights``: ONNX's (C_in, C_out / groups, kh, kw), int8 (qs8) or uint8 (qu8, with
    ``kernel_zero_point``); ``kernel_scale``: one; ``bias``: int32 at input_scale * kernel_scale;
    ``padding``: ONNX's pads (top, left, bottom, right), cropped from the output; ``adjustment``:
    ONNX's output_padding (h, w). Input (N, H, W, C_in) -> output (N, OH, OW, C_out).
    """

    def __init__(self, variant: str, weights, bias=None, *, input_zero_point: int, input_scale: float,
                 kernel_scale: float, output_zero_point: int, output_scale: float, output_min: int, output_max: int,
                 kernel_zero_point: int = 0, stride=1, dilation=1, padding=0, groups=1, adjustment=(0, 0),
                 threadpool: Threadpool | None = None):
        super().__init__(threadpool)
        ok, why = int8_deconvolution_availability()
        if not ok:
            raise XNNPackUnavailable(why)
        if variant not in INT8_DECONV_VARIANTS:
            raise ValueError(f"no {variant} deconvolution operator in this build {INT8_DECONV_VARIANTS}")
        kernel = self._set_geometry(_as_q(weights, variant, "weights"), stride, dilation, padding, groups, adjustment)
        quant = self._quant_args(variant, kernel, bias, input_zero_point, input_scale, kernel_scale, output_zero_point,
                                 output_scale, output_min, output_max, kernel_zero_point, self.output_channels)
        self._create(f"xnn_create_deconvolution2d_nhwc_{variant}", *self._geometry_args(), *quant)
        self._release()

    def _describe(self) -> str:
        return f"{type(self).__name__} {getattr(self, 'variant', '')} {self._describe_geometry()}"

    def _setup(self, x, out=None, threadpool=None) -> np.ndarray:
        x = self._check_input(_as_q(x, self.variant, "x"))
        shape = self.output_shape(x.shape)
        out = np.empty(shape, int8_dtype(self.variant)) if out is None else _as_q(out, self.variant, "out")
        if tuple(out.shape) != shape:
            raise ValueError(f"out: expected shape {shape}, got {tuple(out.shape)}")
        return self._setup_deconv(x, out, threadpool)


class QFullyConnected(_QuantizedOperator):
    """``xnn_create_fully_connected_nc_{qs8,qu8}``: y = x @ W.T + b on 8-bit data (one weight scale;
    the 2022 snapshot has no per-channel fully connected operator, the 2024 one's is not bound).
    ``weights``: (C_out, C_in)."""

    def __init__(self, variant: str, weights, bias=None, *, input_zero_point: int, input_scale: float,
                 kernel_scale: float, output_zero_point: int, output_scale: float, output_min: int, output_max: int,
                 kernel_zero_point: int = 0, threadpool: Threadpool | None = None):
        super().__init__(threadpool)
        _require_int8()
        if variant not in ("qs8", "qu8"):
            raise ValueError(f"no {variant} fully connected operator in this build (qs8, qu8)")
        w = _as_q(weights, variant, "weights")
        if w.ndim != 2:
            raise ValueError("weights must be 2-D")
        self.output_channels, self.input_channels = w.shape
        quant = self._quant_args(variant, w, bias, input_zero_point, input_scale, kernel_scale, output_zero_point,
                                 output_scale, output_min, output_max, kernel_zero_point, self.output_channels)
        self._create(f"xnn_create_fully_connected_nc_{variant}", self.input_channels, self.output_channels,
                     self.input_channels, self.output_channels, *quant)
        self._release()

    def _setup(self, x, out=None, threadpool=None) -> np.ndarray:
        x = _as_q(x, self.variant, "x")
        if x.ndim < 1 or x.shape[-1] != self.input_channels:
            raise ValueError(f"x: expected (..., {self.input_channels}), got {x.shape}")
        shape = x.shape[:-1] + (self.output_channels,)
        out = np.empty(shape, int8_dtype(self.variant)) if out is None else _as_q(out, self.variant, "out")
        if tuple(out.shape) != shape:
            raise ValueError(f"out: expected shape {shape}, got {tuple(out.shape)}")
        self._bind_arrays((_ptr(x), _ptr(out)), threadpool, (x.size // self.input_channels,))
        return out


class _QRowwiseNC(_RowwiseNC):
    """An 8-bit operator over the last axis: x and out of its variant's type, of the same shape."""

    def _setup(self, x, out, threadpool=None) -> np.ndarray:
        x, out = _as_q(x, self.variant, "x"), _as_q(out, self.variant, "out")
        if x.shape != out.shape or x.shape[-1] != self.channels:
            raise ValueError(f"expected x and out of the same shape (..., {self.channels}): {x.shape}, {out.shape}")
        self.bind_rows(x, out, x.size // self.channels, self.channels, threadpool)
        return out


class QSigmoid(_QRowwiseNC):
    """``xnn_create_sigmoid_nc_{qs8,qu8}`` over the last axis (``datatype`` "qs8" or "qu8"): from the
    input's grid onto the only output grid XNNPack accepts, scale ``SIGMOID_OUTPUT_SCALE`` with zero
    point -128 (qs8) or 0 (qu8)."""

    def __init__(self, datatype: str, channels: int, input_zero_point: int, input_scale: float, *,
                 threadpool: Threadpool | None = None):
        super().__init__(threadpool)
        _require_int8_activations()
        if datatype not in ("qs8", "qu8"):
            raise ValueError(f"no {datatype} sigmoid operator (qs8, qu8)")
        self.variant = datatype
        self.channels = int(channels)
        low, high = (-128, 127) if datatype == "qs8" else (0, 255)
        self.output_zero_point = low
        if api() == API_2022:
            self._create(f"xnn_create_sigmoid_nc_{datatype}", self.channels, self.channels, self.channels,
                         int(input_zero_point), float(input_scale), low, SIGMOID_OUTPUT_SCALE, low, high, 0)
        else:
            _create_unary_2024(self, "sigmoid", datatypes=(_DATATYPES_2024[datatype],) * 2,
                               grids=((input_zero_point, input_scale), (low, SIGMOID_OUTPUT_SCALE)))


class QLeakyRelu(_QRowwiseNC):
    """``xnn_create_leaky_relu_nc_qu8`` over the last axis: x < 0 ? slope * x : x from the input's
    grid onto the output's (each a scale and a uint8 zero point), unclamped; qu8 only here."""

    def __init__(self, channels: int, negative_slope: float, input_zero_point: int, input_scale: float,
                 output_zero_point: int, output_scale: float, *, threadpool: Threadpool | None = None):
        super().__init__(threadpool)
        ok, why = int8_leaky_relu_availability()
        if not ok:
            raise XNNPackUnavailable(why)
        self.variant = "qu8"
        self.channels = int(channels)
        if api() == API_2022:
            self._create("xnn_create_leaky_relu_nc_qu8", self.channels, self.channels, self.channels,
                         float(negative_slope), int(input_zero_point), float(input_scale), int(output_zero_point),
                         float(output_scale), 0, 255, 0)
        else:
            _create_unary_2024(self, "leaky_relu", float(negative_slope), datatypes=(XNN_DATATYPE_QUINT8,) * 2,
                               grids=((input_zero_point, input_scale), (output_zero_point, output_scale)))

    def _describe(self) -> str:
        return f"{type(self).__name__} channels={self.channels}"


class _QBinary(Binary):
    """``xnn_create_<kind>_nd_{qs8,qu8}`` (``datatype`` "qs8" or "qu8") with numpy broadcasting:
    a op b from two grids onto the output's, clamped to [output_min, output_max] in its integers."""

    _kind = ""
    _require = staticmethod(_require_int8_activations)

    def __init__(self, datatype: str, a_zero_point: int, a_scale: float, b_zero_point: int, b_scale: float,
                 output_zero_point: int, output_scale: float, output_min: int, output_max: int, *,
                 threadpool: Threadpool | None = None):
        Operator.__init__(self, threadpool)
        self._require()
        if datatype not in ("qs8", "qu8"):
            raise ValueError(f"no {datatype} {self._kind} operator (qs8, qu8)")
        self.kind = f"{self._kind} {datatype}"
        self.variant = datatype
        self._shape_cache = {}
        self._clamp = None
        if api() == API_2022:
            self._create(f"xnn_create_{self._kind}_nd_{datatype}", int(a_zero_point), float(a_scale),
                         int(b_zero_point), float(b_scale), int(output_zero_point), float(output_scale),
                         int(output_min), int(output_max), 0)
            return
        # the 2024 API's binary operators take no output clamp
        if (int(output_min), int(output_max)) != _type_range(datatype):
            raise ValueError(f"the 2024 API's {self._kind} takes no output clamp: [{output_min}, {output_max}]")
        self._grids = [_QuantizationParams(int(zero_point), float(scale)) for zero_point, scale in
                       ((a_zero_point, a_scale), (b_zero_point, b_scale), (output_zero_point, output_scale))]
        self._create("xnn_create_binary_elementwise_nd", _BINARY_2024[self._kind], _DATATYPES_2024[datatype],
                     *(ctypes.addressof(grid) for grid in self._grids), 0)

    def _setup(self, a, b, out, threadpool=None) -> np.ndarray:
        a, b, out = _as_q(a, self.variant, "a"), _as_q(b, self.variant, "b"), _as_q(out, self.variant, "out")
        sa, sb, na, nb, oshape = self._shapes(a.shape, b.shape)
        if tuple(out.shape) != tuple(oshape):
            raise ValueError(f"out: expected shape {tuple(oshape)}, got {tuple(out.shape)}")
        self._bind_arrays((_ptr(a), _ptr(b), _ptr(out)), threadpool, (na, sa, nb, sb))
        return out


class QMultiply(_QBinary):
    """``xnn_create_multiply_nd_{qs8,qu8}``: a * b. XNNPack refuses a ratio (a scale x b scale /
    output scale) outside [2**-16, 2**8)."""

    _kind = "multiply"


class QAdd(_QBinary):
    """``xnn_create_add_nd_{qs8,qu8}``: a + b. XNNPack refuses a ratio (either input's scale /
    output scale) outside ``ADD_SCALE_RATIO``."""

    _kind = "add"
    _require = staticmethod(_require_int8_graph)


class QMaxPooling2D(_Pool2DBase):
    """``xnn_create_max_pooling2d_nhwc_{s8,u8}`` (``datatype`` "qs8" or "qu8": int8 or uint8, NHWC).
    It takes no quantization: the output is on the input's grid, clamped to [output_min,
    output_max] (default: the whole type)."""

    def __init__(self, datatype: str, channels: int, pool, *, stride=None, dilation=1, padding=0,
                 output_min: int | None = None, output_max: int | None = None,
                 threadpool: Threadpool | None = None):
        super().__init__(threadpool)
        _require_int8_graph()
        if datatype not in ("qs8", "qu8"):
            raise ValueError(f"no {datatype} max pooling operator (qs8, qu8)")
        self.variant = datatype
        self.channels = int(channels)
        self.pool = _pair(pool, "pool")
        self.stride = self.pool if stride is None else _pair(stride, "stride")
        self.dilation = _pair(dilation, "dilation")
        self.padding = _pads(padding)
        low, high = _type_range(datatype)
        t, l, b, r = self.padding
        self._create(f"xnn_create_max_pooling2d_nhwc_{datatype[1:]}", t, r, b, l, self.pool[0], self.pool[1],
                     self.stride[0], self.stride[1], self.dilation[0], self.dilation[1],
                     self.channels, self.channels, self.channels, low if output_min is None else int(output_min),
                     high if output_max is None else int(output_max), 0)

    def _setup(self, x, out, threadpool=None) -> np.ndarray:
        x, out = _as_q(x, self.variant, "x"), _as_q(out, self.variant, "out")
        if x.ndim != 4 or x.shape[3] != self.channels:
            raise ValueError(f"x: expected (N, H, W, {self.channels}), got {x.shape}")
        if tuple(out.shape) != self.output_shape(x.shape):
            raise ValueError(f"out: expected shape {self.output_shape(x.shape)}, got {tuple(out.shape)}")
        _check(self._setup_fn(self.handle, x.shape[0], x.shape[1], x.shape[2], _ptr(x), _ptr(out),
                              self._pool(threadpool)), self._setup_name)
        return out


class QGlobalAveragePooling(Operator):
    """``xnn_create_global_average_pooling_nwc_{qs8,qu8}``: (N, W, C) or (N, H, W, C) -> (N, C), from
    the input's grid onto the output's, clamped to [output_min, output_max] (default: the whole
    type). XNNPack refuses a ratio input scale / output scale outside ``GLOBAL_AVERAGE_SCALE_RATIO``."""

    def __init__(self, datatype: str, channels: int, input_zero_point: int, input_scale: float,
                 output_zero_point: int, output_scale: float, *, output_min: int | None = None,
                 output_max: int | None = None, threadpool: Threadpool | None = None):
        super().__init__(threadpool)
        _require_int8_graph()
        if datatype not in ("qs8", "qu8"):
            raise ValueError(f"no {datatype} global average pooling operator (qs8, qu8)")
        self.variant = datatype
        self.channels = int(channels)
        low, high = _type_range(datatype)
        self._create(f"xnn_create_global_average_pooling_nwc_{datatype}", self.channels, self.channels,
                     self.channels, int(input_zero_point), float(input_scale), int(output_zero_point),
                     float(output_scale), low if output_min is None else int(output_min),
                     high if output_max is None else int(output_max), 0)

    def _setup(self, x, out, threadpool=None) -> np.ndarray:
        x, out = _as_q(x, self.variant, "x"), _as_q(out, self.variant, "out")
        if x.ndim not in (3, 4) or x.shape[-1] != self.channels:
            raise ValueError(f"x: expected (N, W, {self.channels}) or (N, H, W, {self.channels}), got {x.shape}")
        n = x.shape[0]
        if tuple(out.shape) != (n, self.channels):
            raise ValueError(f"out: expected shape {(n, self.channels)}, got {tuple(out.shape)}")
        width = x.size // (n * self.channels) if n else 0
        _check(self._setup_fn(self.handle, n, width, _ptr(x), _ptr(out), self._pool(threadpool)), self._setup_name)
        return out


class QuantizeConvert(_RowwiseNC):
    """``xnn_create_convert_nc_f32_{qs8,qu8}`` (quantize, ``to`` = "qs8" / "qu8") or
    ``xnn_create_convert_nc_{qs8,qu8}_f32`` (dequantize, ``to`` = "f32", ``variant`` the 8-bit
    type) over the last axis: q = clamp(round(x / scale) + zero_point), x = (q - zero_point) * scale.
    ``zero_point`` is in the 8-bit type's own integers (int8: the uint8 one minus 128). On the
    2024 API: ``xnn_create_unary_elementwise_nc``'s convert between float32 and the 8-bit type
    with its grid."""

    def __init__(self, to: str, channels: int, scale: float, zero_point: int, *, variant: str | None = None,
                 threadpool: Threadpool | None = None):
        super().__init__(threadpool)
        _require_int8()
        self.channels = int(channels)
        grid = (int(zero_point), float(scale))
        if to in ("qs8", "qu8"):
            self.source, self.target = np.float32, (np.int8 if to == "qs8" else np.uint8)
            low, high = (-128, 127) if to == "qs8" else (0, 255)
            if api() == API_2022:
                self._create(f"xnn_create_convert_nc_f32_{to}", self.channels, self.channels, self.channels,
                             float(scale), int(zero_point), low, high, 0)
            else:
                _create_unary_2024(self, "convert", datatypes=(XNN_DATATYPE_FP32, _DATATYPES_2024[to]),
                                   grids=(None, grid))
        elif to == "f32" and variant in ("qs8", "qu8"):
            self.source, self.target = (np.int8 if variant == "qs8" else np.uint8), np.float32
            if api() == API_2022:
                self._create(f"xnn_create_convert_nc_{variant}_f32", self.channels, self.channels, self.channels,
                             float(scale), int(zero_point), 0)
            else:
                _create_unary_2024(self, "convert", datatypes=(_DATATYPES_2024[variant], XNN_DATATYPE_FP32),
                                   grids=(grid, None))
        else:
            raise ValueError(f"no conversion to {to!r} from {variant!r}")

    def _setup(self, x, out, threadpool=None) -> np.ndarray:
        for a, dtype, name in ((x, self.source, "x"), (out, self.target, "out")):
            if a.dtype != dtype or not a.flags.c_contiguous:
                raise TypeError(f"{name}: expected a C-contiguous {np.dtype(dtype).name} array, got {a.dtype}")
        if x.shape != out.shape or x.shape[-1] != self.channels:
            raise ValueError(f"expected x and out of the same shape (..., {self.channels}): {x.shape}, {out.shape}")
        self.bind_rows(x, out, x.size // self.channels, self.channels, threadpool)
        return out


# --------------------------------------------------------------------------------------------
# Half-precision (f16) operators: optional symbols, prototypes set on first use
# --------------------------------------------------------------------------------------------
# The 2022 snapshot's f16 convolution, deconvolution and fully connected operators read and write
# IEEE half tensors (numpy float16) and compute in half: their GEMM and depthwise kernels round
# the running sum to half after every multiply-add (the x86 ones emulate Arm's FP16 arithmetic
# that way). Created with XNN_FLAG_FP32_STATIC_WEIGHTS they take their weights and bias in float32
# and round them to half when they pack them. Their creation returns
# xnn_status_unsupported_hardware where xnn_initialize found no f16 kernels for the CPU. The 2024
# API has the same three (reshaped, then set up, as its f32 ones) with the same flag.

XNN_FLAG_FP32_STATIC_WEIGHTS = 0x00000008
# What XNNPack's f16 kernels need, per architecture: without it xnn_initialize leaves the f16 table empty
F16_KERNELS_NEED = {
    "x86_64": "XNNPack's x86 f16 kernels need AVX2 and F16C",
    "aarch64": "XNNPack's Arm f16 kernels need the FP16 arithmetic extension (ARMv8.2-A FP16)",
}
_F16_PROTOS = {
    "xnn_create_convolution2d_nhwc_f16": _PROTOS["xnn_create_convolution2d_nhwc_f32"],
    "xnn_setup_convolution2d_nhwc_f16": _PROTOS["xnn_setup_convolution2d_nhwc_f32"],
    "xnn_create_deconvolution2d_nhwc_f16": _PROTOS["xnn_create_deconvolution2d_nhwc_f32"],
    "xnn_setup_deconvolution2d_nhwc_f16": _PROTOS["xnn_setup_deconvolution2d_nhwc_f32"],
    "xnn_create_fully_connected_nc_f16": _PROTOS["xnn_create_fully_connected_nc_f32"],
    "xnn_setup_fully_connected_nc_f16": _PROTOS["xnn_setup_fully_connected_nc_f32"],
}
for _kind in ("f32_f16", "f16_f32"):
    _F16_PROTOS[f"xnn_create_convert_nc_{_kind}"] = [_sz] * 3 + [_u32, _op_out]
    _F16_PROTOS[f"xnn_setup_convert_nc_{_kind}"] = [_vp, _sz, _vp, _vp, _vp]
# The 2024 API: the f32 operators' arguments (the kernel and bias as void pointers); the
# conversions are xnn_create_unary_elementwise_nc's convert (bound with the f32 operators).
_F16_PROTOS_2024 = {}
for _operator in ("convolution2d_nhwc", "deconvolution2d_nhwc", "fully_connected_nc"):
    for _kind in ("create", "reshape", "setup"):
        _F16_PROTOS_2024[f"xnn_{_kind}_{_operator}_f16"] = _PROTOS_2024[f"xnn_{_kind}_{_operator}_f32"]


@functools.lru_cache(maxsize=None)
def f16_symbols() -> tuple[bool, str]:
    """Whether the loaded build exports the f16 operators and conversions (prototypes set)."""
    ok, why = availability()
    if not ok:
        return False, why
    return _bind(_F16_PROTOS, "f16 convolution, deconvolution and fully connected", _F16_PROTOS_2024)


@functools.lru_cache(maxsize=None)
def f16_availability() -> tuple[bool, str]:
    """Whether f16 operators run here: the build exports them and a tiny f16 convolution and fully
    connected operator can be created (not where the CPU lacks what the f16 kernels need)."""
    ok, why = f16_symbols()
    if not ok:
        return False, why
    try:
        Convolution2DNHWC(np.ones((1, 1, 1, 1), np.float32), datatype="f16").close()
        FullyConnected(np.ones((1, 1), np.float32), datatype="f16").close()
    except XNNPackError as exc:
        if exc.status_name == "xnn_status_unsupported_hardware":
            need = F16_KERNELS_NEED.get(platform.machine(), "XNNPack has none for this architecture")
            return False, f"no f16 kernels for this CPU ({need})"
        return False, str(exc)
    return True, "f16 convolution, deconvolution and fully connected"


def _require_f16() -> None:
    ok, why = f16_symbols()
    if not ok:
        raise XNNPackUnavailable(why)


def _creation(operator: str, datatype: str) -> tuple[str, int, type]:
    """(create function, extra flags, element type) of ``operator`` (e.g. "convolution2d_nhwc") in
    ``datatype``: "f32", or "f16", whose weights and bias are given in float32 all the same
    (XNN_FLAG_FP32_STATIC_WEIGHTS)."""
    if datatype == "f32":
        return f"xnn_create_{operator}_f32", 0, np.float32
    if datatype == "f16":
        _require_f16()
        return f"xnn_create_{operator}_f16", XNN_FLAG_FP32_STATIC_WEIGHTS, np.float16
    raise ValueError(f"no {datatype!r} {operator} operator (f32, f16)")


class HalfConvert(_RowwiseNC):
    """``xnn_create_convert_nc_f32_f16`` (``to`` = "f16": float32 rounded to IEEE half, to nearest
    even) or ``xnn_create_convert_nc_f16_f32`` (``to`` = "f32", exact) over the last axis; on the
    2024 API ``xnn_create_unary_elementwise_nc``'s convert between those types."""

    def __init__(self, to: str, channels: int, *, threadpool: Threadpool | None = None):
        super().__init__(threadpool)
        _require_f16()
        if to not in ("f16", "f32"):
            raise ValueError(f"no conversion to {to!r} (f16, f32)")
        self.channels = int(channels)
        self.source, self.target = (np.float32, np.float16) if to == "f16" else (np.float16, np.float32)
        if api() == API_2022:
            direction = "f32_f16" if to == "f16" else "f16_f32"
            self._create(f"xnn_create_convert_nc_{direction}", self.channels, self.channels, self.channels, 0)
        else:
            types = (XNN_DATATYPE_FP32, XNN_DATATYPE_FP16) if to == "f16" else (XNN_DATATYPE_FP16, XNN_DATATYPE_FP32)
            self._create("xnn_create_unary_elementwise_nc", _UNARY_2024["convert"], *types, None, None, None, 0)

    def _setup(self, x, out, threadpool=None) -> np.ndarray:
        x, out = _as_f32(x, "x", self.source), _as_f32(out, "out", self.target)
        if x.shape != out.shape or x.shape[-1] != self.channels:
            raise ValueError(f"expected x and out of the same shape (..., {self.channels}): {x.shape}, {out.shape}")
        self.bind_rows(x, out, x.size // self.channels, self.channels, threadpool)
        return out


__all__ = [
    "XNNPackError", "XNNPackUnavailable", "availability", "library_version", "lib", "Threadpool",
    "Operator", "Convolution2DNHWC", "Convolution2DNCHW", "nchw_convolution_supported",
    "FullyConnected", "MaxPooling2D", "AveragePooling2D", "GlobalAveragePooling", "Add", "Binary", "Clamp",
    "Unary", "PReLU", "ResizeBilinear", "Softmax", "Concatenate", "conv_output_size", "STATUS_NAMES",
    "INT8_VARIANTS", "int8_availability", "QConvolution2DNHWC", "QFullyConnected", "QuantizeConvert",
    "int8_activation_availability", "QSigmoid", "QMultiply", "SIGMOID_OUTPUT_SCALE",
    "int8_graph_availability", "QAdd", "QMaxPooling2D", "QGlobalAveragePooling", "ADD_SCALE_RATIO",
    "GLOBAL_AVERAGE_SCALE_RATIO", "INT8_DECONV_VARIANTS", "int8_deconvolution_availability", "QDeconvolution2DNHWC",
    "int8_leaky_relu_availability", "QLeakyRelu",
    "XNN_FLAG_FP32_STATIC_WEIGHTS", "f16_symbols", "f16_availability", "HalfConvert",
    "API_2022", "API_2024", "api", "installed_package",
]
