"""``kvevents schema`` without a registry: versions, fingerprints, compatibility."""

from __future__ import annotations

import copy
import json

import pytest
from kvevents.schemas import current_fingerprint

from kvevents.cli import main
from kvevents.schema_versions import SchemaVersion, compatibility, schema_versions


def test_show_lists_every_version_with_its_fingerprint(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["schema", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    names = [v["name"] for v in report["versions"]]
    assert names[0] == "v1" and names[-1] == "current"
    assert report["versions"][-1]["fingerprint"] == current_fingerprint().hex()
    assert report["versions"][0]["fingerprint"] == "edf02289072c3f09"  # v1, as the index core knows it
    assert report["full_transitive"] and len(report["compatibility"]) == len(names) * (len(names) - 1)


def test_print_gives_one_version_and_names_the_choices(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["schema", "print", "--version", "v1"]) == 0
    assert json.loads(capsys.readouterr().out)["name"] == "kvevents.EventBatch"
    assert main(["schema", "print", "--version", "v9"]) == 2
    assert "no version 'v9': v1, current" in capsys.readouterr().err


def test_an_incompatible_change_is_named() -> None:
    current = schema_versions()[-1]
    schema = json.loads(current.text)
    broken = copy.deepcopy(schema)
    broken["fields"].append({"name": "tenant", "type": "string"})  # no default: old data cannot fill it
    problems = compatibility(SchemaVersion("new", json.dumps(broken), "test"), current)
    assert problems and any("tenant" in p for p in problems)
    assert compatibility(current, SchemaVersion("new", json.dumps(broken), "test")) == []


def test_register_needs_a_registry(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("KVEVENTS_SCHEMA_REGISTRY_URL", raising=False)
    assert main(["schema", "register"]) == 2
    assert "needs --schema-registry-url" in capsys.readouterr().err
