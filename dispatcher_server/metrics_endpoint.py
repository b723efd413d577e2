"""The HTTP endpoint that serves a Prometheus registry, bounded for a process that must stay up.

prometheus_client's `start_http_server` starts a thread per connection, with no cap and no
timeout, so every idle or half-sent connection (a port scanner, a load balancer's health
check, a slowloris client) would hold a thread of the dispatcher for good. This one serves the
same WSGI app (`make_wsgi_app`: content negotiation, gzip, `name[]`) with a socket timeout per
connection and a cap on connections served at once; one past the cap is closed at once, not
queued.
"""

from __future__ import annotations

import io
import socket
import sys
import threading
from socketserver import ThreadingMixIn
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer

from prometheus_client import CollectorRegistry, make_wsgi_app

#: Seconds a connection may take in all, to send its request and take the answer, before it is
#: dropped and its thread ends. A scrape of this registry takes milliseconds.
TIMEOUT_S = 10.0
#: Connections served at once; Prometheus and a health check need one or two each.
MAX_CONNECTIONS = 16
#: Connections the kernel holds before they are accepted: the accept loop never waits on a
#: handler, so this only absorbs a burst.
LISTEN_BACKLOG = 64


class _DroppedClientLog(io.StringIO):
    """wsgiref prints a traceback to the handler's stderr when the app's answer cannot be
    written. When the cause is the client (it timed out, reset, closed), that is routine and
    dropped; anything else is a bug of the app and goes to the real stderr, as before."""

    def flush(self) -> None:
        text = self.getvalue()
        self.seek(0)
        self.truncate()
        # wsgiref writes from inside its `except` block: the exception is the one being handled.
        if text and not isinstance(sys.exc_info()[1], OSError):
            sys.stderr.write(text)
            sys.stderr.flush()


class _Handler(WSGIRequestHandler):
    """One request per connection (HTTP/1.0, wsgiref's default), no access log."""

    def handle(self) -> None:
        try:
            super().handle()
        except OSError:  # the request did not arrive within the timeout, or the client left
            self.close_connection = True

    def get_stderr(self):
        return _DroppedClientLog()

    def log_message(self, format, *args) -> None:
        pass


def _cut(sock: socket.socket) -> None:
    """End a connection past its time: its handler's next read or write fails."""
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass  # already closed


class MetricsServer(ThreadingMixIn, WSGIServer):
    """A thread per connection, at most `max_connections` of them; each connection's socket
    times out after `timeout_s`. Threads are daemons, so a stuck one never holds up exit."""

    daemon_threads = True
    request_queue_size = LISTEN_BACKLOG

    def __init__(self, address: tuple, family: int, timeout_s: float, max_connections: int) -> None:
        if timeout_s <= 0 or max_connections < 1:
            raise ValueError(f"metrics endpoint needs timeout_s > 0 and max_connections >= 1, "
                             f"got {timeout_s} and {max_connections}")
        self.address_family = family  # read by TCPServer.__init__ to make the socket
        self.timeout_s = timeout_s
        self._slots = threading.BoundedSemaphore(max_connections)
        super().__init__(address, _Handler)

    def get_request(self):
        sock, address = super().get_request()
        sock.settimeout(self.timeout_s)  # covers reading the request and writing the answer
        return sock, address

    def process_request(self, request, client_address) -> None:
        if not self._slots.acquire(blocking=False):
            self.shutdown_request(request)  # closed at once: a queued thread would be the leak
            return
        try:
            super().process_request(request, client_address)
        except BaseException:  # no thread started: nobody else gives the slot back
            self._slots.release()
            self.shutdown_request(request)
            raise

    def process_request_thread(self, request, client_address) -> None:
        # The socket timeout bounds each read and write; a client trickling a byte at a time
        # would pass every one of them and keep its slot. The whole exchange gets `timeout_s`.
        deadline = threading.Timer(self.timeout_s, _cut, args=(request,))
        deadline.daemon = True
        deadline.start()
        try:
            super().process_request_thread(request, client_address)
        finally:
            deadline.cancel()
            self._slots.release()

    def handle_error(self, request, client_address) -> None:
        if not isinstance(sys.exc_info()[1], OSError):  # a client gone is routine; a bug is not
            super().handle_error(request, client_address)

    def close(self) -> None:
        """Stop accepting and close the listening socket. Connections being served end on
        their own within `timeout_s`."""
        self.shutdown()
        self.server_close()


def serve_metrics(registry: CollectorRegistry, port: int, host: str = "127.0.0.1", *,
                  timeout_s: float = TIMEOUT_S,
                  max_connections: int = MAX_CONNECTIONS) -> MetricsServer:
    """Serve `registry` over HTTP on `host:port` (port 0: any free port, see `server_port`)
    from a daemon thread; stop it with `close()`. Raises OSError when it cannot bind."""
    # The first address getaddrinfo gives picks IPv4 or IPv6, as start_http_server does.
    family, _, _, _, sockaddr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                   flags=socket.AI_PASSIVE)[0]
    server = MetricsServer((sockaddr[0], port), family, timeout_s, max_connections)
    server.set_app(make_wsgi_app(registry))
    threading.Thread(target=server.serve_forever, name="mmdispatch-metrics", daemon=True).start()
    return server
