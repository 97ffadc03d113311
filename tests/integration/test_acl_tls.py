"""Least privilege against a real redis-server: ACL users (events/redis_store/acl.py) and TLS.

A real run is trained under the controller user (so its ACL is shown to be enough);
the read-only commands then work under the reader user, and ``run`` under the reader
fails with one line before anything is written. A second server speaks TLS with a
certificate made here: ``rediss://`` works with the right CA, a wrong CA is one line.
"""

from __future__ import annotations

import datetime
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest
import redis

from cli.main import main
from events.redis_store.acl import acl_rules
from events.redis_store import RedisEventStore, events_key
from events.errors import StoreUnavailableError
from events.schema import GroupFailed
from tests.chaos.harness import TINY
from tests.conftest import _require_redis_server
from tests.foreground import popen_foreground
from tests.redis_server import RedisServer

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
RUN = "acl-run"


def cli(capsys, *argv: str) -> tuple[int, str, str]:
    try:
        code = main(list(argv))
    except SystemExit as exc:
        code = exc.code
    out, err = capsys.readouterr()
    return int(code or 0), out, err


@pytest.fixture(scope="module")
def acl_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    binary = _require_redis_server()
    with RedisServer(tmp_path_factory.mktemp("redis-acl"), binary=binary) as srv:
        for user, role in (("rlc-controller", "controller"), ("rlc-reader", "reader")):
            reply = srv.command("ACL", "SETUSER", user, "on", f">{user}-pw", *acl_rules(role))
            assert reply == b"+OK", reply
        # the reader's commands, but no key at all (an ACL written without ~rlc:*)
        rules = [r for r in acl_rules("reader") if not r.startswith("~")]
        reply = srv.command("ACL", "SETUSER", "no-keys", "on", ">no-keys-pw", *rules)
        assert reply == b"+OK", reply
        yield srv


def url_for(server: RedisServer, user: str) -> str:
    return f"redis://{user}:{user}-pw@127.0.0.1:{server.port}/0"


@pytest.fixture(scope="module")
def trained(acl_server: RedisServer, tmp_path_factory) -> str:
    """A finished run, written by the controller user only."""
    proc = subprocess.run(
        [sys.executable, "-m", "cli.main", "run", "--run-id", RUN, "--steps", "2",
         "--redis-url", url_for(acl_server, "rlc-controller"),
         "--data-dir", str(tmp_path_factory.mktemp("data")), *TINY,
         "--set", "controller.snapshot_every_events=20"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return url_for(acl_server, "rlc-reader")


def test_the_roles_are_what_the_docs_say(acl_server) -> None:
    reader = redis.Redis.from_url(url_for(acl_server, "rlc-reader"))
    with pytest.raises(redis.exceptions.NoPermissionError):
        reader.xadd(events_key("x"), {"data": "{}"})
    with pytest.raises(redis.exceptions.NoPermissionError):
        reader.get("not-ours")  # outside rlc:*
    with pytest.raises(redis.exceptions.NoPermissionError):
        reader.execute_command("EVAL", "return 1", 0)
    controller = redis.Redis.from_url(url_for(acl_server, "rlc-controller"))
    with pytest.raises(redis.exceptions.NoPermissionError):
        controller.execute_command("FLUSHALL")
    with pytest.raises(redis.exceptions.NoPermissionError):
        controller.delete(events_key("x"))  # the store never deletes: nor may its user
    with pytest.raises(redis.exceptions.NoPermissionError):
        controller.execute_command("XTRIM", events_key("x"), "MAXLEN", 0)
    reader.close()
    controller.close()


def test_read_only_commands_work_under_the_reader(capsys, trained) -> None:
    code, out, err = cli(capsys, "runs", "--redis-url", trained, "--json")
    assert code == 0, err
    [row] = json.loads(out)
    assert row["run_id"] == RUN and row["finished"] is True
    for argv in (["replay"], ["staleness"], ["audit", "--json"]):
        code, out, err = cli(capsys, argv[0], "--redis-url", trained, "--run", RUN, *argv[1:])
        assert code == 0, (argv, err)
    assert json.loads(out)["chain"]["status"] == "ok"


def test_tail_follow_under_the_reader_sees_new_events(acl_server, trained) -> None:
    # ``tail --follow`` ends at RunFinished, so follow a copy of the trained run that
    # stops just before it: the live end of a run that is still going.
    live = "acl-live"
    writer = RedisEventStore(url_for(acl_server, "rlc-controller"))
    events = [s.event for s in writer.read(RUN)]
    assert type(events[-1]).__name__ == "RunFinished"
    epoch = writer.claim_epoch(live)
    writer.append(live, [msgspec.structs.replace(e, epoch=epoch) for e in events[:-1]],
                  expected_position=0, epoch=epoch)
    last = writer.last_position(live)
    follower = popen_foreground(
        [sys.executable, "-m", "cli.main", "tail", "--redis-url", trained, "--run", live,
         "--follow", "--json"],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        assert follower.stdout is not None
        lines = [json.loads(follower.stdout.readline()) for _ in range(last)]
        assert lines[-1]["position"] == last
        event = GroupFailed(event_id="late", epoch=epoch, ts=time.time(), group_id="g-late",
                            attempt=0, reason="lost")
        writer.append(live, [event], expected_position=last, epoch=epoch)
        # XREAD BLOCK under the reader wakes up for the new entry
        assert json.loads(follower.stdout.readline())["position"] == last + 1
    finally:
        writer.close()
        follower.send_signal(signal.SIGINT)
        _, err = follower.communicate(timeout=30)
    assert "NOPERM" not in err and "Traceback" not in err


def test_run_under_the_reader_fails_in_one_line_and_writes_nothing(capsys, acl_server, trained):
    admin = redis.Redis(port=acl_server.port)
    before = {k: admin.dump(k) for k in admin.keys("*")}
    code, _, err = cli(capsys, "run", "--redis-url", trained, "--run-id", "by-reader",
                       "--steps", "1", *TINY)
    assert code == 2
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert "refused a command" in err and "controller user" in err
    assert {k: admin.dump(k) for k in admin.keys("*")} == before
    admin.close()


READER_NEEDS = "needs a user that may read the rlc:* keys (the reader or the controller user"


@pytest.mark.parametrize(("user", "argv", "needs"), [
    ("no-keys", ["runs"], f"'runs' {READER_NEEDS}"),
    ("no-keys", ["tail", "--run", RUN], f"'tail' {READER_NEEDS}"),
    ("no-keys", ["audit", "--run", RUN], f"'audit' {READER_NEEDS}"),
    ("no-keys", ["replay", "--run", RUN], f"'replay' {READER_NEEDS}"),
    ("no-keys", ["run", "--run-id", "by-no-keys", "--steps", "1", *TINY],
     "'run' needs the controller user"),
    ("rlc-reader", ["delete", "--run", RUN, "--yes"],
     "'delete' needs a user that may delete the rlc:* keys (neither role may: an admin"),
], ids=["runs", "tail", "audit", "replay", "run", "delete"])
def test_a_refused_command_names_what_that_command_needs(capsys, acl_server, trained,
                                                         user, argv, needs) -> None:
    # every refusal said "'run' needs the controller user", also to a reader's command
    # run by a user that may read no key, and to 'delete' under the reader
    code, _, err = cli(capsys, *argv, "--redis-url", url_for(acl_server, user))
    assert code == 2, err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    assert "refused a command" in err and needs in err, err
    assert "'run' needs" not in err or argv[0] == "run", err


# -- TLS ------------------------------------------------------------------------------


def make_certs(directory: Path) -> dict[str, Path]:
    """A CA, a server certificate for 127.0.0.1 signed by it, and an unrelated CA."""
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.timezone.utc)

    def cert(subject: str, key, issuer: str, issuer_key, *, ca: bool):
        builder = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
            .issuer_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, issuer)]))
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
        )
        if not ca:
            builder = builder.add_extension(
                x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                critical=False,
            )
        return builder.sign(issuer_key, hashes.SHA256())

    def write(name: str, obj) -> Path:
        path = directory / name
        if isinstance(obj, x509.Certificate):
            path.write_bytes(obj.public_bytes(serialization.Encoding.PEM))
        else:
            path.write_bytes(obj.private_bytes(
                serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                serialization.NoEncryption()))
        return path

    ca_key, other_key, server_key = (ec.generate_private_key(ec.SECP256R1()) for _ in range(3))
    return {
        "ca": write("ca.pem", cert("rlc test CA", ca_key, "rlc test CA", ca_key, ca=True)),
        "other_ca": write("other.pem", cert("other CA", other_key, "other CA", other_key, ca=True)),
        "cert": write("server.pem", cert("127.0.0.1", server_key, "rlc test CA", ca_key, ca=False)),
        "key": write("server.key", server_key),
    }


@pytest.fixture(scope="module")
def tls_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[RedisServer, dict]]:
    binary = _require_redis_server()
    out = subprocess.run([binary, "--version"], capture_output=True, text=True).stdout
    directory = tmp_path_factory.mktemp("redis-tls")
    certs = make_certs(directory)
    from events.embedded import free_port

    tls_port = free_port()
    srv = RedisServer(directory, binary=binary, extra_config=(
        f"tls-port {tls_port}", f"tls-cert-file {certs['cert']}",
        f"tls-key-file {certs['key']}", f"tls-ca-cert-file {certs['ca']}",
        "tls-auth-clients no",
    ))
    try:
        srv.start()
    except RuntimeError:
        log = (directory / "redis.log").read_text() if (directory / "redis.log").exists() else ""
        pytest.fail(f"redis-server ({out.strip()}) did not start with TLS: {log[-500:]}")
    try:
        yield srv, {**certs, "port": tls_port}
    finally:
        srv.stop()


def tls_url(info: dict, ca: Path) -> str:
    return f"rediss://127.0.0.1:{info['port']}/0?ssl_ca_certs={ca}"


def test_rediss_url_works_with_the_right_ca(capsys, tls_server) -> None:
    _, info = tls_server
    store = RedisEventStore(tls_url(info, info["ca"]))
    epoch = store.claim_epoch("tls-run")
    event = GroupFailed(event_id="e1", epoch=epoch, ts=1.0, group_id="g1", attempt=0,
                        reason="lost")
    assert store.append("tls-run", [event], expected_position=0, epoch=epoch) == [1]
    assert store.read("tls-run")[0].event == event
    store.close()
    code, out, err = cli(capsys, "runs", "--redis-url", tls_url(info, info["ca"]), "--json")
    assert code == 0, err
    assert [r["run_id"] for r in json.loads(out)] == ["tls-run"]


def test_a_wrong_ca_is_one_clear_line(capsys, tls_server) -> None:
    _, info = tls_server
    code, _, err = cli(capsys, "runs", "--redis-url", tls_url(info, info["other_ca"]))
    assert code == 2
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert "TLS certificate verification failed" in err
    assert os.fspath(info["other_ca"]) not in err or "ssl_ca_certs" in err


def test_rediss_to_a_plain_port_fails_on_the_connect_timeout_naming_the_cause(tls_server):
    # A plain Redis port reads the TLS ClientHello as the start of an inline command and
    # never answers, so the handshake waited for the command timeout (30 s in the CLI)
    # before its line; it is now bounded by the connect timeout and says so.
    srv, info = tls_server
    url = f"rediss://127.0.0.1:{srv.port}/0?ssl_ca_certs={info['ca']}"
    with pytest.raises(StoreUnavailableError) as err:
        RedisEventStore(url, connect_timeout_s=0.5, command_timeout_s=10.0)
    assert str(err.value) == (
        f"Redis at rediss://127.0.0.1:{srv.port}/0?ssl_ca_certs={info['ca']} is unavailable: "
        "no TLS handshake within 0.5 s (the connect timeout): is this a plain Redis port? "
        "Then the URL is redis://"), str(err.value)
