"""Our GGUF header reader against gguf.GGUFReader, and every broken header as one CarveError."""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader, GGUFWriter
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.gguf.reader import GGUFModel
from engine.gguf.writer import (
    ARR,
    BOOL,
    F32,
    F64,
    I8,
    I16,
    I32,
    I64,
    STR,
    U8,
    U16,
    U32,
    U64,
    encode_kv,
)
from spec.errors import CarveError
from spec.quant_types import QUANT, tensor_nbytes, type_id, type_name

# -- the type table ------------------------------------------------------------------------


def test_quant_table_equals_gguf_constants():
    theirs = {int(t): (t.name, *GGML_QUANT_SIZES[t]) for t in GGMLQuantizationType}
    ours = {tid: tuple(q) for tid, q in QUANT.items()}
    assert ours == theirs


def test_tensor_nbytes_and_names():
    assert tensor_nbytes(type_id("q4_k"), 4096 * 4096) == 4096 * 4096 // 256 * 144
    assert tensor_nbytes(type_id("Q8_0"), 64) == 68
    assert tensor_nbytes(type_id("bf16"), 3) == 6
    assert type_name(14) == "Q6_K" and type_name(99) == "type 99"
    with pytest.raises(CarveError, match="unknown ggml tensor type 99"):
        tensor_nbytes(99, 32)
    with pytest.raises(CarveError, match="Q4_K blocks of 256"):
        tensor_nbytes(12, 100)
    with pytest.raises(CarveError, match="unknown tensor type 'q9'"):
        type_id("q9")


# -- equality with gguf.GGUFReader -------------------------------------------------------------


def _flat(v):
    # GGUFReader.contents() flattens arrays of arrays into one list
    if isinstance(v, list) and v and isinstance(v[0], list):
        return [x for item in v for x in _flat(item)]
    return v


def assert_matches_reader(model: GGUFModel, data_every: int = 1) -> None:
    for shard, path in enumerate(model.paths):
        reader = GGUFReader(path)
        fields = {k: f for k, f in reader.fields.items() if not k.startswith("GGUF.")}
        if shard == 0:
            assert list(model.metadata) == list(fields)
            for key, f in fields.items():
                assert _flat(model.metadata[key]) == f.contents(), key
        ours = [t for t in model.tensors if t.shard == shard]
        assert [t.name for t in ours] == [t.name for t in reader.tensors]
        for t, r in zip(ours, reader.tensors, strict=True):
            assert t.shape == tuple(int(d) for d in r.shape), t.name
            assert t.ggml_type == int(r.tensor_type), t.name
            assert t.offset == r.data_offset, t.name
            assert t.nbytes == r.n_bytes, t.name
            data = model.tensor_data(t)
            assert data.dtype == np.uint8 and data.size == t.nbytes
            if t is ours[-1] or ours.index(t) % data_every == 0:
                assert data.tobytes() == np.asarray(r.data).view(np.uint8).tobytes(), t.name


@pytest.fixture(scope="module")
def writer_file(tmp_path_factory) -> Path:
    """Every metadata value type, nested arrays, a non-default alignment, several tensor types,
    written by gguf.GGUFWriter (not by us)."""
    path = tmp_path_factory.mktemp("w") / "all-types.gguf"
    w = GGUFWriter(path, "llama")
    w.add_custom_alignment(64)
    w.add_uint8("t.u8", 7)
    w.add_int8("t.i8", -3)
    w.add_uint16("t.u16", 600)
    w.add_int16("t.i16", -600)
    w.add_uint32("t.u32", 70000)
    w.add_int32("t.i32", -70000)
    w.add_float32("t.f32", 0.1)
    w.add_bool("t.bool", True)
    w.add_uint64("t.u64", 2**40)
    w.add_int64("t.i64", -(2**40))
    w.add_float64("t.f64", 0.1)
    w.add_string("t.str", "héllo ✓")
    w.add_array("t.arr_i", [1, 2, 3])
    w.add_array("t.arr_s", ["x", "yy", ""])
    w.add_array("t.arr_f", [0.5, 1.5])
    w.add_array("t.arr_b", [True, False, True])
    w.add_array("t.nested", [[1, 2], [3]])
    rng = np.random.default_rng(1)
    w.add_tensor("a", rng.normal(size=(3, 64)).astype(np.float32))
    w.add_tensor("b", rng.normal(size=(2, 5, 32)).astype(np.float16))
    q8 = rng.integers(0, 255, (4, 2 * 34), dtype=np.uint8)
    q8[:, 0:2] = np.frombuffer(np.float16(0.01).tobytes(), np.uint8)
    q8[:, 34:36] = np.frombuffer(np.float16(0.01).tobytes(), np.uint8)
    w.add_tensor("blk.0.q8", q8, raw_dtype=GGMLQuantizationType.Q8_0)
    w.add_tensor("blk.12.odd", np.arange(7, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_all_value_types_written_by_gguf_writer(writer_file):
    m = GGUFModel.open(writer_file)
    assert_matches_reader(m)
    md = m.metadata
    assert md["t.u8"] == 7 and md["t.i16"] == -600 and md["t.i64"] == -(2**40)
    assert md["t.bool"] is True and md["t.arr_b"] == [True, False, True]
    assert md["t.str"] == "héllo ✓" and md["t.arr_s"] == ["x", "yy", ""]
    assert md["t.nested"] == [[1, 2], [3]]  # structure kept, unlike GGUFReader.contents()
    assert m.alignment == 64 and all(t.offset % 64 == 0 for t in m.tensors)
    assert m.tensor("blk.12.odd").layer == 12 and m.tensor("a").layer is None
    assert m.tensor("b").shape == (32, 5, 2) and m.tensor("b").n_elements == 320
    assert m.arch == "llama" and m.file_size == writer_file.stat().st_size
    with pytest.raises(CarveError, match="no tensor named 'nope'"):
        m.tensor("nope")


def test_gguf_v2_reads_like_v3(writer_file, tmp_path):
    # v2 and v3 share one layout (v3 only added big-endian files)
    data = bytearray(writer_file.read_bytes())
    data[4:8] = struct.pack("<I", 2)
    p = tmp_path / "v2.gguf"
    p.write_bytes(data)
    assert GGUFModel.open(p).metadata == GGUFModel.open(writer_file).metadata


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "gemma3"])
def test_synthetic_models_match_reader(synth_model, arch):
    assert_matches_reader(GGUFModel.open(synth_model(arch)))


def test_split_set_opens_from_any_shard(synth_model):
    first = synth_model("qwen2", "q8_0", split=3)
    whole = GGUFModel.open(synth_model("qwen2", "q8_0"))
    for i in (1, 2, 3):
        shard = first.with_name(first.name.replace("00001-of", f"{i:05d}-of"))
        m = GGUFModel.open(shard)
        assert m.paths[0] == first and len(m.paths) == 3
        assert [t.name for t in m.tensors] == [t.name for t in whole.tensors]
        assert {t.shard for t in m.tensors} == {0, 1, 2}
        assert m.file_size == sum(p.stat().st_size for p in m.paths)
    assert m.metadata["split.count"] == 3 and m.metadata["split.no"] == 0
    assert_matches_reader(m)
    last = m.tensors[-1]
    assert last.shard == 2
    assert m.tensor_data(last).tobytes() == GGUFReader(m.paths[2]).tensors[-1].data.tobytes()


@pytest.mark.demo
@pytest.mark.slow  # GGUFReader itself takes 8-20 s on a 150k-token vocabulary
def test_demo_model_matches_reader(demo_model_path):
    m = GGUFModel.open(demo_model_path)
    assert m.arch == "qwen2" and len(m.tensors) == 291
    assert len(m.metadata["tokenizer.ggml.tokens"]) == 151936
    assert_matches_reader(m, data_every=10)  # every header field; the bytes of 30 tensors


# -- broken headers ---------------------------------------------------------------------------


def _tensor_info(name: str, dims, ggml_type: int, offset: int) -> bytes:
    b = name.encode()
    return struct.pack(f"<Q{len(b)}sI{len(dims)}QIQ", len(b), b, len(dims), *dims, ggml_type,
                       offset)


def _raw_kv(key: str, vtype: int, payload: bytes) -> bytes:
    return struct.pack("<Q", len(key)) + key.encode() + struct.pack("<I", vtype) + payload


def build(kvs=None, tensors=None, version=3, n_kv=None, n_tensors=None, data=b"",
          raw_kv=b"") -> bytes:
    kvs = [("general.architecture", STR, "llama")] if kvs is None else kvs
    tensors = [("w", (32, 2), 0, 0)] if tensors is None else tensors
    head = b"GGUF" + struct.pack("<IQQ", version, len(tensors) if n_tensors is None else n_tensors,
                                 len(kvs) if n_kv is None else n_kv)
    head += b"".join(encode_kv(*kv) for kv in kvs) + raw_kv
    head += b"".join(_tensor_info(*t) for t in tensors)
    head += b"\0" * (-len(head) % 32)
    return head + (data or b"\0" * 256)


ARCH = ("general.architecture", STR, "llama")
BROKEN = {
    "bad magic": (b"GGML" + build()[4:], "not a GGUF file"),
    "empty": (b"", "too small"),
    "text file": (b"hello, this is not a model at all\n" * 3, "not a GGUF file"),
    "version 1": (build(version=1), "version 1 is too old"),
    "version 9": (build(version=9), "unknown GGUF version 9"),
    "big endian": (build(version=3 << 24), "big-endian"),
    "truncated in metadata": (build()[:30], "truncated"),
    "truncated in tensor table": (build()[:70], "truncated"),
    "data beyond EOF": (build(data=b"\0" * 100), "beyond the end"),
    "absurd tensor count": (build(n_tensors=2**60), "claims 1152921504606846976 tensors"),
    "absurd kv count": (build(n_kv=2**62), "claims 4611686018427387904 metadata entries"),
    "absurd string length": (b"GGUF" + struct.pack("<IQQQ", 3, 0, 1, 2**50) + b"\0" * 64,
                             "string of 1125899906842624 bytes at byte 24 is absurd"),
    "absurd array length": (build([ARCH], n_kv=2, raw_kv=_raw_kv("x", ARR, struct.pack(
        "<IQ", U32, 2**40))), "array of 1099511627776 values"),
    "absurd length in a string array": (build([ARCH], n_kv=2, raw_kv=_raw_kv("x", ARR, struct.pack(
        "<IQQ1sQ", STR, 2, 1, b"a", 2**40))), "string of 1099511627776 bytes at byte"),
    "unknown value type": (build([ARCH], n_kv=2, raw_kv=_raw_kv("x", 77, b"\0" * 8)),
                           "unknown value type 77"),
    "unknown array type": (build([ARCH], n_kv=2, raw_kv=_raw_kv("x", ARR, struct.pack(
        "<IQ", 77, 1))), "array of unknown value type 77"),
    "deep nesting": (build([ARCH], n_kv=2, raw_kv=_raw_kv("x", ARR, struct.pack(
        "<IQ", ARR, 1) * 20)), "nests arrays"),
    "dims > 4": (build(tensors=[("w", (32, 1, 1, 1, 2), 0, 0)]), "5 dimensions"),
    "shape overflow": (build(tensors=[("w", (32, 2**40, 2**40), 0, 0)]), "overflows"),
    "unknown ggml type": (build(tensors=[("w", (32, 2), 99, 0)]), "unknown ggml type 99"),
    "rows not whole blocks": (build(tensors=[("w", (33, 2), 8, 0)]), "not whole Q8_0 blocks"),
    "unaligned offset": (build(tensors=[("w", (32, 2), 0, 0), ("v", (4,), 0, 8)]), "not aligned"),
    "duplicate tensor": (build(tensors=[("w", (32,), 0, 0), ("w", (32,), 0, 128)]),
                         "duplicate tensor name 'w'"),
    "duplicate key": (build([ARCH, ARCH]), "duplicate metadata key"),
    "bad alignment": (build([ARCH, ("general.alignment", U32, 24)]), "not a power of two"),
    "no architecture": (build([("general.name", STR, "x")]), "no general.architecture"),
    "split count without shard name": (build([ARCH, ("split.count", U16, 3)]),
                                       "does not say so"),
}


@pytest.mark.parametrize("case", list(BROKEN))
def test_broken_header_is_one_carve_error(case, tmp_path):
    data, expect = BROKEN[case]
    p = tmp_path / "broken.gguf"
    p.write_bytes(data)
    with pytest.raises(CarveError, match=expect) as err:
        GGUFModel.open(p)
    msg = str(err.value)
    assert str(p) in msg and "\n" not in msg


def test_valid_minimal_file_opens(tmp_path):
    # the table's base file is well-formed: each broken case differs from it in one way
    p = tmp_path / "ok.gguf"
    p.write_bytes(build([ARCH, ("x", ARR, (I32, [1, 2]))]))
    m = GGUFModel.open(p)
    assert m.metadata["x"] == [1, 2] and m.tensor("w").nbytes == 256


def test_missing_paths(tmp_path, synth_model):
    with pytest.raises(CarveError, match="no such file"):
        GGUFModel.open(tmp_path / "absent.gguf")
    with pytest.raises(CarveError, match="is a directory"):
        GGUFModel.open(tmp_path)
    first = synth_model("qwen2", "q8_0", split=3)
    lonely = tmp_path / first.name.replace("00001-of", "00002-of")
    lonely.write_bytes(first.with_name(lonely.name).read_bytes())
    with pytest.raises(CarveError, match="shard .*00001-of-00003.gguf of the split set is missing"):
        GGUFModel.open(lonely)


def test_shard_from_another_set(tmp_path, synth_model):
    a = synth_model("qwen2", "q8_0", split=3)
    for i in (1, 2, 3):
        src = a.with_name(a.name.replace("00001-of", f"{i:05d}-of"))
        (tmp_path / f"m-{i:05d}-of-00003.gguf").write_bytes(src.read_bytes())
    other = synth_model("llama", "q8_0", split=3)
    (tmp_path / "m-00002-of-00003.gguf").write_bytes(
        other.with_name(other.name.replace("00001-of", "00002-of")).read_bytes())
    with pytest.raises(CarveError, match="split.tensors.count"):
        GGUFModel.open(tmp_path / "m-00003-of-00003.gguf")


# -- random damage: CarveError or a good open, never another exception -------------------------

_SMALL = build([ARCH, ("tokenizer.ggml.tokens", ARR, (STR, ["a", "bb", "ccc"] * 20)),
                ("s.scores", ARR, (F32, [0.5] * 20)), ("s.nested", ARR, (ARR, [(U8, [1, 2])])),
                ("s.i8", I8, -1), ("s.i16", I16, 2), ("s.u64", U64, 5), ("s.i64", I64, -5),
                ("s.f64", F64, 1.5), ("s.b", BOOL, True), ("s.f", F32, 0.25)],
               tensors=[("blk.0.w", (32, 2), 8, 0), ("blk.0.n", (32,), 0, 96)],
               data=b"\1" * 256)


@pytest.fixture(scope="module")
def fuzz_path(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("fuzz") / "fuzz.gguf"


def _open_bytes(p: Path, data: bytes) -> None:
    p.write_bytes(data)
    try:
        GGUFModel.open(p)
    except CarveError as err:
        assert "\n" not in str(err) and str(p) in str(err)


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.integers(0, len(_SMALL) - 1))
def test_random_truncation(fuzz_path, cut):
    _open_bytes(fuzz_path, _SMALL[:cut])


@settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.lists(st.tuples(st.integers(0, 700), st.integers(0, 255)), min_size=1, max_size=6))
def test_random_corruption(fuzz_path, edits):
    data = bytearray(_SMALL)
    for pos, byte in edits:
        data[pos % len(data)] = byte
    _open_bytes(fuzz_path, bytes(data))
