"""A safetensors file whose header length starts with the byte a pickle starts with is still read."""

from __future__ import annotations

import json
import struct

from vidmem.memory.storage.files import open_safetensors, sniff


def test_a_header_length_of_128_mod_256_is_not_mistaken_for_a_pickle(tmp_path):
    for pad in range(256):
        header = json.dumps({"x": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]},
                             "__metadata__": {"pad": "a" * pad}}).encode()
        if len(header) % 256 == 128:
            break
    path = tmp_path / "w.safetensors"
    path.write_bytes(struct.pack("<Q", len(header)) + header + struct.pack("<f", 1.5))
    assert path.read_bytes()[:1] == b"\x80"
    assert sniff(path) == "safetensors"
    assert open_safetensors(path).tensors["x"].tolist() == [1.5]
