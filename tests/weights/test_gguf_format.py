"""flexoff's GGUF reader against the gguf package's, and a broken file as one line naming what broke."""

import struct

import numpy as np
import pytest

from flexoff.errors import CheckpointError, FlexoffError, UnsupportedModelError
from flexoff.gguf_format import GGML_TYPES, GGUFFile

gguf = pytest.importorskip("gguf")


def test_the_type_table_agrees_with_ggml_for_every_type_it_names():
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    known = {t.value: t for t in GGMLQuantizationType}  # older releases lack the newest types
    for type_id, (name, block, block_bytes) in GGML_TYPES.items():
        if type_id in known:
            assert known[type_id].name == name
            assert GGML_QUANT_SIZES[known[type_id]] == (block, block_bytes), name
    assert {"Q4_0", "Q4_1", "Q8_0", "Q4_K", "BF16"} <= {known[i].name for i in GGML_TYPES if i in known}


def test_every_value_type_reads_as_the_gguf_package_wrote_it(tmp_path):
    path = tmp_path / "values.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    values = {"u8": (255, "add_uint8"), "i8": (-3, "add_int8"), "u16": (65535, "add_uint16"),
              "i16": (-300, "add_int16"), "u32": (4_000_000_000, "add_uint32"), "i32": (-7, "add_int32"),
              "f32": (0.1, "add_float32"), "bool": (True, "add_bool"), "str": ("héllo", "add_string"),
              "u64": (2**63 + 5, "add_uint64"), "i64": (-(2**40), "add_int64"), "f64": (0.1, "add_float64"),
              "ints": ([1, 2, 3], "add_array"), "floats": ([0.5, -1.25], "add_array"),
              "strs": (["a", "", "ünï"], "add_array"), "nested": ([[1, 2], [3]], "add_array")}
    for key, (value, method) in values.items():
        getattr(writer, method)(f"test.{key}", value)
    writer.add_custom_alignment(64)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    ours = GGUFFile(path)
    theirs = gguf.GGUFReader(str(path))
    assert ours.alignment == 64
    expected = {key: value for key, (value, _) in values.items()}
    expected["f32"] = float(np.float32(0.1))
    assert {key: ours.metadata[f"test.{key}"] for key in values} == expected
    assert ours.value_types["test.u8"] == "UINT8" and ours.value_types["test.strs"] == "ARRAY[STRING]"
    assert ours.value_types["test.f32"] == "FLOAT32" and ours.value_types["test.nested"] == "ARRAY[ARRAY]"
    assert set(ours.metadata) == set(theirs.fields) - {"GGUF.version", "GGUF.tensor_count", "GGUF.kv_count"}


def test_tensor_shapes_offsets_and_bytes_match_the_gguf_package(gguf_llama):
    for path in gguf_llama[1].values():
        ours = GGUFFile(path)
        theirs = gguf.GGUFReader(str(path))
        assert len(ours.tensors) == len(theirs.tensors)
        for tensor in theirs.tensors:
            info = ours.tensors[tensor.name]
            assert info.shape == tuple(int(d) for d in reversed(tensor.shape))
            assert (info.type_name, info.offset, info.nbytes) == \
                (tensor.tensor_type.name, tensor.data_offset, tensor.n_bytes)
            assert np.array_equal(ours.raw(tensor.name).reshape(-1), tensor.data.view(np.uint8).reshape(-1))


def one_line(exc: FlexoffError, *needles: str) -> str:
    message = str(exc)
    assert "\n" not in message
    for needle in needles:
        assert needle in message, message
    return message


def tensor_info_at(data: bytes, name: str) -> int:
    """Where the tensor info of ``name`` starts, just after its name."""
    encoded = name.encode()
    return data.index(struct.pack("<Q", len(encoded)) + encoded) + 8 + len(encoded)


@pytest.fixture
def good_file(gguf_llama, tmp_path):
    """A private copy of the Q4_1 file and its bytes."""
    data = gguf_llama[1]["Q4_1"].read_bytes()
    return tmp_path / "model.gguf", data


def test_a_truncated_file_names_the_tensor_that_runs_past_its_end(good_file):
    path, data = good_file
    path.write_bytes(data[:len(data) - 100])
    with pytest.raises(CheckpointError) as caught:
        GGUFFile(path)
    one_line(caught.value, str(path), "truncated", "tensor 'blk.1.ffn_down.weight'")


def test_a_file_cut_in_its_metadata_names_the_key(good_file):
    path, data = good_file
    cut = data.index(b"tokenizer.ggml.tokens") + 40
    path.write_bytes(data[:cut])
    with pytest.raises(CheckpointError) as caught:
        GGUFFile(path)
    one_line(caught.value, str(path), "truncated", "metadata key 'tokenizer.ggml.tokens'")


def test_a_wrong_magic_is_not_a_gguf_file(good_file):
    path, data = good_file
    path.write_bytes(b"GGML" + data[4:])
    with pytest.raises(CheckpointError) as caught:
        GGUFFile(path)
    one_line(caught.value, str(path), "not a GGUF file")


@pytest.mark.parametrize("version, needle", [(1, "GGUF version 1"), (2**24 * 3, "big-endian")])
def test_an_unknown_version_is_refused(good_file, version, needle):
    path, data = good_file
    path.write_bytes(data[:4] + struct.pack("<I", version) + data[8:])
    with pytest.raises(UnsupportedModelError) as caught:
        GGUFFile(path)
    one_line(caught.value, str(path), needle)


def test_an_impossible_count_is_corrupt(good_file):
    path, data = good_file
    path.write_bytes(data[:8] + struct.pack("<Q", 2**40) + data[16:])
    with pytest.raises(CheckpointError) as caught:
        GGUFFile(path)
    one_line(caught.value, str(path), "corrupt", "tensor entries")


@pytest.mark.parametrize("offset, needle", [(2**40, "runs past the end"), (3, "not a multiple of the alignment")])
def test_a_bad_tensor_offset_names_the_tensor(good_file, offset, needle):
    path, data = good_file
    at = tensor_info_at(data, "blk.0.attn_q.weight") + 4 + 2 * 8 + 4  # n_dims, two dims, type
    path.write_bytes(data[:at] + struct.pack("<Q", offset) + data[at + 8:])
    with pytest.raises(CheckpointError) as caught:
        GGUFFile(path)
    one_line(caught.value, str(path), "tensor 'blk.0.attn_q.weight'", needle)


def test_an_unknown_tensor_type_is_refused_by_name(good_file):
    path, data = good_file
    at = tensor_info_at(data, "blk.0.attn_v.weight") + 4 + 2 * 8
    path.write_bytes(data[:at] + struct.pack("<I", 99) + data[at + 4:])
    with pytest.raises(UnsupportedModelError) as caught:
        GGUFFile(path)
    one_line(caught.value, str(path), "tensor 'blk.0.attn_v.weight'", "ggml type 99")


def test_a_key_that_is_not_utf8_is_named(good_file):
    path, data = good_file
    at = data.index(b"general.architecture")
    path.write_bytes(data[:at] + b"\xff" + data[at + 1:])
    with pytest.raises(CheckpointError) as caught:
        GGUFFile(path)
    one_line(caught.value, str(path), "not UTF-8")
