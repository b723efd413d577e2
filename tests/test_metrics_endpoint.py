"""The metrics endpoint under idle and half-sent connections: a thread per connection up to a
cap, dropped after a timeout, so a port scanner or a slowloris client cannot pile up threads in
the dispatcher, and a real scrape is still answered."""

from __future__ import annotations

import socket
import threading
import time
import urllib.request

import pytest
from prometheus_client import CollectorRegistry, Counter

from dispatcher_server.metrics_endpoint import serve_metrics

HALF_SENT = b"GET /metrics HTTP/1.1\r\nX-a: b"  # no blank line: the request never ends


@pytest.fixture
def registry():
    r = CollectorRegistry()
    Counter("probe_scrapes", "A counter to find in the answer", registry=r).inc(3)
    return r


def _hold(port: int, count: int) -> list[socket.socket]:
    held = []
    for _ in range(count):
        s = socket.create_connection(("127.0.0.1", port), timeout=5)
        s.sendall(HALF_SENT)
        held.append(s)
    return held


def _closed_by_server(s: socket.socket) -> bool:
    """True once the server closed `s` (reading waits up to the socket's timeout)."""
    try:
        return s.recv(1) == b""
    except ConnectionResetError:  # closed with our unread request in its buffer
        return True
    except TimeoutError:
        return False


def _started_since(before: set) -> list[threading.Thread]:
    """Threads alive now that were not in `before` (threads of other tests may end meanwhile)."""
    return [t for t in threading.enumerate() if t not in before]


def _wait(predicate, timeout: float) -> bool:
    end = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > end:
            return False
        time.sleep(0.02)
    return True


def _scrape(port: int, **headers) -> tuple[int, str, str]:
    req = urllib.request.Request(f"http://127.0.0.1:{port}/metrics", headers=headers)
    with urllib.request.urlopen(req, timeout=5) as r:
        return r.status, r.headers["Content-Type"], r.read().decode()


def test_idle_connections_past_the_cap_are_closed_at_once_and_threads_stay_bounded(registry):
    """1000 half-sent requests were 1000 threads of the dispatcher (8 -> 1008), never reaped."""
    before = set(threading.enumerate())
    server = serve_metrics(registry, 0, "127.0.0.1", timeout_s=1.5, max_connections=4)
    held = []
    try:
        held = _hold(server.server_port, 40)
        time.sleep(0.3)
        assert len(_started_since(before)) <= 2 * 4 + 1  # handlers, their deadlines, accept loop
        for s in held:
            s.settimeout(0.1)
        refused = [s for s in held if _closed_by_server(s)]
        assert len(refused) >= 40 - 4  # closed at once, not queued as threads
        for s in held:
            s.settimeout(5)
        assert all(_closed_by_server(s) for s in held if s not in refused)  # after 1.5 s
        assert _wait(lambda: len(_started_since(before)) <= 1, 5), _started_since(before)
        status, _, body = _scrape(server.server_port)
        assert status == 200 and "probe_scrapes_total 3.0" in body
    finally:
        for s in held:
            s.close()
        server.close()


def test_a_scrape_is_answered_while_idle_connections_hold_slots_below_the_cap(registry):
    server = serve_metrics(registry, 0, "127.0.0.1", timeout_s=5, max_connections=4)
    held = _hold(server.server_port, 3)
    try:
        status, ctype, body = _scrape(server.server_port)
        assert status == 200 and ctype.startswith("text/plain")
        assert "probe_scrapes_total 3.0" in body
        # prometheus_client's content negotiation, as start_http_server served it
        _, ctype, body = _scrape(server.server_port, Accept="application/openmetrics-text")
        assert ctype.startswith("application/openmetrics-text") and body.endswith("# EOF\n")
    finally:
        for s in held:
            s.close()
        server.close()


def test_a_half_sent_request_is_dropped_after_the_timeout_without_a_traceback(registry, capfd):
    server = serve_metrics(registry, 0, "127.0.0.1", timeout_s=0.5, max_connections=4)
    try:
        (s,) = _hold(server.server_port, 1)
        start = time.monotonic()
        with s:
            assert _closed_by_server(s)
        assert 0.4 <= time.monotonic() - start < 4
        time.sleep(0.1)  # the handler thread's error path, if any, has written by now
    finally:
        server.close()
    assert capfd.readouterr().err == ""


def test_close_stops_the_endpoint_and_its_thread(registry):
    server = serve_metrics(registry, 0, "127.0.0.1", timeout_s=1, max_connections=2)
    port = server.server_port
    assert _scrape(port)[0] == 200
    server.close()
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", port), timeout=2).close()
    assert _wait(lambda: not any(t.name == "mmdispatch-metrics" for t in threading.enumerate()), 2)


def test_a_client_that_does_not_read_the_answer_does_not_keep_its_thread(capfd):
    """An answer of about 16 MB, more than the kernel buffers on loopback (4 MiB send buffer
    here), to a client with a small receive buffer that never reads: the write times out, the
    thread ends, and nothing is printed."""
    from prometheus_client import Gauge

    big = CollectorRegistry()
    gauge = Gauge("big", "Many series", ["key"], registry=big)
    for i in range(150000):
        gauge.labels(f"{i:08d}-" + "x" * 80).set(i)
    before = set(threading.enumerate())
    server = serve_metrics(big, 0, "127.0.0.1", timeout_s=0.5, max_connections=4)
    try:
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            s.connect(("127.0.0.1", server.server_port))
            s.sendall(b"GET /metrics HTTP/1.0\r\n\r\n")
            assert _wait(lambda: len(_started_since(before)) == 2, 5)  # serving it (about 1 s)
            assert _wait(lambda: len(_started_since(before)) <= 1, 10), _started_since(before)
    finally:
        server.close()
    assert capfd.readouterr().err == ""


def test_a_client_trickling_its_request_is_dropped_after_the_timeout_in_all(registry, capfd):
    """A byte every 0.3 s passes a 1 s timeout per read for good: each slowloris connection kept
    its slot, and 16 of them refused every scrape and the compose healthcheck. The whole
    exchange gets the timeout now."""
    server = serve_metrics(registry, 0, "127.0.0.1", timeout_s=1.0, max_connections=4)
    try:
        s = socket.create_connection(("127.0.0.1", server.server_port), timeout=5)
        with s:
            start, closed = time.monotonic(), False
            for byte in HALF_SENT * 4:
                try:
                    s.sendall(bytes([byte]))
                except OSError:  # reset: the server closed it
                    closed = True
                    break
                time.sleep(0.3)
                if time.monotonic() - start > 6:
                    break
            if not closed:
                s.settimeout(2)
                closed = _closed_by_server(s)
            assert closed and time.monotonic() - start < 6
        time.sleep(0.1)
    finally:
        server.close()
    assert capfd.readouterr().err == ""
