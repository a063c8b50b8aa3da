"""impasto's GGUF parser (loader/gguf_file.py) reads what the `gguf` package's reader reads."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

from impasto.loader.gguf_file import GGUFFile

_PSEUDO_FIELDS = {"GGUF.version", "GGUF.tensor_count", "GGUF.kv_count"}


def _write(path, alignment: int | None = None) -> None:
    w = gguf.GGUFWriter(str(path), "llama")
    if alignment is not None:
        w.add_custom_alignment(alignment)
    w.add_uint8("t.u8", 7)
    w.add_int8("t.i8", -7)
    w.add_uint16("t.u16", 65535)
    w.add_int16("t.i16", -300)
    w.add_uint32("t.u32", 4_000_000_000)
    w.add_int32("t.i32", -5)
    w.add_float32("t.f32", 0.1)
    w.add_uint64("t.u64", 2**63)
    w.add_int64("t.i64", -(2**40))
    w.add_float64("t.f64", 1e-300)
    w.add_bool("t.bool", True)
    w.add_string("t.str", "héllo \u2028 wörld")
    w.add_array("t.ints", [1, 2, 3])
    w.add_array("t.floats", [0.5, -1.25])
    w.add_array("t.strs", ["a", "", "ü", "<0x0A>"])
    w.add_array("t.empty", [])
    rng = np.random.default_rng(0)
    w.add_tensor("f32", rng.standard_normal((3, 5)).astype(np.float32))
    w.add_tensor("f16", rng.standard_normal((2, 7)).astype(np.float16))
    w.add_tensor("vec", rng.standard_normal(9).astype(np.float32))
    for qtype in (Q.Q8_0, Q.Q4_0, Q.Q5_0):
        data = gguf.quants.quantize(rng.standard_normal((4, 64)).astype(np.float32), qtype)
        w.add_tensor(f"q.{qtype.name}", data, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("alignment", [None, 64])
def test_same_metadata_and_tensors_as_gguf_reader(tmp_path, alignment):
    path = tmp_path / "m.gguf"
    _write(path, alignment)
    ours, ref = GGUFFile(path), gguf.GGUFReader(str(path))
    assert set(ours.metadata) == set(ref.fields) - _PSEUDO_FIELDS
    for key, value in ours.metadata.items():
        expected = ref.fields[key].contents()
        assert type(value) is type(expected) and value == pytest.approx(expected), key
    assert ours.metadata["t.strs"] == ["a", "", "ü", "<0x0A>"]
    for a, b in zip(ours.tensors, ref.tensors, strict=True):
        assert (a.name, a.tensor_type) == (b.name, b.tensor_type)
        assert a.shape.tolist() == b.shape.tolist()
        assert a.data.dtype == b.data.dtype and a.data.shape == b.data.shape
        assert np.array_equal(a.data, b.data)
        assert not a.data.flags.writeable  # views of the read-only mapping


def test_bad_files_are_refused(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGML" + bytes(60))
    with pytest.raises(ValueError, match="not a GGUF file"):
        GGUFFile(bad)
    path = tmp_path / "m.gguf"
    _write(path)
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(ValueError, match="past the end"):
        GGUFFile(cut)
