"""What a failed checkpoint write says about the disk (saccade.loops.checkpointer.room_left). The
whole path, a real full disk, is tests/loops/test_full_disk.py (long, root)."""

from __future__ import annotations

from saccade.loops.checkpointer import room_left


def test_torchs_short_write_is_named_as_a_full_disk_even_once_the_partial_save_is_gone(tmp_path):
    # torch.save on a full disk: "[enforce fail at inline_container.cc:672] . unexpected pos 4566464
    # vs 4566352" (seen in the long suite), and the failed save removes its folder before we ask.
    said = room_left(tmp_path, RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 4566464 vs 4566352"))
    assert said.startswith("; a write came up short, as on a full disk (") and "bytes free now" in said
    assert room_left(tmp_path) == "" and room_left(tmp_path, PermissionError("denied")) == ""


def test_torchs_stream_error_on_a_full_disk_is_named_so_too(tmp_path):
    # The same fill met inside a tensor's bytes (the long suite, 2026-12-06): the stream's own words.
    said = room_left(tmp_path, RuntimeError("basic_ios::clear: iostream error"))
    assert said.startswith("; a write came up short, as on a full disk (")
    assert room_left(tmp_path, RuntimeError("some other failure")) == ""
