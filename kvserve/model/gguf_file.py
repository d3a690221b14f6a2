"""A GGUF file read straight from a memory map: its metadata and its tensors as torch tensors.

gguf's own GGUFReader builds a numpy view per field part, which costs seconds on a tokenizer of
~100k strings (3.5 s for SmolLM2's); this reader walks the header once with ``struct`` and
hands out tensors as views of the map. The common block formats (Q4_0, Q4_1, Q8_0) dequantize
with torch's threaded element-wise ops; the others go through ``gguf.quants`` (numpy).
"""

from __future__ import annotations

import mmap
import struct
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple, overload

import numpy as np
import torch
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

GGUF_MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32

# metadata value types (GGUFValueType): struct format of each fixed-size one
_SCALAR_FORMATS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_NUMPY_DTYPES = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32,
                 6: np.float32, 7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}
_STRING, _ARRAY = 8, 9

F32, F16, BF16 = GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16
Q4_0, Q4_1, Q8_0 = GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q8_0


class GGUFTensor(NamedTuple):
    name: str
    tensor_type: GGMLQuantizationType
    shape: tuple[int, ...]  # row-major (outermost first), the reverse of GGUF's ne[] order
    data: np.ndarray  # the raw bytes (uint8), a view of the file's map
    offset: int = 0  # where they start in the file


class GGUFFile:
    """``fields``: metadata key -> value (str, int, float, bool, or a list for arrays);
    ``tensors``: in file order. Tensors' data stays valid while the object lives."""

    def __init__(self, path: str | Path) -> None:
        with open(path, "rb") as file:
            # copy-on-write: writable views (torch wants them), the file never changes
            self._map = mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_COPY)
        buffer = memoryview(self._map)
        if buffer[:4] != GGUF_MAGIC:
            raise ValueError(f"{path} is not a GGUF file (magic {bytes(buffer[:4])!r})")
        version, tensor_count, field_count = struct.unpack_from("<IQQ", buffer, 4)
        if version not in (2, 3):
            raise ValueError(f"{path}: GGUF version {version} is not supported (2 or 3; a big-endian file reads as "
                             "a huge version)")
        self._buffer, self._offset = buffer, 24
        self.fields: dict[str, Any] = {}
        for _ in range(field_count):
            key = self._string()
            self.fields[key] = self._value(self._scalar("I"))
        infos = []
        for _ in range(tensor_count):
            name = self._string()
            dims = struct.unpack_from(f"<{self._scalar('I')}Q", buffer, self._offset)
            self._offset += 8 * len(dims)
            infos.append((name, dims, GGMLQuantizationType(self._scalar("I")), self._scalar("Q")))
        alignment = int(self.fields.get("general.alignment", DEFAULT_ALIGNMENT))
        start = -(-self._offset // alignment) * alignment
        whole = np.frombuffer(self._map, dtype=np.uint8)
        self.tensors: list[GGUFTensor] = []
        for name, dims, tensor_type, offset in infos:
            elements = int(np.prod(dims))
            block, block_bytes = GGML_QUANT_SIZES[tensor_type]
            begin = start + offset
            self.tensors.append(GGUFTensor(name, tensor_type, tuple(reversed(dims)),
                                           whole[begin:begin + elements // block * block_bytes], begin))

    def drop_pages(self, tensor: GGUFTensor) -> None:
        """Hand a tensor's pages of the map back to the kernel once it has been read (a repacked
        weight): resident memory during a load then holds the packed copies, not the file too.
        Pages it shares with a neighbour stay; reading the tensor again maps them anew."""
        page = mmap.PAGESIZE
        first = -(-tensor.offset // page) * page
        last = (tensor.offset + tensor.data.nbytes) // page * page
        if last > first:
            self._map.madvise(mmap.MADV_DONTNEED, first, last - first)

    def _scalar(self, fmt: str) -> Any:
        value = struct.unpack_from("<" + fmt, self._buffer, self._offset)[0]
        self._offset += struct.calcsize(fmt)
        return value

    def _string(self) -> str:
        length = self._scalar("Q")
        text = bytes(self._buffer[self._offset:self._offset + length]).decode("utf-8", errors="replace")
        self._offset += length
        return text

    def _value(self, value_type: int) -> Any:
        if value_type == _STRING:
            return self._string()
        if value_type == _ARRAY:
            item_type, count = self._scalar("I"), self._scalar("Q")
            if item_type in _NUMPY_DTYPES:  # numbers in one read
                dtype = _NUMPY_DTYPES[item_type]
                items: np.ndarray = np.frombuffer(self._buffer, dtype=dtype, count=count, offset=self._offset)
                self._offset += items.nbytes
                return items.tolist()
            if item_type == _STRING:  # a vocabulary's 100k+ strings: decoded only if read
                start = self._offset
                for _ in range(count):
                    self._offset += 8 + int.from_bytes(self._buffer[self._offset:self._offset + 8], "little")
                return StringArray(self._buffer[start:self._offset], count)
            return [self._value(item_type) for _ in range(count)]
        return self._scalar(_SCALAR_FORMATS[value_type])


class StringArray(Sequence[str]):
    """A GGUF array of strings, decoded on first use: the engine reads a vocabulary's length, the
    tokenizer (converted once and cached) its entries. Decoding 300k of them cost 1.9 s a load."""

    def __init__(self, data: memoryview, count: int) -> None:
        self._data, self._count = data, count
        self._items: list[str] | None = None

    def __len__(self) -> int:
        return self._count

    def _decoded(self) -> list[str]:
        if self._items is None:
            items, offset = [], 0
            for _ in range(self._count):
                length = int.from_bytes(self._data[offset:offset + 8], "little")
                items.append(bytes(self._data[offset + 8:offset + 8 + length]).decode("utf-8", errors="replace"))
                offset += 8 + length
            self._items = items
        return self._items

    @overload
    def __getitem__(self, index: int) -> str: ...
    @overload
    def __getitem__(self, index: slice) -> list[str]: ...
    def __getitem__(self, index: int | slice) -> str | list[str]:
        return self._decoded()[index]

    def __eq__(self, other: object) -> bool:
        return list(self) == list(other) if isinstance(other, (list, StringArray)) else NotImplemented


def dequantize(tensor: GGUFTensor) -> torch.Tensor:
    """The tensor's values in float32, shaped ``tensor.shape``."""
    raw = torch.from_numpy(tensor.data)
    if tensor.tensor_type == F32:
        values = raw.view(torch.float32).clone()
    elif tensor.tensor_type in (F16, BF16):
        values = raw.view(torch.float16 if tensor.tensor_type == F16 else torch.bfloat16).float()
    elif tensor.tensor_type in (Q4_0, Q4_1, Q8_0):
        values = _dequantize_blocks(raw.view(-1, GGML_QUANT_SIZES[tensor.tensor_type][1]), tensor.tensor_type)
    else:
        from gguf.quants import dequantize as numpy_dequantize

        values = torch.from_numpy(numpy_dequantize(tensor.data, tensor.tensor_type))
    return values.reshape(tensor.shape)


def _dequantize_blocks(blocks: torch.Tensor, tensor_type: GGMLQuantizationType) -> torch.Tensor:
    """Blocks of 32 weights behind a float16 scale d (and for Q4_1 a float16 minimum m):
    Q8_0 holds int8 q (w = d·q); Q4_0/Q4_1 hold 4-bit q, weights 0-15 in the low nibbles
    and 16-31 in the high ones (w = d·(q - 8), w = d·q + m)."""
    scale = blocks[:, 0:2].contiguous().view(torch.float16).float()
    if tensor_type == Q8_0:
        return blocks[:, 2:].contiguous().view(torch.int8).float() * scale
    packed = blocks[:, 4:] if tensor_type == Q4_1 else blocks[:, 2:]
    nibbles = torch.cat((packed & 0x0F, packed >> 4), dim=1).float()
    if tensor_type == Q4_0:
        return (nibbles - 8.0) * scale
    return nibbles * scale + blocks[:, 2:4].contiguous().view(torch.float16).float()  # numpy's rounding order


# the block formats GGUF weights are served in (kvserve.model.gguf_linear)
Q = GGMLQuantizationType
PACKED_TYPES = frozenset({Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.Q4_K, Q.Q5_K, Q.Q6_K})


class GGUFWeight(NamedTuple):
    """A quantized 2-D GGUF tensor as the file holds it: ``raw`` uint8 [rows, bytes per row] (a
    view of the file's map until rows are permuted), ``shape`` (rows, in_features); ``source``
    the file and tensor it was read from, whose pages are dropped once it is packed."""

    raw: torch.Tensor
    tensor_type: GGMLQuantizationType
    shape: tuple[int, int]
    source: tuple[GGUFFile, GGUFTensor] | None = None

    @staticmethod
    def of(reader: GGUFFile, tensor: GGUFTensor) -> GGUFWeight:
        rows, cols = tensor.shape
        return GGUFWeight(torch.from_numpy(tensor.data).view(rows, -1), tensor.tensor_type, (rows, cols),
                          (reader, tensor))

    def rows_permuted(self, order: torch.Tensor) -> GGUFWeight:
        """The same weight with its rows (output channels) in ``order``."""
        return self._replace(raw=self.raw[order].contiguous())

    def dequantize(self) -> torch.Tensor:
        """float32 [rows, in_features] (the widening path and small lookups)."""
        return dequantize(GGUFTensor("", self.tensor_type, self.shape, self.raw.contiguous().numpy().reshape(-1)))


# per tile of 16 rows: (inputs a group, bytes a group) as csrc/gguf_linear.cpp packs them
PACKED_GROUP_BYTES = {Q.Q4_0: (32, 288), Q.Q4_1: (32, 320), Q.Q5_0: (32, 352), Q.Q5_1: (32, 384),
                      Q.Q8_0: (32, 544), Q.Q4_K: (32, 320), Q.Q5_K: (32, 384), Q.Q6_K: (16, 224)}


def served_bytes(tensor: GGUFTensor, float_bytes: int) -> int:
    """A tensor's bytes as kvserve serves it: packed (keeps_quantized), else in a float dtype of
    ``float_bytes`` a value."""
    if not keeps_quantized(tensor):
        return int(np.prod(tensor.shape)) * float_bytes
    rows, cols = tensor.shape
    group, group_bytes = PACKED_GROUP_BYTES[tensor.tensor_type]
    return -(-rows // 16) * (cols // group) * group_bytes


def keeps_quantized(tensor: GGUFTensor) -> bool:
    """Whether a GGUF tensor is served in its blocks: a 2-D weight in a packed block format."""
    return len(tensor.shape) == 2 and tensor.tensor_type in PACKED_TYPES and tensor.shape[1] % 32 == 0


def rows_as_float(weight: torch.Tensor | GGUFWeight) -> torch.Tensor:
    """A checkpoint weight as float32, whichever form the loader gave it in."""
    return weight.dequantize() if isinstance(weight, GGUFWeight) else weight
