"""lab/engine_l2_damage.py on real files: what each negative control does to an object.

``swap`` exchanges whole attention objects, which full attention cannot see when every
chunk is restored (the same key/value pairs, summed in another order; keys carry their
rotary position).  Three gate runs of 2026-12-06 showed it: the
``hybrid-swapped-resigned`` control passed, bit-identical, in two runs of three.
``swap-keys`` exchanges only the keys (the first half of LMCache's ``[2, layers, tokens,
hidden]`` object) and keeps each chunk's values, so keys and values no longer pair up.
"""

from __future__ import annotations

from pathlib import Path

from lab import engine_l2_damage as dmg


def _objects(tmp_path: Path) -> tuple[Path, Path, bytes, bytes]:
    a = tmp_path / "m@0x01000100@1@aaaa.data"
    b = tmp_path / "m@0x01000100@1@bbbb.data"
    da = bytes(range(0, 64)) * 2  # 128 bytes: keys 0..63, values 0..63
    db = bytes(range(64, 128)) * 2
    a.write_bytes(da)
    b.write_bytes(db)
    return a, b, da, db


def test_swap_keys_exchanges_the_key_half_and_keeps_the_values(tmp_path: Path) -> None:
    a, b, da, db = _objects(tmp_path)
    assert dmg.main(["swap-keys", str(tmp_path), "--group", "1"]) == 0
    assert a.read_bytes() == db[:64] + da[64:]
    assert b.read_bytes() == da[:64] + db[64:]


def test_swap_exchanges_whole_objects(tmp_path: Path) -> None:
    a, b, da, db = _objects(tmp_path)
    assert dmg.main(["swap", str(tmp_path), "--group", "1"]) == 0
    assert (a.read_bytes(), b.read_bytes()) == (db, da)


def test_a_group_with_no_object_is_refused(tmp_path: Path) -> None:
    _objects(tmp_path)
    assert dmg.main(["swap-keys", str(tmp_path), "--group", "0"]) == 1
