"""A stranger on a job's network, for the tests: a process that reaches node 0's master port
(and the workers' listeners) without the job's secret, run inside a network namespace of its
own (`python -m pdcli.testing.stranger CMD ...` under `ip netns exec`).

Commands, each printing one JSON line:
- `dump HOST PORT SUFFIX`: wait (at most 120 s) until a key ending in SUFFIX is in the store,
  then every key and value the store holds (`list_keys`), values base64.
- `set HOST PORT KEY VALUE_B64`: write KEY.
- `listen HOST SECONDS`: listen on HOST (port from the OS), print the port, then after SECONDS
  how many connections came.
- `hello HOST PORT`: connect and claim rank 0 without the proof; print the bytes the listener
  sent before it closed (`null` while it kept the connection open for 120 s).
"""

from __future__ import annotations

import base64
import json
import socket
import sys
import time
from datetime import timedelta

WAIT_S = 120.0


def _store(host: str, port: int):  # type: ignore[no-untyped-def]
    from torch.distributed import TCPStore

    return TCPStore(host, port, None, False, timedelta(seconds=WAIT_S), wait_for_workers=False)


def dump(host: str, port: int, suffix: str) -> dict[str, str]:
    store = _store(host, port)
    deadline_s = time.monotonic() + WAIT_S
    while not any(k.endswith(suffix) for k in store.list_keys()):
        if time.monotonic() > deadline_s:
            raise TimeoutError(f"no key ending in {suffix!r} within {WAIT_S:g} s")
        time.sleep(0.05)
    return {k: base64.b64encode(store.get(k)).decode() for k in store.list_keys()}


def listen(host: str, seconds: float) -> None:
    with socket.socket() as s:
        s.bind((host, 0))
        s.listen()
        print(json.dumps({"port": s.getsockname()[1]}), flush=True)
        s.settimeout(0.1)
        came = 0
        deadline_s = time.monotonic() + seconds
        while time.monotonic() < deadline_s:
            try:
                s.accept()[0].close()
                came += 1
            except socket.timeout:
                pass
        print(json.dumps({"connections": came}), flush=True)


def hello(host: str, port: int) -> str | None:
    from pdcli.runtime import handshake

    with socket.create_connection((host, port), timeout=WAIT_S) as s:
        s.sendall(handshake.HELLO.pack(0, b"\0" * 16, b"\0" * 32))  # claims rank 0, no proof
        print(json.dumps({"connected": True}), flush=True)
        got = b""
        try:
            while chunk := s.recv(4096):
                got += chunk
        except ConnectionResetError:
            pass
        except socket.timeout:
            return None
        return got.hex()


def main(argv: list[str]) -> None:
    cmd, host = argv[0], argv[1]
    if cmd == "dump":
        print(json.dumps(dump(host, int(argv[2]), argv[3])), flush=True)
    elif cmd == "set":
        _store(host, int(argv[2])).set(argv[3], base64.b64decode(argv[4]))
        print(json.dumps({"set": argv[3]}), flush=True)
    elif cmd == "listen":
        listen(host, float(argv[2]))
    elif cmd == "hello":
        print(json.dumps({"received": hello(host, int(argv[2]))}), flush=True)
    else:
        raise SystemExit(f"unknown command {cmd!r}")


if __name__ == "__main__":
    main(sys.argv[1:])
