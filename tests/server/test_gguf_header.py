"""The GGUF header reader (corral/server/models/gguf_header.py): the same values as the `gguf` package's full reader,
for every value type, without parsing what was not asked for; clear errors for files that are not GGUF."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from corral.server.models.gguf_header import GGUFHeaderError, read_fields


def _file(path: Path) -> Path:
    import gguf

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_uint32("t.u32", 7)
    writer.add_int32("t.i32", -7)
    writer.add_float32("t.f32", 1.5)
    writer.add_bool("t.bool", True)
    writer.add_uint64("t.u64", 2**40)
    writer.add_int8("t.i8", -3)
    writer.add_float64("t.f64", 0.25)
    writer.add_array("t.floats", [0.5, -1.0, 2.0])
    writer.add_token_list([f"tok{i} é" for i in range(1000)])  # strings skipped one by one
    writer.add_array("t.nested", [[1, 2], [3]])
    writer.add_string("t.after", "the last one")
    writer.add_tensor("token_embd.weight", np.zeros((8, 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_every_value_type_reads_as_the_gguf_package_reads_it(tmp_path: Path) -> None:
    from gguf import GGUFReader

    path = _file(tmp_path / "m.gguf")
    reader = GGUFReader(str(path))
    keys = ("general.architecture", "t.u32", "t.i32", "t.f32", "t.bool", "t.u64", "t.i8", "t.f64", "t.floats",
            "tokenizer.ggml.tokens", "t.after")
    ours = read_fields(path, (*keys, "t.nested"))
    assert {k: v for k, v in ours.items() if k != "t.nested"} == {key: reader.fields[key].contents() for key in keys}
    assert ours["t.nested"] == [[1, 2], [3]]  # kept nested (the package's contents() flattens it to [1, 2, 3])
    assert ours["general.architecture"] == "llama" and ours["tokenizer.ggml.tokens"][999] == "tok999 é"


def test_only_what_was_asked_is_returned(tmp_path: Path) -> None:
    path = _file(tmp_path / "m.gguf")
    assert read_fields(path, ("t.after", "no.such.key")) == {"t.after": "the last one"}
    assert read_fields(path, ()) == {}


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"not a gguf file at all" * 10, "magic"),
        (b"GGUF" + (9).to_bytes(4, "little") + bytes(40), "version 9"),
        (b"GGUF", "too short"),
    ],
)
def test_files_that_are_not_gguf_say_why(tmp_path: Path, content: bytes, message: str) -> None:
    path = tmp_path / "bad.gguf"
    path.write_bytes(content)
    with pytest.raises(GGUFHeaderError, match=message):
        read_fields(path, ("general.architecture",))


def test_a_truncated_header_is_an_error_not_a_crash(tmp_path: Path) -> None:
    whole = _file(tmp_path / "m.gguf").read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(whole[:2000])  # inside the token list
    with pytest.raises(GGUFHeaderError, match=r"ends early|past the end"):
        read_fields(cut, ("t.after",))
