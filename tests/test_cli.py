"""The ``dsec`` command as people use it, run for real against a real platform: options
anywhere before ``--``, help on every flag, ``--json``, exit statuses, one-line errors."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time

import pytest
from dsec_backend_fncall.backend import FncallBackend

import dsec_kernel as dsec
from dsec_kernel.cli import exitcodes
from dsec_kernel.cli.parser import parser
from dsec_kernel.contract import errors

REASON = FncallBackend.unavailable_reason()


@pytest.fixture(scope="module")
def platform(tmp_path_factory):
    from dsec_kernel.cluster import LocalCluster

    with LocalCluster(tmp_path_factory.mktemp("cli"),
                      {"DSEC_BACKEND_CONFIG__FNCALL__POOL_SIZE": "2"}) as cluster:  # fmt: skip
        cluster.start_nats()
        cluster.start_apiserver()
        cluster.start_edge("n1", ["fncall"])
        asyncio.run(cluster.ready())
        yield cluster


def dsec_cli(platform, *args: str, env: dict[str, str] | None = None):
    """``dsec ARGS`` as the platform's default tenant (``env``: settings that override)."""
    full = {**os.environ, "COLUMNS": "200"}
    if platform is not None:
        full |= {"DSEC_URL": platform.conn.url, "DSEC_TOKEN": platform.conn.token}
    return subprocess.run([sys.executable, "-m", "dsec_kernel.cli", *args], env=full | (env or {}),
                          capture_output=True, text=True, timeout=120)  # fmt: skip


def test_every_command_and_flag_has_help():
    def walk(p: argparse.ArgumentParser, path: str) -> list[str]:
        missing = []
        for action in p._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    missing += walk(sub, f"{path} {name}")
            elif not action.help and action.dest != "help":
                missing.append(f"{path} {'/'.join(action.option_strings) or action.dest}")
        return missing

    assert walk(parser(), "dsec") == []
    shown = dsec_cli(None, "create", "--help").stdout
    assert "the backend to run them on (default: the cluster's)" in shown


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (["create", "--base", "bb"], "dsec: --base: expected NAME:VERSION, e.g. debian-python:12"),
        (["exec", "sb-1", "--timeout", "-1", "--", "true"], "dsec: --timeout: must be > 0"),
        (["create", "--count", "x"], "dsec: --count: expected a whole number, not 'x'"),
        (["nodes", "--", "ls"], "dsec: dsec nodes takes no command after `--`"),
        (["frobnicate"], "dsec: COMMAND: invalid choice: 'frobnicate'"),
    ],
)
def test_bad_input_is_one_line_naming_the_argument_as_typed(args, said):
    r = dsec_cli(None, *args)
    assert r.returncode == exitcodes.USAGE, r.stderr
    assert r.stderr.startswith(said) and r.stderr.count("\n") == 1, r.stderr


def test_sdk_arguments_are_named_as_the_caller_gave_them():
    """The SDK's ``timeout`` is ``timeout_s`` on the wire; its error says ``timeout``."""
    client = dsec.AsyncClient("nats://127.0.0.1:9", "dsec_x")  # refused before it connects
    with pytest.raises(errors.InvalidArgument) as caught:
        asyncio.run(client.fncall("print(1)", timeout=-1))
    assert caught.value.message == "timeout: must be > 0"


def test_schema_into_a_closed_pipe_ends_quietly():
    r = subprocess.run(f"{sys.executable} -m dsec_kernel.cli schema | head -1", shell=True,
                       capture_output=True, text=True, timeout=60)  # fmt: skip
    assert r.stdout == "{\n" and "Traceback" not in r.stderr and "BrokenPipe" not in r.stderr


def test_completion_scripts():
    for shell, marker in (("bash", "complete"), ("zsh", "#compdef dsec")):
        r = dsec_cli(None, "completion", shell)
        assert r.returncode == 0 and marker in r.stdout and "cluster-up" in r.stdout


def test_plugins_as_json_and_at_80_columns():
    rows = [json.loads(line) for line in dsec_cli(None, "plugins", "--json").stdout.splitlines()]
    assert {"backends", "fncall"} <= {rows[0]["group"].removeprefix("dsec."), *[
        r["name"] for r in rows]}  # fmt: skip
    narrow = subprocess.run([sys.executable, "-m", "dsec_kernel.cli", "plugins"],
                            env={**os.environ, "COLUMNS": "80"}, capture_output=True,
                            text=True, timeout=60)  # fmt: skip
    assert max(len(line) for line in narrow.stdout.splitlines()) <= 80


@pytest.mark.skipif(bool(REASON), reason=f"fncall cannot run here: {REASON}")
def test_options_before_the_command_and_exit_statuses(platform):
    (sid,) = dsec_cli(platform, "create", "--backend", "fncall").stdout.split()
    slow = dsec_cli(platform, "exec", sid, "--timeout", "1", "--", "sleep", "3")
    assert slow.returncode == exitcodes.TIMED_OUT and "timed out" in slow.stderr, slow.stderr
    killed = dsec_cli(platform, "exec", sid, "--", "sh", "-c", "kill -TERM $$")
    assert killed.returncode == 128 + 15, killed.stderr
    own = dsec_cli(platform, "exec", sid, "--", "sh", "-c", "exit 7")
    assert own.returncode == 7
    gone = dsec_cli(platform, "exec", "sb-0000000000000000", "--", "true")
    assert gone.returncode == errors.NotFound.exit_status and "[not_found]" in gone.stderr
    assert dsec_cli(platform, "destroy", sid).returncode == 0


@pytest.mark.skipif(bool(REASON), reason=f"fncall cannot run here: {REASON}")
def test_json_output_one_object_per_line(platform):
    made = dsec_cli(platform, "create", "--count", "2", "--backend", "fncall", "--json")
    sandboxes = [json.loads(line) for line in made.stdout.splitlines()]
    assert len(sandboxes) == 2 and all(s["id"].startswith("sb-") for s in sandboxes)
    sid = sandboxes[0]["id"]
    listed = [json.loads(line) for line in dsec_cli(platform, "ls", "--json").stdout.splitlines()]
    assert {s["id"] for s in sandboxes} <= {s["id"] for s in listed}
    nodes = [json.loads(line) for line in dsec_cli(platform, "nodes", "--json").stdout.splitlines()]
    assert [n["node"] for n in nodes] == ["n1"]
    ran = json.loads(dsec_cli(platform, "exec", sid, "--json", "--", "sh", "-c",
                              "echo hi; printf '\\377'").stdout)  # fmt: skip
    assert ran["stdout"] == {"base64": "aGkK/w=="} and ran["exit_code"] == 0
    ran = json.loads(dsec_cli(platform, "exec", sid, "--json", "--", "echo", "text").stdout)
    assert ran["stdout"] == "text\n"
    records = dsec_cli(platform, "trajectory", sid).stdout.splitlines()
    assert records and all(json.loads(r) for r in records)
    assert any('"stdout": "text\\n"' in r for r in records), records  # text as text
    fn = json.loads(dsec_cli(platform, "fncall", "print(6*7)", "--json").stdout)
    assert fn["stdout"] == "42\n"
    c = dsec.Client(platform.conn.url, platform.conn.token)
    c.destroy([s["id"] for s in sandboxes])
    c.close()


@pytest.mark.skipif(bool(REASON), reason=f"fncall cannot run here: {REASON}")
def test_a_trajectory_cannot_drive_the_readers_terminal(platform):
    """Output a sandbox wrote shows escaped: no ESC, C1 control or bidi override reaches the
    terminal of whoever reads the trajectory."""
    (sid,) = dsec_cli(platform, "create", "--backend", "fncall").stdout.split()
    hostile = "printf 'a\\033]0;owned\\007\\302\\2332J\\342\\200\\256b'"
    assert dsec_cli(platform, "exec", sid, "--", "sh", "-c", hostile).returncode == 0
    shown = dsec_cli(platform, "trajectory", sid).stdout
    assert "printf" in shown and not any(ch in shown for ch in "\x1b\x07\x9b\u202e"), shown
    assert "\\u001b]0;owned\\u0007\\u009b2J\\u202eb" in shown, shown
    assert dsec_cli(platform, "destroy", sid).returncode == 0


@pytest.mark.skipif(bool(REASON), reason=f"fncall cannot run here: {REASON}")
def test_create_says_fncall_sandboxes_keep_no_files(platform):
    """Where a newcomer meets fncall: ``dsec create`` says on stderr that its sandboxes keep
    no files between commands (not in --json output)."""
    note = "note: fncall sandboxes are stateless: files do not survive between commands"
    made = dsec_cli(platform, "create", "--backend", "fncall")
    assert made.returncode == 0 and note in made.stderr, made.stderr
    (sid,) = made.stdout.split()
    as_json = dsec_cli(platform, "create", "--json")  # fncall by default
    assert as_json.returncode == 0 and "note:" not in as_json.stderr, as_json.stderr
    assert dsec_cli(platform, "destroy", sid, json.loads(as_json.stdout)["id"]).returncode == 0


@pytest.mark.skipif(bool(REASON), reason=f"fncall cannot run here: {REASON}")
def test_batches_print_each_failure_and_exit_with_its_kind(platform):
    """pause, resume, destroy, exec and create of several sandboxes: the done ones as usual,
    each failed one on a line of its own (an object with its error in --json), the status
    of the first failure's kind."""
    ok, gone = dsec_cli(platform, "create", "--count", "2").stdout.split()
    assert dsec_cli(platform, "destroy", gone).stdout == "destroyed 1\n"
    paused = dsec_cli(platform, "pause", ok, gone)  # fncall cannot pause; the other is gone
    assert paused.returncode == errors.Unsupported.exit_status, paused.stderr
    lines = paused.stderr.splitlines()
    assert lines[0].startswith(f"dsec: {ok}: [unsupported] ") and len(lines) == 2, lines
    assert lines[1].startswith(f"dsec: {gone}: [not_found] "), lines
    resumed = dsec_cli(platform, "resume", ok, gone)  # (a sandbox not paused: nothing to do)
    assert resumed.returncode == errors.NotFound.exit_status, resumed.stderr
    assert resumed.stdout.startswith(f"{ok} ready in ") and resumed.stderr.startswith(
        f"dsec: {gone}: [not_found] "
    )
    rows = [
        json.loads(x) for x in dsec_cli(platform, "pause", ok, gone, "--json").stdout.splitlines()
    ]
    assert [(x["sandbox_id"], x["error"]["code"]) for x in rows] == [
        (ok, "unsupported"), (gone, "not_found")
    ]  # fmt: skip
    ran = dsec_cli(platform, "exec", gone, "--json", "--", "true")
    assert ran.returncode == errors.NotFound.exit_status
    assert json.loads(ran.stdout)["error"]["code"] == "not_found"
    rows = [
        json.loads(x) for x in dsec_cli(platform, "destroy", ok, gone, "--json").stdout.splitlines()
    ]
    assert [(x["sandbox_id"], x["found"], x["error"]) for x in rows] == [
        (ok, True, None), (gone, False, None)
    ]  # fmt: skip

    # past a quota of 2: two made, one line for the third, the quota's status
    nats = ("--nats-url", platform.nats.client_url, "--nats-login-file", platform.nats.login_file)
    token = dsec_cli(platform, "tenant", "create", "cli-quota", *map(str, nats)).stdout.strip()
    quota = dsec_cli(platform, "tenant", "quota", "cli-quota", "--sandboxes", "2", *map(str, nats))
    assert quota.returncode == 0, quota.stderr
    time.sleep(1)  # the apiserver's mirror of quotas
    as_tenant = {"DSEC_TOKEN": token}
    made = dsec_cli(platform, "create", "--count", "3", env=as_tenant)
    assert made.returncode == errors.QuotaExceeded.exit_status, made.stderr
    ids = made.stdout.split()
    assert len(ids) == 2 and "dsec: not created: [quota_exceeded] " in made.stderr, made.stderr
    full = dsec_cli(platform, "create", "--json", env=as_tenant)  # none can be made
    assert full.returncode == errors.QuotaExceeded.exit_status and full.stdout == ""
    assert dsec_cli(platform, "destroy", *ids, env=as_tenant).stdout == "destroyed 2\n"
    made = dsec_cli(platform, "create", "--count", "3", "--json", env=as_tenant)
    rows = [json.loads(x) for x in made.stdout.splitlines()]
    assert [("id" in x, x.get("error", {}).get("code")) for x in rows] == [
        (True, None), (True, None), (False, "quota_exceeded")
    ]  # fmt: skip
    assert dsec_cli(platform, "destroy", "--all", env=as_tenant).stdout == "destroyed 2\n"
