#!/usr/bin/python3
"""Checks that our safetensors files are what the Python ecosystem reads, and
makes a file written the Python way for our reader. Uses only json and struct
(the format is simple enough; the `safetensors` package need not be
installed); with torch present it also decodes through torch.frombuffer.

    # Read a file written by nn/io and print what it holds:
    /usr/bin/python3 tools/golden/safetensors_interop.py check nn/io/testdata/cpp_written.safetensors
    # Write the Python-made file nn/io/safetensors_test.cc reads:
    /usr/bin/python3 tools/golden/safetensors_interop.py write nn/io/testdata/python_written.safetensors
"""
import json
import struct
import sys

SIZES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "U8": 1}
FORMATS = {"F64": "<d", "F32": "<f", "F16": "<e", "I64": "<q", "I32": "<i", "U8": "<B"}


def check(path):
    data = open(path, "rb").read()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    body = data[8 + n:]
    print("header bytes", n, "aligned", (8 + n) % 8 == 0)
    metadata = header.pop("__metadata__", {})
    print("metadata", metadata)
    if "ddp.data_crc32" in metadata:
        import zlib
        assert "%08x" % zlib.crc32(body) == metadata["ddp.data_crc32"], "checksum"
        print("checksum OK")
    if "ddp.header_crc32" in metadata:
        import zlib
        text = data[8:8 + n]
        said = metadata["ddp.header_crc32"].encode()
        mark = b'"ddp.header_crc32":"' + said + b'"'
        assert text.count(mark) == 1, "header checksum entry"
        zeroed = text.replace(mark, b'"ddp.header_crc32":"00000000"')
        assert ("%08x" % zlib.crc32(zeroed)).encode() == said, "header checksum"
        print("header checksum OK")
    spans = []
    for name, info in header.items():
        begin, end = info["data_offsets"]
        count = 1
        for d in info["shape"]:
            count *= d
        assert end - begin == count * SIZES[info["dtype"]], name
        spans.append((begin, end))
        raw = body[begin:end]
        if info["dtype"] == "BF16":
            values = [struct.unpack("<f", b"\0\0" + raw[i:i + 2])[0] for i in range(0, len(raw), 2)]
        else:
            fmt = FORMATS[info["dtype"]]
            size = struct.calcsize(fmt)
            values = [struct.unpack(fmt, raw[i:i + size])[0] for i in range(0, len(raw), size)]
        print(name, info["dtype"], info["shape"], values[:6])
    spans.sort()
    pos = 0
    for begin, end in spans:
        assert begin == pos, "gap or overlap"
        pos = end
    assert pos == len(body), "data region not covered"
    try:
        import torch
        dt = {"F32": torch.float32, "F64": torch.float64, "F16": torch.float16,
              "BF16": torch.bfloat16, "I64": torch.int64, "I32": torch.int32, "U8": torch.uint8}
        for name, info in header.items():
            begin, end = info["data_offsets"]
            if begin == end:
                continue
            t = torch.frombuffer(bytearray(body[begin:end]), dtype=dt[info["dtype"]])
            print("torch", name, t.reshape(info["shape"]).flatten()[:6].tolist())
    except ImportError:
        pass
    print("OK")


def write(path):
    # Header keys in a different order from the data, header length not a
    # multiple of 8, no checksum: all legal, and not how nn/io writes.
    tensors = [
        ("layer.weight", "F32", [2, 3], struct.pack("<6f", 1.5, -2.0, 0.25, 3.0, -0.0, 1e-3)),
        ("step", "I64", [], struct.pack("<q", -7)),
        ("half", "F16", [3], struct.pack("<3e", 1.0, -2.5, 65504.0)),
        ("brain", "BF16", [2], struct.pack("<2H", 0x3F80, 0xC040)),  # 1.0, -3.0
        ("double", "F64", [1, 2], struct.pack("<2d", 3.141592653589793, -1e300)),
        ("ints", "I32", [2, 2], struct.pack("<4i", 1, -2, 2**31 - 1, -2**31)),
        ("bytes", "U8", [5], bytes([0, 1, 127, 128, 255])),
        ("empty", "F32", [0, 4], b""),
    ]
    header = {"__metadata__": {"format": "pt", "epoch": "3"}}
    body = b""
    for name, dtype, shape, raw in tensors:
        header[name] = {"dtype": dtype, "shape": shape,
                        "data_offsets": [len(body), len(body) + len(raw)]}
        body += raw
    text = json.dumps(dict(reversed(list(header.items())))).encode()
    if (8 + len(text)) % 8 == 0:
        text += b" "
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text + body)


if __name__ == "__main__":
    {"check": check, "write": write}[sys.argv[1]](sys.argv[2])
