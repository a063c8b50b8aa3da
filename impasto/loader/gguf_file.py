"""A GGUF file's metadata and tensor table, read from one memory mapping.

Why not `gguf.GGUFReader`: it builds several numpy views per array element of the metadata,
so a 150k-token vocabulary costs ~600 MB of Python objects and seconds to parse; loading a
0.5 GB model then peaked at 1.7x its file size. Here metadata values become plain Python values
(arrays of numbers one numpy array each) and tensors are views of the mapping: nothing of a
tensor's data is read until it is used.

Format (version 2 and 3, little-endian): magic "GGUF", version u32, tensor count u64, metadata
count u64; metadata entries (key string, value type u32, value); tensor infos (name string,
dims u32, ne u64 x dims (innermost first), GGML type u32, offset u64); then the data section,
aligned to `general.alignment` (32 by default), each tensor at its offset within it.

Invariants: `tensors[i].data` is a read-only view of the file: [rows..., cols] for float types,
[rows..., row_bytes] (uint8) for quantized ones, like GGUFReader's; `shape` is ne order.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

_MAGIC = b"GGUF"
_SCALARS: dict[int, tuple[str, type]] = {  # value type -> (struct format, numpy-ready kind)
    0: ("<B", int), 1: ("<b", int), 2: ("<H", int), 3: ("<h", int), 4: ("<I", int),
    5: ("<i", int), 6: ("<f", float), 7: ("<?", bool), 10: ("<Q", int), 11: ("<q", int),
    12: ("<d", float),
}  # fmt: skip
_NUMPY = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32,
          6: np.float32, 7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}  # fmt: skip
_STRING, _ARRAY = 8, 9
_FLOAT_DTYPES = {
    GGMLQuantizationType.F32: np.float32,
    GGMLQuantizationType.F16: np.float16,
    GGMLQuantizationType.F64: np.float64,
    GGMLQuantizationType.I8: np.int8,
    GGMLQuantizationType.I16: np.int16,
    GGMLQuantizationType.I32: np.int32,
    GGMLQuantizationType.I64: np.int64,
}


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    tensor_type: GGMLQuantizationType
    shape: np.ndarray  # ne: innermost dimension first
    data: np.ndarray  # a read-only view of the file (see the module docstring)

    @property
    def n_bytes(self) -> int:
        """Bytes of the tensor's data in the file."""
        return int(self.data.nbytes)


class GGUFFile:
    """Parse `path`'s header; `metadata` maps keys to Python values, `tensors` in file order."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = os.fspath(path)
        self._map = np.memmap(self.path, dtype=np.uint8, mode="r")
        buf = memoryview(self._map)  # type: ignore[arg-type]
        if bytes(buf[:4]) != _MAGIC:
            raise ValueError(f"{self.path} is not a GGUF file (bad magic)")
        version, n_tensors, n_kv = struct.unpack_from("<IQQ", buf, 4)
        if version not in (2, 3):
            raise ValueError(f"{self.path}: GGUF version {version} is not supported (2 or 3)")
        self._buf, self._pos = buf, 24
        self.metadata: dict[str, Any] = {}
        for _ in range(n_kv):
            key = self._string()
            (vtype,) = self._unpack("<I")
            self.metadata[key] = self._value(vtype)
        infos = []
        for _ in range(n_tensors):
            name = self._string()
            (dims,) = self._unpack("<I")
            ne = np.array(self._unpack(f"<{dims}Q"), dtype=np.int64)
            qtype, offset = self._unpack("<IQ")
            infos.append((name, ne, GGMLQuantizationType(qtype), offset))
        align = int(self.metadata.get("general.alignment", 32))
        start = -(-self._pos // align) * align
        self.tensors = [self._tensor(start, *info) for info in infos]
        del self._buf  # the tensors keep the mapping alive; the parser's view is not needed

    def _unpack(self, fmt: str) -> tuple[Any, ...]:
        values = struct.unpack_from(fmt, self._buf, self._pos)
        self._pos += struct.calcsize(fmt)
        return values

    def _string(self) -> str:
        (n,) = self._unpack("<Q")
        text = bytes(self._buf[self._pos : self._pos + n]).decode("utf-8", errors="replace")
        self._pos += n
        return text

    def _value(self, vtype: int) -> Any:
        if vtype in _SCALARS:
            return self._unpack(_SCALARS[vtype][0])[0]
        if vtype == _STRING:
            return self._string()
        if vtype == _ARRAY:
            etype, count = self._unpack("<IQ")
            if etype in _NUMPY:  # one numpy read, then plain Python values
                dtype = np.dtype(_NUMPY[etype]).newbyteorder("<")
                arr = np.frombuffer(self._buf, dtype=dtype, count=count, offset=self._pos)
                self._pos += arr.nbytes
                return arr.tolist()
            return [self._value(etype) for _ in range(count)]
        raise ValueError(f"{self.path}: unknown GGUF metadata value type {vtype}")

    def _tensor(self, start: int, name: str, ne: np.ndarray, qtype, offset: int) -> GGUFTensor:
        count = int(np.prod(ne)) if len(ne) else 1
        rows_shape = tuple(int(d) for d in reversed(ne[1:].tolist()))
        begin = start + offset
        if qtype in _FLOAT_DTYPES:
            dtype = np.dtype(_FLOAT_DTYPES[qtype])
            nbytes, row = count * dtype.itemsize, int(ne[0])
        else:
            elems, block_bytes = GGML_QUANT_SIZES[qtype]
            if int(ne[0]) % elems:
                raise ValueError(f"{self.path}: {name}'s rows are not whole {qtype.name} blocks")
            dtype, nbytes, row = np.dtype(np.uint8), count // elems * block_bytes, -1
        if begin + nbytes > len(self._map):
            raise ValueError(f"{self.path}: tensor {name} runs past the end of the file")
        data = self._map[begin : begin + nbytes].view(dtype).reshape(*rows_shape, row)
        return GGUFTensor(name, qtype, ne, data)
