"""--dask addresses: malformed ones fail before anything starts; a scheduler that cannot
be reached, never answers or is not Dask fails within the stated timeout; one line each,
exit 2, nothing left on disk."""

from __future__ import annotations

import builtins
import socket
import threading
import time

import pytest

from broken import document, to_toml
from kvsim.cli import main
from kvsim.engine import distributed
from kvsim.api import run as api_run


@pytest.fixture
def path(tmp_path):
    p = tmp_path / "s.toml"
    p.write_text(to_toml(document("field", {"policies": {"window": {}},
                                            "experiment.figures": []})))
    return p


def refused(path, tmp_path, capsys, address) -> str:
    started = time.time()
    assert main([str(path), "--out", str(tmp_path / "r"), "--quiet", "--dask", address]) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and err.startswith("kvsim: --dask")
    assert list(tmp_path.iterdir()) == [path]  # no report, lock or units folder
    return err.strip(), time.time() - started


@pytest.mark.parametrize("address", ["tcp://", "local:0", "local:-1", "local:abc", "local:",
                                     "local:100000", "local:99999999999999999999", "tcp://h:0",
                                     "tcp://h:65536", "tcp://h:port", "nonsense", "", "h",
                                     "udp://h:8786", "tcp://h:8786/x"])
def test_malformed_addresses_fail_before_anything_starts(path, tmp_path, capsys, monkeypatch,
                                                         address):
    monkeypatch.setattr(api_run, "connect", lambda a: pytest.fail("connect was called"))
    err, took = refused(path, tmp_path, capsys, address)
    assert "expected" in err and repr(address) in err and took < 5


def test_worker_counts_are_bounded_by_the_machine(monkeypatch):
    monkeypatch.setattr(distributed.os, "cpu_count", lambda: 2)
    assert distributed.check_address("local:8") == "local:8"
    with pytest.raises(distributed.KvsimError, match="at most 8 on this machine"):
        distributed.check_address("local:9")
    for good in ("tcp://127.0.0.1:8786", "127.0.0.1:8786", "tls://sched.example:1",
                 "tcp://[::1]:8786"):
        assert distributed.check_address(good) == good


def _server(reply: bytes | None) -> int:
    """A local port that accepts and then sends ``reply`` (None: never answers)."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    held = []

    def serve():
        while True:
            conn, _ = server.accept()
            if reply is None:
                held.append(conn)  # open, silent
            else:
                conn.sendall(reply)
                conn.close()
    threading.Thread(target=serve, daemon=True).start()
    return server.getsockname()[1]


@pytest.mark.parametrize("reply, message", [
    (None, "expected a reachable Dask scheduler, got no answer within 1 s"),
    (b"HTTP/1.1 400 Bad Request\r\nContent-Length: 5\r\n\r\nhello",
     "expected a Dask scheduler, got a server that is not one"),
    (b"\x00" * 64, "expected a Dask scheduler, got a server that is not one")])
def test_servers_that_are_not_usable_schedulers_fail_within_the_timeout(
        path, tmp_path, capsys, monkeypatch, reply, message):
    monkeypatch.setattr(distributed, "CONNECT_TIMEOUT", 1.0)
    address = f"tcp://127.0.0.1:{_server(reply)}"
    err, took = refused(path, tmp_path, capsys, address)
    assert err == f"kvsim: --dask {address}: {message}" and took < 1.0 + 10


def test_a_closed_port_fails_within_the_timeout(path, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(distributed, "CONNECT_TIMEOUT", 5.0)
    err, took = refused(path, tmp_path, capsys, "tcp://127.0.0.1:9")
    # refused at once; on a loaded machine the refusal may come after the timeout's check
    assert err.startswith("kvsim: --dask tcp://127.0.0.1:9: expected a reachable Dask "
                          "scheduler") and "\n" not in err and took < 5.0 + 10


def test_a_missing_distributed_extra_is_named(path, tmp_path, capsys, monkeypatch):
    real = builtins.__import__

    def no_dask(name, *args, **kwargs):
        if name.startswith("dask.distributed") or name.startswith("distributed"):
            raise ImportError(name)
        return real(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_dask)
    err, _ = refused(path, tmp_path, capsys, "local:1")
    assert err == ('kvsim: --dask: expected dask.distributed to be installed: the distributed '
                   'extra (pip install -e ".[distributed]")')
