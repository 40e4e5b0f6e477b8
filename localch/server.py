"""A local ClickHouse for development, tests and CI.

Serves the ClickHouse HTTP interface over chDB (the ClickHouse engine running
in-process), because these machines can run neither Docker nor a ClickHouse
server binary. It speaks what the `clickhouse` Rust crate and curl use:

* POST/GET `/` with the query in the URL (`query=`), in the body, or in a
  multipart form (`query` and `param_*` fields); `param_*` in the URL too;
* `database`, `default_format`, and any other URL setting applied to that query
  alone (SET before, SET ... = DEFAULT after);
* INSERT data in the body, passed to chDB binary-safe (`send_insert`), plain or
  in ClickHouse's native LZ4 block framing (`decompress=1`); chunked bodies;
* `/ping`; errors as HTTP 500 with `Code: N. DB::Exception: ...` and the
  `X-ClickHouse-Exception-Code` header.

Without `--user` credentials are accepted and ignored: this is a dev engine
bound to loopback. With `--user NAME:PASSWORD[:readonly]` (repeatable) only
those users get in, by `X-ClickHouse-User`/`X-ClickHouse-Key`, HTTP Basic or
`user`/`password` in the URL, and others are refused with ClickHouse's own
AUTHENTICATION_FAILED (516, HTTP 403); a `readonly` user may only read, and
anything else gets ClickHouse's ACCESS_DENIED (497, HTTP 403) naming the grant.
chDB allows one process per data directory and one statement at a time per
connection; the process opens `--connections` of them (default 2) on its data
and runs that many statements at once, as a server runs its clients' queries
side by side (one at a time left every test waiting behind the others').

With `--zookeeper HOST:PORT` chDB runs with a server config naming that
ZooKeeper and `keeper_map_path_prefix` `/statehouse`, so KeeperMap tables work;
processes on one ZooKeeper share those tables' keys (and nothing else).
"""

from __future__ import annotations

import argparse
import base64
import binascii
import http.server
import os
import queue
import re
import signal
import socket
import socketserver
import ssl
import struct
import sys
import threading
import urllib.parse

import chdb
import lz4.block

# URL parameters that shape the HTTP exchange itself rather than the query.
TRANSPORT_PARAMS = {
    "query",
    "database",
    "default_format",
    "decompress",
    "compress",
    "query_id",
    "session_id",
    "session_timeout",
    "session_check",
    "user",
    "password",
    "quota_key",
    "buffer_size",
    "wait_end_of_query",
    "enable_http_compression",
    "http_zlib_compression_level",
    "send_progress_in_http_headers",
    "http_headers_progress_interval_ms",
    "role",
    "cancel_http_readonly_queries_on_client_close",
}

SETTING_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
INSERT_WITH_FORMAT = re.compile(r"^\s*(INSERT\s+INTO\s+.*?)\s+FORMAT\s+(\w+)\s*;?\s*$", re.I | re.S)
ERROR_CODE = re.compile(r"Code:\s*(\d+)")
NATIVE_BLOCK_HEADER = 16 + 9  # CityHash128 checksum, method byte, two u32 sizes
READ_STATEMENT = re.compile(r"^\s*(SELECT|WITH|SHOW|DESCRIBE|DESC|EXISTS|EXPLAIN|USE|SET)\b", re.I)
USE_STATEMENT = re.compile(r"^\s*USE\b", re.I)
NAME = r"((?:`[^`]*`|\w+)(?:\.(?:`[^`]*`|\w+))?)"
# What ClickHouse names in ACCESS_DENIED for the statements a read-only user may not run.
GRANTS = [
    (re.compile(r"^\s*CREATE\s+DATABASE\s+(?:IF\s+NOT\s+EXISTS\s+)?" + NAME, re.I), "CREATE DATABASE", True),
    (re.compile(r"^\s*CREATE\s+TABLE\s+(?:IF\s+NOT\s+EXISTS\s+)?" + NAME, re.I), "CREATE TABLE", False),
    (re.compile(r"^\s*INSERT\s+INTO\s+(?:TABLE\s+)?" + NAME, re.I), "INSERT", False),
    (re.compile(r"^\s*DELETE\s+FROM\s+" + NAME, re.I), "ALTER DELETE", False),
]


class ClickHouseError(Exception):
    """An error to report the way ClickHouse does."""

    def __init__(self, message: str, code: int = 0):
        super().__init__(message)
        self.code = code

    @classmethod
    def from_engine(cls, exc: Exception) -> "ClickHouseError":
        text = str(exc)
        found = ERROR_CODE.search(text)
        code = int(found.group(1)) if found else 1001
        if not text.startswith("Code:"):
            text = f"Code: {code}. DB::Exception: {text}"
        return cls(text, code)


class AccessError(ClickHouseError):
    """Refused credentials or a missing grant: HTTP 403, as ClickHouse answers them."""


def quote_literal(value: str) -> str:
    return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"


def decompress_native(body: bytes) -> bytes:
    """Undo ClickHouse's compressed-block framing (what `decompress=1` announces)."""
    out = []
    pos = 0
    while pos < len(body):
        if len(body) - pos < NATIVE_BLOCK_HEADER:
            raise ClickHouseError("Code: 432. DB::Exception: Truncated compressed block header", 432)
        method = body[pos + 16]
        compressed_size, plain_size = struct.unpack_from("<II", body, pos + 17)
        payload_start = pos + NATIVE_BLOCK_HEADER
        payload_end = pos + 16 + compressed_size
        if compressed_size < 9 or payload_end > len(body):
            raise ClickHouseError("Code: 432. DB::Exception: Truncated compressed block", 432)
        payload = body[payload_start:payload_end]
        if method == 0x82:
            out.append(lz4.block.decompress(payload, uncompressed_size=plain_size))
        elif method == 0x02:
            out.append(payload)
        else:
            raise ClickHouseError(
                f"Code: 89. DB::Exception: Unknown compression method 0x{method:02x}", 89
            )
        pos = payload_end
    return b"".join(out)


def parse_multipart(content_type: str, body: bytes) -> dict[str, str]:
    """The form fields of a multipart/form-data body (what the Rust crate sends with params)."""
    found = re.search(r'boundary="?([^";]+)"?', content_type)
    if not found:
        raise ClickHouseError("Code: 27. DB::Exception: multipart body without boundary", 27)
    delimiter = b"--" + found.group(1).encode()
    fields = {}
    for part in body.split(delimiter)[1:]:
        if part.startswith(b"--"):
            break
        part = part[2:] if part.startswith(b"\r\n") else part
        head, _, value = part.partition(b"\r\n\r\n")
        if value.endswith(b"\r\n"):
            value = value[:-2]
        name = re.search(rb'name="([^"]*)"', head)
        if name:
            fields[name.group(1).decode()] = value.decode()
    return fields


class User:
    def __init__(self, spec: str):
        parts = spec.split(":")
        if len(parts) not in (2, 3) or (len(parts) == 3 and parts[2] != "readonly"):
            raise argparse.ArgumentTypeError(f"expected NAME:PASSWORD[:readonly], got {spec!r}")
        self.name, self.password = parts[0], parts[1]
        self.readonly = len(parts) == 3


def denied_grant(sql: str, database: str) -> str | None:
    """The grant a read-only user lacks for `sql`, as ClickHouse words it; None if it only reads."""
    if READ_STATEMENT.match(sql):
        return None
    for pattern, privilege, whole_database in GRANTS:
        found = pattern.match(sql)
        if found:
            parts = [p.strip("`") for p in found.group(1).split(".")]
            if whole_database:
                return f"{privilege} ON {parts[0]}.*"
            table = parts if len(parts) == 2 else [database.strip("`") or "default", parts[0]]
            return f"{privilege} ON {table[0]}.{table[1]}"
    return f"{sql.split(None, 1)[0].upper()} ON *.*"


class Engine:
    """One chDB connection, used by one request at a time."""

    def __init__(self, path: str, config_file: str | None = None):
        self.conn = chdb.connect(f"file:{path}?config-file={config_file}" if config_file else f"file:{path}")
        # One thread a statement: the statements here are tiny, and splitting
        # each over the cores cost about a fifth more CPU than one thread
        # (docs/development.md), CPU that the tests beside the engine need.
        self.conn.query("SET max_threads = 1")
        self.lock = threading.Lock()
        # The URL settings the connection holds now, as the last request set
        # them. A server applies a request's settings at no cost; here each
        # is a statement of its own, so only the ones that differ from the
        # request before are set or reset (a client sends the same few on
        # every request).
        self.applied: dict[str, str] = {}
        # The database the connection is in: `USE` is a statement of its own
        # (about 1 ms), and consecutive requests mostly name the same one.
        self.database: str | None = None

    def execute(self, sql: str, params: dict, settings: dict, database: str, fmt: str, data: bytes | None) -> bytes:
        with self.lock:
            database = database or "default"
            if database != self.database:
                self._run(f"USE {database}")
                self.database = database
            self._apply(settings)
            insert = INSERT_WITH_FORMAT.match(sql) if data is not None else None
            if insert:
                return self._insert(insert.group(1), insert.group(2), data)
            if data:
                sql = sql + "\n" + data.decode("utf-8", errors="replace")
            if USE_STATEMENT.match(sql):
                # The client moves the connection itself: the next request's
                # database is set again, whatever it names.
                self.database = None
            return self._run(sql, fmt, params).bytes()

    def _apply(self, settings: dict) -> None:
        """Brings the connection's settings to `settings`: the ones the
        request before set and this one does not go back to their defaults."""
        for name in [name for name in self.applied if name not in settings]:
            try:
                self._run(f"SET {name} = DEFAULT")
            except ClickHouseError:
                continue
            del self.applied[name]
        for name, value in settings.items():
            if self.applied.get(name) != value:
                self._run(f"SET {name} = {quote_literal(value)}")
                self.applied[name] = value

    def _run(self, sql: str, fmt: str = "TabSeparated", params: dict | None = None):
        try:
            return self.conn.query(sql, fmt, params=params or {})
        except Exception as exc:  # chDB raises its own and RuntimeError
            raise ClickHouseError.from_engine(exc) from None

    def _insert(self, statement: str, fmt: str, data: bytes) -> bytes:
        try:
            inserter = self.conn.send_insert(statement, fmt)
            try:
                if data:
                    inserter.append(data)
                inserter.finish()
            except BaseException:
                inserter.cancel()
                raise
        except ClickHouseError:
            raise
        except Exception as exc:
            raise ClickHouseError.from_engine(exc) from None
        return b""


class Engines:
    """Connections to one data directory, each lent to one request at a time."""

    def __init__(self, path: str, config_file: str | None, count: int):
        self.idle: queue.SimpleQueue[Engine] = queue.SimpleQueue()
        for _ in range(count):
            self.idle.put(Engine(path, config_file))

    def execute(self, *args) -> bytes:
        engine = self.idle.get()
        try:
            return engine.execute(*args)
        finally:
            self.idle.put(engine)


class Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "statehouse-localch"
    engine: Engines
    verbose = False
    users: dict[str, User] | None = None

    def setup(self):
        super().setup()
        # Without this every reply waits ~40 ms on Nagle + delayed ACK.
        self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def log_message(self, format, *args):  # noqa: A002 - name fixed by the base class
        if self.verbose:
            sys.stderr.write("localch: " + (format % args) + "\n")

    def do_GET(self):
        self.handle_query(b"")

    def do_POST(self):
        self.handle_query(self.read_body())

    def read_body(self) -> bytes:
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            chunks = []
            while True:
                size = int(self.rfile.readline().split(b";")[0].strip(), 16)
                if size == 0:
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass
                    return b"".join(chunks)
                chunks.append(self.rfile.read(size))
                self.rfile.readline()
        length = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(length) if length else b""

    def handle_query(self, body: bytes):
        url = urllib.parse.urlsplit(self.path)
        if url.path == "/ping":
            return self.reply(200, b"Ok.\n", "text/plain; charset=UTF-8")
        if url.path not in ("/", ""):
            return self.fail(ClickHouseError(f"Code: 0. DB::Exception: There is no handle {url.path}", 0), 404)
        try:
            user = self.authenticate(url.query)
            output = self.run(url.query, body, user)
        except AccessError as exc:
            return self.fail(exc, 403)
        except ClickHouseError as exc:
            return self.fail(exc, 500)
        except Exception as exc:  # a bug here must still answer like ClickHouse would
            return self.fail(ClickHouseError(f"Code: 1001. DB::Exception: {exc!r}", 1001), 500)
        self.reply(200, output, "text/plain; charset=UTF-8")

    def authenticate(self, query_string: str) -> User | None:
        """The configured user these credentials name, as ClickHouse checks them; None without users."""
        if self.users is None:
            return None
        name = self.headers.get("X-ClickHouse-User")
        password = self.headers.get("X-ClickHouse-Key", "")
        basic = self.headers.get("Authorization", "")
        if name is None and basic.lower().startswith("basic "):
            try:
                name, _, password = base64.b64decode(basic[6:].strip()).decode().partition(":")
            except (binascii.Error, UnicodeDecodeError):
                name, password = "", ""
        if name is None:
            url_params = dict(urllib.parse.parse_qsl(query_string, keep_blank_values=True))
            name, password = url_params.get("user"), url_params.get("password", "")
        name = name or "default"
        user = self.users.get(name)
        if user is None or user.password != password:
            raise AccessError(
                f"Code: 516. DB::Exception: {name}: Authentication failed: password is incorrect, "
                "or there is no user with such name. (AUTHENTICATION_FAILED)",
                516,
            )
        return user

    def run(self, query_string: str, body: bytes, user: User | None) -> bytes:
        url_params = dict(urllib.parse.parse_qsl(query_string, keep_blank_values=True))
        content_type = self.headers.get("Content-Type", "")
        form = {}
        if content_type.startswith("multipart/form-data"):
            form = parse_multipart(content_type, body)
            body = b""
        elif url_params.get("decompress") == "1" and body:
            body = decompress_native(body)
        fields = {**url_params, **form}
        params = {k[len("param_"):]: v for k, v in fields.items() if k.startswith("param_")}
        settings = {k: v for k, v in url_params.items() if k not in TRANSPORT_PARAMS and not k.startswith("param_")}
        for name in settings:
            if not SETTING_NAME.match(name):
                raise ClickHouseError(f"Code: 115. DB::Exception: Unknown setting '{name}'", 115)
        database = fields.get("database") or self.headers.get("X-ClickHouse-Database", "")
        if database and not SETTING_NAME.match(database):
            database = "`" + database.replace("\\", "\\\\").replace("`", "\\`") + "`"
        fmt = fields.get("default_format") or self.headers.get("X-ClickHouse-Format") or "TabSeparated"
        if "query" in fields:
            sql, data = fields["query"], body
        else:
            sql, data = body.decode("utf-8", errors="replace"), None
        if not sql.strip():
            raise ClickHouseError("Code: 62. DB::Exception: Empty query", 62)
        grant = denied_grant(sql, database) if user is not None and user.readonly else None
        if grant is not None:
            raise AccessError(
                f"Code: 497. DB::Exception: {user.name}: Not enough privileges. To execute this query, "
                f"it's necessary to have the grant {grant}. (ACCESS_DENIED)",
                497,
            )
        return self.engine.execute(sql, params, settings, database, fmt, data)

    def fail(self, exc: ClickHouseError, status: int):
        text = str(exc).rstrip("\n") + "\n"
        self.reply(status, text.encode(), "text/plain; charset=UTF-8", {"X-ClickHouse-Exception-Code": str(exc.code)})

    def reply(self, status: int, body: bytes, content_type: str, extra: dict | None = None):
        head = [f"HTTP/1.1 {status} {self.responses.get(status, ('',))[0]}"]
        head.append(f"Content-Type: {content_type}")
        head.append(f"Content-Length: {len(body)}")
        head.append("X-ClickHouse-Server-Display-Name: statehouse-localch")
        for name, value in (extra or {}).items():
            head.append(f"{name}: {value}")
        if self.close_connection:
            head.append("Connection: close")
        # One write: headers and body leave in the same segment.
        self.wfile.write(("\r\n".join(head) + "\r\n\r\n").encode() + body)


class Server(socketserver.ThreadingMixIn, http.server.HTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    # socketserver's default backlog of 5 overflows when a hundred lock
    # acquires open connections at once; a dropped SYN is retried only after
    # 1, 3, 7 ... s, which turns a burst into 503s and minute-long queries.
    request_queue_size = 1024


def write_keeper_config(data: str, zookeeper: str) -> str:
    """A chDB server config naming the ZooKeeper at `zookeeper` (HOST:PORT); its path."""
    host, _, port = zookeeper.rpartition(":")
    if not host or not port.isdigit():
        raise SystemExit(f"localch: --zookeeper wants HOST:PORT, got {zookeeper!r}")
    path = os.path.join(data, "keeper-config.xml")
    with open(path, "w") as config:
        config.write(
            "<clickhouse>\n"
            # Sessions and operations outlast a ZooKeeper starved of CPU
            # for seconds (see localch/zookeeper's tick).
            "  <zookeeper>\n"
            f"    <node><host>{host}</host><port>{port}</port></node>\n"
            "    <session_timeout_ms>30000</session_timeout_ms>\n"
            "    <operation_timeout_ms>30000</operation_timeout_ms>\n"
            "  </zookeeper>\n"
            "  <keeper_map_path_prefix>/statehouse</keeper_map_path_prefix>\n"
            "</clickhouse>\n"
        )
    return path


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8123)
    parser.add_argument("--data", default=os.path.join(os.getcwd(), ".localch-data"), help="data directory")
    parser.add_argument("--verbose", action="store_true", help="log every request")
    parser.add_argument("--tls-port", type=int, help="also serve HTTPS on this port")
    parser.add_argument("--tls-cert", help="PEM certificate (chain) for --tls-port")
    parser.add_argument("--tls-key", help="PEM private key for --tls-port")
    parser.add_argument(
        "--user",
        type=User,
        action="append",
        metavar="NAME:PASSWORD[:readonly]",
        help="only let these users in (repeatable); without it any credentials are accepted",
    )
    parser.add_argument("--zookeeper", metavar="HOST:PORT", help="run KeeperMap on this ZooKeeper")
    parser.add_argument(
        "--connections", type=int, default=2, help="statements run at once, a connection each (default 2)"
    )
    args = parser.parse_args()

    os.makedirs(args.data, exist_ok=True)
    config_file = write_keeper_config(args.data, args.zookeeper) if args.zookeeper else None
    Handler.engine = Engines(args.data, config_file, max(1, args.connections))
    Handler.verbose = args.verbose
    if args.user:
        Handler.users = {user.name: user for user in args.user}
    servers = [Server((args.host, args.port), Handler)]
    print(f"localch: ClickHouse HTTP interface on http://{args.host}:{servers[0].server_address[1]} (data {args.data})", flush=True)
    if args.tls_port is not None:
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(args.tls_cert, args.tls_key)
        tls = Server((args.host, args.tls_port), Handler)
        # The handshake happens on the first read, in the request's own thread.
        tls.socket = context.wrap_socket(tls.socket, server_side=True, do_handshake_on_connect=False)
        servers.append(tls)
        threading.Thread(target=tls.serve_forever, daemon=True).start()
        print(f"localch: and HTTPS on https://{args.host}:{tls.server_address[1]}", flush=True)

    def stop(*_):
        for server in servers:
            threading.Thread(target=server.shutdown).start()

    signal.signal(signal.SIGTERM, stop)
    try:
        servers[0].serve_forever()
    except KeyboardInterrupt:
        pass
    for server in servers:
        server.server_close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
