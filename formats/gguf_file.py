"""The GGUF container read directly: header, metadata and tensor records over one memory map.

    # prints the metadata (arrays abbreviated) and the tensors
    python -m formats.gguf_file FILE.gguf

Layout (little-endian, version 2 or 3): "GGUF", version u32, tensor count u64, metadata count u64;
each metadata entry is a key (string = u64 length + UTF-8 bytes), a value type u32 and a value
(scalars, strings, or arrays: item type u32, count u64, items); then per tensor its name, number
of dimensions u32, dimensions u64 each (innermost first), type u32 and data offset u64; the data
starts at the next multiple of general.alignment (32 by default).

gguf.GGUFReader reads the same, but builds numpy views for every part of every value: a 50k-token
vocabulary and its merges take it about 4 s and 170 MiB. Here strings are decoded straight from
the bytes (about 0.1 s), and every length and offset is checked against the file's size, so a
truncated or corrupt file is a ValueError naming what is wrong, never a crash or a huge read
(arrays of arrays are refused). Tensor records mirror GGUFReader's (name, tensor_type, shape
innermost first, data: an array over the map, in PyTorch order, bytes [..., row_bytes] for
block-quantized types): no tensor is copied here, and release() drops a tensor's pages once its
reader has copied it out. Of the `gguf` package only the type numbers and block sizes are used
(GGMLQuantizationType, GGML_QUANT_SIZES).
"""

import struct
import sys
from dataclasses import dataclass

import numpy as np

# value type -> (struct format, size); 8 = string, 9 = array
SCALARS = {
    0: ("<B", 1),
    1: ("<b", 1),
    2: ("<H", 2),
    3: ("<h", 2),
    4: ("<I", 4),
    5: ("<i", 4),
    6: ("<f", 4),
    7: ("<?", 1),
    10: ("<Q", 8),
    11: ("<q", 8),
    12: ("<d", 8),
}
NUMPY = {
    0: np.uint8,
    1: np.int8,
    2: np.uint16,
    3: np.int16,
    4: np.uint32,
    5: np.int32,
    6: np.float32,
    7: np.bool_,
    10: np.uint64,
    11: np.int64,
    12: np.float64,
}
STRING, ARRAY = 8, 9
PLAIN_TENSORS = {
    "F32": np.float32,
    "F16": np.float16,
    "F64": np.float64,
    "I8": np.int8,
    "I16": np.int16,
    "I32": np.int32,
    "I64": np.int64,
}


@dataclass
class Field:
    value: object  # a Python scalar, str, or list
    types: list  # [value type] or [ARRAY, item type], as gguf.GGUFValueType numbers

    def contents(self):
        return self.value


@dataclass
class Tensor:
    name: str
    tensor_type: object  # gguf.GGMLQuantizationType
    shape: np.ndarray  # innermost first, as in the file
    data: np.ndarray  # a view of the memory map, PyTorch order


class GGUFFile:
    """A parsed GGUF file: .fields {key: Field} and .tensors [Tensor] over .map (the file, mapped
    read-only)."""

    def __init__(self, path):
        self.path = str(path)
        self.map = np.memmap(self.path, dtype=np.uint8, mode="r")
        self.buf, self.pos = memoryview(self.map), 0
        n_tensors, n_fields = self.header()
        self.fields = self.metadata(n_fields)
        records = self.tensor_records(n_tensors)
        start = self.data_start()
        self.tensors, names, spans = [], set(), []
        for name, dims, raw_type, offset in records:
            if name in names:
                raise ValueError(f"tensor {name!r} appears twice")
            names.add(name)
            at = start + offset
            tensor = self.tensor_view(name, dims, raw_type, at)
            spans.append((at, at + tensor.data.nbytes, name))
            self.tensors.append(tensor)
        check_no_overlap(spans)

    def header(self):
        """(tensor count, metadata count) after the magic and the version, each count checked
        against the file's size."""
        if self.take(4) != b"GGUF":
            raise ValueError("no GGUF magic at the start")
        version = self.scalar(4)
        if version not in (2, 3):
            raise ValueError(
                f"GGUF version {version} (read: 2 and 3; a big-endian file reads as a huge number)"
            )
        n_tensors, n_fields = self.scalar(10), self.scalar(10)
        self.count(n_tensors, 8, "tensors")
        self.count(n_fields, 9, "metadata entries")
        return n_tensors, n_fields

    def metadata(self, n_fields: int) -> dict:
        """{key: Field} of the metadata entries."""
        fields = {}
        for _ in range(n_fields):
            key = self.string()
            kind = self.scalar(4)
            value, types = self.value(kind)
            fields[key] = Field(value, types)
        return fields

    def tensor_records(self, n_tensors: int) -> list:
        """[(name, dims innermost first, type number, data offset)] of the tensor records."""
        records = []
        for _ in range(n_tensors):
            name, n_dims = self.string(), self.scalar(4)
            if n_dims > 4:
                raise ValueError(f"tensor {name!r} has {n_dims} dimensions")
            dims = [self.scalar(10) for _ in range(n_dims)]
            records.append((name, dims, self.scalar(4), self.scalar(10)))
        return records

    def data_start(self) -> int:
        """Where the tensor data starts: the next multiple of general.alignment (a power of two,
        32 by default) after the records."""
        alignment = self.fields.get("general.alignment", Field(32, [4])).value
        if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
            raise ValueError(f"general.alignment {alignment!r} is not a power of two")
        return -(-self.pos // alignment) * alignment

    def tensor_view(self, name: str, dims: list, raw_type: int, at: int) -> Tensor:
        """One tensor over the map at byte `at`, its type, shape and extent checked against the
        file: plain types as their numpy dtype, block-quantized ones as bytes [..., row bytes]."""
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

        try:
            kind = GGMLQuantizationType(raw_type)
        except ValueError:
            raise ValueError(f"tensor {name!r} has an unknown type number {raw_type}") from None
        block, size = GGML_QUANT_SIZES[kind]
        n = int(np.prod(dims, dtype=np.float64)) if dims else 1
        if n > len(self.map) * block or n % block or (dims and dims[0] % block):
            raise ValueError(f"tensor {name!r} of type {kind.name} cannot have shape {dims}")
        nbytes = n // block * size
        if at + nbytes > len(self.map):
            raise ValueError(
                f"tensor {name!r} needs {nbytes:,} bytes at {at:,}, past the end of the "
                f"file ({len(self.map):,} bytes): truncated"
            )
        shape = tuple(reversed(dims)) or (1,)
        if kind.name in PLAIN_TENSORS:
            data = self.map[at : at + nbytes].view(PLAIN_TENSORS[kind.name]).reshape(shape)
        else:  # [..., row bytes]
            data = self.map[at : at + nbytes].reshape(*shape[:-1], shape[-1] // block * size)
        return Tensor(name, kind, np.array(dims, dtype=np.uint64), data)

    def release(self, tensor: Tensor):
        """Drop a tensor's pages from this process's resident set once it has been copied out (the
        map stays valid: a later read faults them in again from the file)."""
        import mmap

        start = tensor.data.ctypes.data - self.map.ctypes.data
        first, end = start // mmap.PAGESIZE * mmap.PAGESIZE, start + tensor.data.nbytes
        try:
            self.map._mmap.madvise(mmap.MADV_DONTNEED, first, end - first)
        except (
            AttributeError,
            OSError,
            ValueError,
        ):  # no madvise here: the pages stay until unmapped
            pass

    def take(self, n: int) -> bytes:
        if n < 0 or self.pos + n > len(self.buf):
            raise ValueError(
                f"metadata runs past the end of the file at byte {self.pos:,}: truncated"
            )
        out = self.buf[self.pos : self.pos + n]
        self.pos += n
        return bytes(out)

    def count(self, n: int, min_bytes: int, what: str):
        if n * min_bytes > len(self.buf):
            raise ValueError(
                f"the header claims {n:,} {what}, more than the file's {len(self.buf):,} bytes hold"
            )

    def scalar(self, kind: int):
        fmt, size = SCALARS[kind]
        return struct.unpack(fmt, self.take(size))[0]

    def string(self) -> str:
        n = self.scalar(10)
        try:
            return self.take(n).decode("utf-8")
        except UnicodeDecodeError as e:
            raise ValueError(
                f"a string at byte {self.pos - n:,} is not UTF-8 ({e.reason})"
            ) from None

    def value(self, kind: int):
        if kind in SCALARS:
            return self.scalar(kind), [kind]
        if kind == STRING:
            return self.string(), [kind]
        if kind != ARRAY:
            raise ValueError(f"unknown metadata value type {kind} at byte {self.pos:,}")
        item, n = self.scalar(4), self.scalar(10)
        if item in NUMPY:
            size = SCALARS[item][1]
            self.count(n, size, "array items")
            return np.frombuffer(self.take(n * size), dtype=NUMPY[item]).tolist(), [ARRAY, item]
        if item != STRING:
            raise ValueError(f"arrays of type {item} are not read here (at byte {self.pos:,})")
        self.count(n, 8, "strings")
        out = []
        buf, pos, end = self.buf, self.pos, len(self.buf)
        for _ in range(n):  # the hot loop of a vocabulary: no method calls
            if pos + 8 > end:
                raise ValueError("a string array runs past the end of the file: truncated")
            length = int.from_bytes(buf[pos : pos + 8], "little")
            if pos + 8 + length > end:
                raise ValueError("a string array runs past the end of the file: truncated")
            out.append(str(buf[pos + 8 : pos + 8 + length], "utf-8", "replace"))
            pos += 8 + length
        self.pos = pos
        return out, [ARRAY, STRING]


def check_no_overlap(spans: list):
    """A ValueError unless each tensor's bytes are its own: spans [(start, end, name)]."""
    spans.sort()
    for (_, end, first), (at, _, second) in zip(spans, spans[1:]):
        if at < end:
            raise ValueError(
                f"tensors {first!r} and {second!r} overlap in the file (offsets point into "
                "each other's data)"
            )


def main(argv=None) -> int:
    f = GGUFFile((argv or sys.argv[1:])[0])
    for key, field in f.fields.items():
        v = field.value
        print(f"{key} = {v if not isinstance(v, list) else f'[{len(v)} items] {v[:5]}'}")
    for t in f.tensors:
        print(f"{t.name}: {t.tensor_type.name} {list(map(int, t.shape))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
