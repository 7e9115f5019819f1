"""tinylm.files: an output file is replaced whole or left as it was."""

import json

import pytest

from tinylm.files import replaced_atomically, write_json_atomic, write_text_atomic


def test_a_failed_write_leaves_the_old_file_and_no_temporary_one(tmp_path):
    path = tmp_path / "report.json"
    write_json_atomic(path, {"loss": 1.5})
    with pytest.raises(OSError, match="disk full"):
        with replaced_atomically(path) as tmp:
            tmp.write_text('{"loss": ')  # half a report, then the writer dies
            raise OSError("disk full")
    assert json.loads(path.read_text()) == {"loss": 1.5}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report.json"]


def test_a_finished_write_replaces_the_file_and_makes_missing_directories(tmp_path):
    path = tmp_path / "new" / "dir" / "pronouns.md"
    write_text_atomic(path, "old\n")
    write_text_atomic(path, "'She' → Lily\n")
    assert path.read_text(encoding="utf-8") == "'She' → Lily\n"
    assert [p.name for p in path.parent.iterdir()] == ["pronouns.md"]
