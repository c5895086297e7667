"""kernels/cbuild.py keys a built library by its C source, the headers beside it and the flags: an edit to a
shared header (kernels/csrc/simd_exp.h) builds every library again instead of loading a stale one."""
from __future__ import annotations

from kernels import cbuild


def test_a_header_edit_changes_the_library_path(tmp_path, monkeypatch):
    monkeypatch.setattr(cbuild, "CSRC", tmp_path)
    (tmp_path / "k.c").write_text('#include "h.h"\nint f(void) { return H; }\n')
    (tmp_path / "h.h").write_text("#define H 1\n")
    before = cbuild.library_path("k")
    assert cbuild.library_path("k") == before
    (tmp_path / "h.h").write_text("#define H 2\n")
    assert cbuild.library_path("k") != before
