"""kvserve's GGUF reader against gguf's own (GGUFReader and its numpy dequantization)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter
from gguf.quants import dequantize as numpy_dequantize
from gguf.quants import quantize

from kvserve.model.gguf_file import GGUFFile, dequantize

TYPES = [GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.Q8_0,
         GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1,
         GGMLQuantizationType.Q5_0]  # Q5_0: a type read through gguf's numpy path


@pytest.fixture(scope="module")
def gguf_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("gguf") / "model.gguf"
    writer = GGUFWriter(str(path), "llama")
    writer.add_uint32("llama.block_count", 3)
    writer.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-5)
    writer.add_float64("test.float64", 0.1)
    writer.add_int64("test.int64", -(2**40))
    writer.add_bool("test.bool", True)
    writer.add_string("test.text", "héllo")
    writer.add_array("test.strings", ["a", "", "ü✓", "<|im_end|>"])
    writer.add_array("test.ints", [3, -1, 7])
    writer.add_array("test.nested", [[1, 2], [3]])
    rng = np.random.default_rng(0)
    for i, kind in enumerate(TYPES):
        values = rng.standard_normal((5, 96)).astype(np.float32)
        data = values if kind == GGMLQuantizationType.F32 else quantize(values, kind)
        if kind == GGMLQuantizationType.F16:
            data = values.astype(np.float16)
        writer.add_tensor(f"t{i}", data, raw_dtype=None if kind in (GGMLQuantizationType.F32,
                                                                     GGMLQuantizationType.F16) else kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_fields_match_gguf_reader(gguf_path: Path) -> None:
    ours = GGUFFile(gguf_path)
    theirs = GGUFReader(str(gguf_path))
    expected = {key: field.contents() for key, field in theirs.fields.items() if not key.startswith("GGUF.")}
    assert ours.fields.keys() == expected.keys()
    del expected["test.nested"]  # GGUFReader's contents() flattens arrays of arrays; we keep them nested
    for key, value in expected.items():
        assert ours.fields[key] == pytest.approx(value) if isinstance(value, float) else ours.fields[key] == value, key
    assert ours.fields["test.strings"] == ["a", "", "ü✓", "<|im_end|>"]
    assert ours.fields["test.nested"] == [[1, 2], [3]]
    assert ours.fields["test.int64"] == -(2**40)


@pytest.mark.parametrize("index", range(len(TYPES)))
def test_tensors_dequantize_as_gguf_does(gguf_path: Path, index: int) -> None:
    ours = GGUFFile(gguf_path).tensors[index]
    theirs = GGUFReader(str(gguf_path)).tensors[index]
    assert (ours.name, ours.tensor_type, ours.shape) == (theirs.name, int(theirs.tensor_type), (5, 96))
    expected = numpy_dequantize(np.asarray(theirs.data), theirs.tensor_type).astype(np.float32)
    # bit for bit: the weights the transformers oracle loads are the same numbers
    assert torch.equal(dequantize(ours), torch.from_numpy(expected.reshape(5, 96)))


def test_not_a_gguf_file(tmp_path: Path) -> None:
    path = tmp_path / "bad.gguf"
    path.write_bytes(b"GGML" + bytes(40))
    with pytest.raises(ValueError, match="not a GGUF file"):
        GGUFFile(path)
