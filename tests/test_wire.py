"""Wire messages: versioned types, one error shape, schemas checked in."""

import json
import re
from pathlib import Path

import pytest
from pydantic import ValidationError

import dsec_kernel
from dsec_kernel.cli import main
from dsec_kernel.contract import errors, wire
from dsec_kernel.contract.wire.sandbox import LAYER_REF_PATTERN, LayerRef

SCHEMAS = Path(dsec_kernel.__file__).parent / "contract" / "schemas"


def test_every_message_has_a_versioned_type():
    names = [wire.type_name(m) for m in wire.MESSAGES]
    assert len(set(names)) == len(names)
    for name in names:
        parts = name.split(".")
        assert parts[:2] == ["io", "dsec"] and parts[3] == "v1" and len(parts) == 5, name


def test_parse_picks_the_model_by_type():
    req = wire.ExecRequest(sandbox_ids=["sb-0123456789abcdef"], command=["true"], stdin=b"\0\1")
    back = wire.parse(req.model_dump_json())
    assert isinstance(back, wire.ExecRequest) and back.stdin == b"\0\1"
    err = wire.parse(wire.Error.of(errors.NotFound("gone")).model_dump_json())
    assert isinstance(err, wire.Error) and err.code == "not_found"


def test_unknown_fields_are_ignored_for_add_only_evolution():
    data = json.loads(wire.StatusRequest(id="sb-0123456789abcdef").model_dump_json())
    data["added_in_a_later_v1"] = {"x": 1}
    assert wire.parse(json.dumps(data)) == wire.StatusRequest(id="sb-0123456789abcdef")


def test_a_backend_declaring_a_capability_that_does_not_exist_is_refused():
    with pytest.raises(ValidationError, match="snapshots"):
        wire.Capabilities(snapshots=True)  # (snapshot is the capability)
    newer = {"name": "x", "capabilities": {"exec": False, "added_later": True}}
    assert wire.BackendInfo.model_validate(newer).capabilities == wire.Capabilities(exec=False)


@pytest.mark.parametrize(
    "bad",
    [
        dict(sandbox_ids=["sb-0123456789abcdef"], command="true", timeout_s=-1),
        dict(sandbox_ids=["sb-0123456789abcdef"], command="true", timeout_s=10**9),
        dict(sandbox_ids=["not-an-id"], command="true"),
        dict(sandbox_ids=[], command="true"),
        dict(sandbox_ids=["sb-0123456789abcdef"], command=[]),
        dict(sandbox_ids=["sb-0123456789abcdef"], command="a\0b"),
        dict(sandbox_ids=["sb-0123456789abcdef"], command="true", env={"A=B": "x"}),
        dict(sandbox_ids=["sb-0123456789abcdef"], command="true", max_output_bytes=1 << 40),
    ],
)
def test_bad_exec_requests_are_refused(bad):
    with pytest.raises(ValidationError):
        wire.ExecRequest(**bad)


def test_layer_references_are_structured_and_users_may_write_them_short():
    env = wire.Env(base="debian-python:12", workspace="attrs:23.2.0", toolkits=["pytest:8.3"])
    assert [(r.name, r.version, r.kind) for r in env.refs()] == [
        ("pytest", "8.3", "toolkit"), ("attrs", "23.2.0", "workspace"),
        ("debian-python", "12", "base"),
    ]  # fmt: skip
    sent = json.loads(env.model_dump_json())  # the wire carries the model, not the string
    assert sent["base"] == {"name": "debian-python", "version": "12", "kind": "base"}
    assert wire.Env.model_validate(sent) == env
    old = {"base": "debian-python:12", "toolkits": ["pytest:8.3"]}  # as records were written
    assert wire.Env.model_validate(old).toolkits == [env.toolkits[0]]
    given = LayerRef(name="attrs", version="23.2.0")  # no kind: its place in the env gives it
    assert wire.Env(base="debian-python:12", workspace=given).workspace == env.workspace
    staged = wire.PrestageRequest(layers=["busybox:1"]).layers
    assert staged == [LayerRef(name="busybox", version="1", kind=None)]  # a prestage: any kind
    assert str(env.base) == "debian-python:12" and env.base.listed_as("alice") == (
        "alice/debian-python:12"
    )


@pytest.mark.parametrize(
    "bad",
    [
        {"base": "debian-python"},  # no version
        {"base": "-x:1"},
        {"base": "a:1:2"},
        {"base": {"name": "a", "version": "1", "kind": "toolkit"}},  # a toolkit in base's place
        {"base": {"name": "a", "version": "1", "tenant": "alice"}},  # no owner in a reference
    ],
)
def test_bad_layer_references_are_refused(bad):
    with pytest.raises(ValidationError):
        wire.Env.model_validate(bad)


def test_the_layer_schema_takes_both_forms():
    ref = wire.CreateRequest.model_json_schema()["$defs"]["LayerRef"]
    assert {"type": "string", "pattern": LAYER_REF_PATTERN} in ref["anyOf"]
    assert any(s.get("properties", {}).keys() == {"name", "version", "kind"} for s in ref["anyOf"])


def test_every_error_code_has_its_exit_status_in_the_docs():
    """A code is one class (errors.py); the docs' table of exit statuses names each one."""
    rows = {}
    table = (Path(__file__).parents[1] / "docs" / "configuration.md").read_text()
    for status, codes in re.findall(r"^\| (\d+) \| (.+?) \|$", table, re.M):
        if int(status) < 100:  # (124 and 128+N are a command's)
            rows.update((code, int(status)) for code in re.findall(r"`(\w+)`", codes))
    assert rows == {c: k.exit_status for c, k in errors._BY_CODE.items()}
    assert set(errors.__all__) >= {k.__name__ for k in errors._BY_CODE.values()}


def test_error_codes_map_to_classes():
    for cls in (
        errors.NotFound,
        errors.CapacityExceeded,
        errors.UnknownBackend,
        errors.SandboxLost,
    ):
        e = cls("x")
        w = wire.Error.of(e)
        assert errors.error_class(w.code) is cls and w.retryable == e.retryable
    assert errors.CapacityExceeded("x").retryable and not errors.NotFound("x").retryable
    assert errors.error_class("code-from-the-future") is errors.Internal


def test_committed_schemas_match_the_models(tmp_path):
    assert main(["schema", "--out", str(tmp_path)]) == 0
    fresh = {p.name: p.read_text() for p in tmp_path.glob("*.json")}
    committed = {p.name: p.read_text() for p in SCHEMAS.glob("*.json")}
    assert fresh == committed, (
        "schemas changed: run `dsec schema --out dsec_kernel/contract/schemas`"
    )


def test_batch_results_are_cut_to_fit_one_message():
    results = [
        wire.ExecResult(stdout=b"a" * 100, stderr=b"b" * 10),
        wire.ExecResult(stdout=b"c" * 5),
        wire.ExecResult(stdout=b"d" * 60),
    ]
    assert wire.fit_results(results, 1000) is results
    cut = wire.fit_results(results, 100)
    assert sum(len(r.stdout) + len(r.stderr) for r in cut) <= 100
    assert [r.truncated for r in cut] == [True, False, True]
    assert cut[1].stdout == b"c" * 5 and cut[0].stderr == b"b" * 10
    assert cut[0].stdout == b"a" * len(cut[2].stdout)  # the longest share one length
