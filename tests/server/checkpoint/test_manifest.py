"""manifest: the versioned JSON description of a checkpoint, parsed strictly."""

from __future__ import annotations

import json

import pytest

from replay_server.checkpoint.manifest import (
    FORMAT_VERSION,
    ColumnEntry,
    CorruptCheckpointError,
    FileEntry,
    Manifest,
    NewerFormatError,
    TableEntry,
    check_complete_marker,
    complete_marker,
)

SHA = "ab" * 32


def _manifest() -> Manifest:
    column = ColumnEntry("obs.pixels", "uint8", (2, 2), FileEntry("replay/column-0.bin", 40, SHA))
    table = TableEntry(
        name="replay", config={"capacity": 10, "sampler": "uniform"},
        schema={"obs.pixels": "uint8[2, 2]"}, rows=10, first_slot=3, columns=(column,),
        state_file=FileEntry("replay/state.bin", 128, SHA),
        state={"version": 1, "ring": {"next_id": 13, "first_live": 3}},
    )
    return Manifest(server_version="0.1.0", created="2026-11-21T21:28:00.123Z",
                    created_unix=1.5, sequence=7, tables=(table,))


def _doc() -> dict:
    return json.loads(_manifest().to_json())


def test_manifest_round_trips() -> None:
    manifest = _manifest()
    assert Manifest.from_json(manifest.to_json()) == manifest
    assert manifest.nbytes == 168


def test_manifest_records_format_version_server_version_and_files() -> None:
    doc = _doc()
    assert doc["format"] == "replay-server-checkpoint"
    assert doc["format_version"] == FORMAT_VERSION and doc["server_version"] == "0.1.0"
    [table] = doc["tables"]
    assert table["columns"][0]["file"] == {"name": "replay/column-0.bin", "bytes": 40,
                                           "sha256": SHA}


def _set(path: list, value):
    def edit(doc: dict) -> None:
        target = doc
        for key in path[:-1]:
            target = target[key]
        if value is KeyError:
            del target[path[-1]]
        else:
            target[path[-1]] = value
    return edit


@pytest.mark.parametrize(("edit", "fragment"), [
    (_set(["format"], "other"), "not a replay-server-checkpoint manifest"),
    (_set(["sequence"], KeyError), "'sequence' is missing or not an integer"),
    (_set(["sequence"], "7"), "'sequence' is missing or not an integer"),
    (_set(["sequence"], True), "'sequence' is missing or not an integer"),
    (_set(["byteorder"], "big"), "little-endian"),
    (_set(["tables"], {}), "'tables' is missing or not a list"),
    (_set(["tables", 0, "rows"], -1), "rows and first_slot must be >= 0"),
    (_set(["tables", 0, "state"], KeyError), "'state' is missing"),
    (_set(["tables", 0, "schema"], {"x": 3}), "schema is malformed"),
    (_set(["tables", 0, "columns", 0, "shape"], [-1]), "shape is malformed"),
    (_set(["tables", 0, "columns", 0, "file", "name"], "../../etc/passwd"), "is not allowed"),
    (_set(["tables", 0, "columns", 0, "file", "sha256"], "xyz"), "sha256 'xyz' is malformed"),
    (_set(["tables", 0, "state_file"], KeyError), "file entry is missing"),
    (lambda doc: doc["tables"].append(doc["tables"][0]), "listed twice"),
])
def test_malformed_manifest_is_corrupt_naming_the_field(edit, fragment) -> None:
    doc = _doc()
    edit(doc)
    with pytest.raises(CorruptCheckpointError) as info:
        Manifest.from_json(json.dumps(doc).encode())
    assert fragment in str(info.value)


def test_text_that_is_not_json_is_corrupt() -> None:
    with pytest.raises(CorruptCheckpointError, match="not valid JSON"):
        Manifest.from_json(b'{"format": "replay-server-checkpoint", ')


def test_a_newer_format_version_is_not_corruption() -> None:
    doc = _doc()
    doc["format_version"] = FORMAT_VERSION + 1
    with pytest.raises(NewerFormatError, match=f"format version {FORMAT_VERSION + 1}"):
        Manifest.from_json(json.dumps(doc).encode())


def test_complete_marker_vouches_for_exactly_its_manifest() -> None:
    data = _manifest().to_json()
    marker = complete_marker(data)
    assert marker.startswith(b"sha256 ") and marker.endswith(b"  manifest.json\n")
    check_complete_marker(marker, data)
    with pytest.raises(CorruptCheckpointError, match="does not match the sha256"):
        check_complete_marker(marker, data.replace(b'"sequence": 7', b'"sequence": 8'))
    with pytest.raises(CorruptCheckpointError, match="marker is malformed"):
        check_complete_marker(b"done\n", data)
