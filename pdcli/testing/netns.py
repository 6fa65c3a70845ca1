"""Two "hosts" on one machine: network namespaces joined by a veth pair, optionally shaped.

`HostPair` makes namespaces `<tag>n0`, `<tag>n1`, each holding one end of a veth pair with an
address of its own (10.<a>.<b>.1 and .2, a /30), and loopback up. `shape(rate_mbit)` puts a
token-bucket filter (`tc ... tbf`) on both ends, so each direction of the link carries at most
that rate; `tx_bytes()` reads what each end has sent (the veth's counters, every packet of every
protocol). Needs root and iproute2 (`available()` says why not).

`Lan(n)` makes `n` hosts on one segment instead: each namespace's veth end is plugged into a
bridge inside a switch namespace `<tag>sw`, addresses 10.<a>.<b>.1 ... .n in a /24, so every host
reaches every other (three hosts: a job's two and a stranger beside them).

Nothing is left behind: the namespaces go at `close()` (or the end of the `with` block), and a
reaper process started with them deletes them when this process dies without closing them,
SIGKILL included (it waits for its stdin, a pipe only this process holds, to close). A pair whose
owner is gone (a name carries the owner's pid) is swept when the next pair is made.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from typing import Sequence

from pdcli.runtime.watchdog import exists

PREFIX = "pdh"
"""Every namespace name starts with this, then the owner's pid: `pdh<pid>x<k>n0` (`...sw`: a `Lan`'s switch)."""
_ROLE = r"(n\d+|sw)"
IP_TIMEOUT_S = 20.0
TBF_LATENCY_MS = 50
"""How long a packet may wait in the token bucket's queue (sets its length) before it is dropped."""
MIN_BURST_BYTES = 2 * 1514
"""The bucket's depth at low rates: two full Ethernet frames, so a message pays its bytes / rate
on the wire as on a real link of that rate (a deep bucket lets a link that idles between
messages pass each at the veth's speed); higher rates take BURST_S of the rate, which the
timer needs to keep the rate up (1000 Mbit/s: 75 MB/s with two frames, 96 with 16 KB)."""
BURST_S = 0.0005
_SAMPLER = (
    "import sys, time\n"
    "dev, every_s = sys.argv[1], float(sys.argv[2])\n"
    "stats = f'/sys/class/net/{dev}/statistics/'\n"
    "while True:\n"
    "    t = time.time()\n"
    "    tx, rx = (int(open(stats + k).read()) for k in ('tx_bytes', 'rx_bytes'))\n"
    "    print(t, tx, rx, flush=True)\n"
    "    time.sleep(every_s)\n"
)
_REAPER = (
    "import subprocess, sys\n"
    "sys.stdin.read()\n"
    "for name in sys.argv[1:]:\n"
    "    subprocess.run(['ip', 'netns', 'del', name], capture_output=True, timeout=20)\n"
)


def available() -> str | None:
    """None when namespaces can be made here, else why not."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return "needs root to create network namespaces (ip netns)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"needs iproute2's `{tool}`"
    return None


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], check=check, timeout=IP_TIMEOUT_S, capture_output=True, text=True)


def sweep_orphans() -> list[str]:
    """Delete the namespaces of pairs whose owning process is gone; returns their names."""
    listed = _ip("netns", "list", check=False).stdout
    gone = []
    for name in re.findall(rf"^({PREFIX}(\d+)x\d+{_ROLE})\b", listed, flags=re.M):
        if not exists(int(name[1])):
            _ip("netns", "del", name[0], check=False)
            gone.append(name[0])
    return gone


def burst_bytes(rate_mbit: float) -> int:
    return max(MIN_BURST_BYTES, int(rate_mbit * 1e6 / 8 * BURST_S))


@dataclass(frozen=True)
class Host:
    ns: str
    """Network namespace name."""
    addr: str
    """Its end's IPv4 address."""
    dev: str
    """Its end of the veth pair."""

    def prefix(self) -> list[str]:
        """A command line's prefix that runs it inside this host."""
        return ["ip", "netns", "exec", self.ns]


class HostPair:
    """Two namespaces joined by a veth pair (see the module docstring)."""

    _count = 0

    def __init__(self) -> None:
        tag, net = _new_tag()
        self.hosts = tuple(Host(f"{tag}n{i}", f"{net}.{i + 1}", f"{tag}v{i}") for i in range(2))
        self.rate_mbit: float | None = None
        self._reaper = _reaper([h.ns for h in self.hosts])
        try:
            for h in self.hosts:
                _ip("netns", "add", h.ns)
            a, b = self.hosts
            _ip("link", "add", a.dev, "type", "veth", "peer", "name", b.dev)
            for h in self.hosts:
                _ip("link", "set", h.dev, "netns", h.ns)
                _ip("-n", h.ns, "addr", "add", f"{h.addr}/30", "dev", h.dev)
                _ip("-n", h.ns, "link", "set", h.dev, "up")
                _ip("-n", h.ns, "link", "set", "lo", "up")
        except BaseException:
            self.close()
            raise

    def __enter__(self) -> "HostPair":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def shape(self, rate_mbit: float | None) -> None:
        """Each end sends at most `rate_mbit` Mbit/s (a tbf qdisc); None: unshaped."""
        for h in self.hosts:
            if rate_mbit is None:
                subprocess.run(["tc", "-n", h.ns, "qdisc", "del", "dev", h.dev, "root"], capture_output=True,
                               timeout=IP_TIMEOUT_S)
            else:
                subprocess.run(["tc", "-n", h.ns, "qdisc", "replace", "dev", h.dev, "root", "tbf",
                                "rate", f"{rate_mbit:g}mbit", "burst", str(burst_bytes(rate_mbit)),
                                "latency", f"{TBF_LATENCY_MS}ms"], check=True, capture_output=True, timeout=IP_TIMEOUT_S)
        self.rate_mbit = rate_mbit

    def tx_bytes(self) -> tuple[int, int]:
        """Bytes each end has sent so far."""
        out = []
        for h in self.hosts:
            stats = json.loads(_ip("-n", h.ns, "-s", "-j", "link", "show", "dev", h.dev).stdout)
            out.append(int(stats[0]["stats64"]["tx"]["bytes"]))
        return out[0], out[1]

    def sample(self, every_s: float = 0.05) -> "Sampler":
        """Start sampling the link's counters every `every_s` (a reader of sysfs inside host 0)."""
        return Sampler(self.hosts[0], every_s)

    def close(self) -> None:
        _delete([h.ns for h in self.hosts], self._reaper)

    def names(self) -> Sequence[str]:
        return [h.ns for h in self.hosts]


class Lan:
    """`n` namespaces on one bridged segment (see the module docstring)."""

    def __init__(self, n: int) -> None:
        tag, net = _new_tag()
        self.hosts = tuple(Host(f"{tag}n{i}", f"{net}.{i + 1}", f"{tag}v{i}") for i in range(n))
        self.switch = f"{tag}sw"
        self._reaper = _reaper([*(h.ns for h in self.hosts), self.switch])
        try:
            _ip("netns", "add", self.switch)
            _ip("-n", self.switch, "link", "add", "lanbr", "type", "bridge")
            _ip("-n", self.switch, "link", "set", "lanbr", "up")
            for i, h in enumerate(self.hosts):
                port = f"{tag}p{i}"
                _ip("netns", "add", h.ns)
                _ip("link", "add", h.dev, "type", "veth", "peer", "name", port)
                _ip("link", "set", h.dev, "netns", h.ns)
                _ip("link", "set", port, "netns", self.switch)
                _ip("-n", self.switch, "link", "set", port, "master", "lanbr")
                _ip("-n", self.switch, "link", "set", port, "up")
                _ip("-n", h.ns, "addr", "add", f"{h.addr}/24", "dev", h.dev)
                _ip("-n", h.ns, "link", "set", h.dev, "up")
                _ip("-n", h.ns, "link", "set", "lo", "up")
        except BaseException:
            self.close()
            raise

    def __enter__(self) -> "Lan":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        _delete([*(h.ns for h in self.hosts), self.switch], self._reaper)


def _new_tag() -> tuple[str, str]:
    """(a fresh namespace name prefix owned by this process, the first three octets of its
    own subnet), after sweeping what dead owners left. Raises RuntimeError where namespaces
    cannot be made (`available`)."""
    why = available()
    if why is not None:
        raise RuntimeError(why)
    sweep_orphans()
    pid = os.getpid()
    HostPair._count += 1
    subnet = (pid * 7 + HostPair._count) % 16000
    return f"{PREFIX}{pid}x{HostPair._count}", f"10.{200 + subnet // 250 % 50}.{subnet % 250}"


def _reaper(names: Sequence[str]) -> subprocess.Popen[bytes]:
    """The process that deletes `names` when this one dies without doing so (its stdin closes)."""
    return subprocess.Popen([sys.executable, "-c", _REAPER, *names], stdin=subprocess.PIPE,
                            start_new_session=True)  # outside our process group: Ctrl-C spares it


def _delete(names: Sequence[str], reaper: subprocess.Popen[bytes]) -> None:
    for name in names:
        _ip("netns", "del", name, check=False)  # takes its ends of the veth pairs with it
    if reaper.stdin is not None and not reaper.stdin.closed:
        reaper.stdin.close()
    try:
        reaper.wait(timeout=IP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        reaper.kill()


class Sampler:
    """The bytes each direction of the link carried, sampled over time: (unix time, bytes host 0
    sent, bytes host 1 sent) from host 0's end (its rx is what host 1's end sent)."""

    def __init__(self, host: Host, every_s: float) -> None:
        # into a file, not a pipe: nobody reads a pipe until stop(), and a full one (64 KiB, about
        # 80 s of samples) would stall the sampler and leave the rest of a long run uncounted
        self._out = tempfile.TemporaryFile(mode="w+")
        self._proc = subprocess.Popen([*host.prefix(), sys.executable, "-c", _SAMPLER, host.dev, str(every_s)],
                                      stdout=self._out, text=True)
        self.samples: list[tuple[float, int, int]] = []

    def stop(self) -> list[tuple[float, int, int]]:
        self._proc.terminate()
        self._proc.wait(timeout=IP_TIMEOUT_S)
        self._out.seek(0)
        out = self._out.read()
        self._out.close()
        for line in out.splitlines():
            fields = line.split()
            if len(fields) == 3:
                self.samples.append((float(fields[0]), int(fields[1]), int(fields[2])))
        return self.samples

    def __enter__(self) -> "Sampler":
        return self

    def __exit__(self, *exc: object) -> None:
        if self._proc.poll() is None:
            self.stop()


def bytes_at(samples: Sequence[tuple[float, int, int]], t: float) -> float:
    """Both directions' bytes at time `t`, interpolated between the samples around it."""
    if not samples:
        raise ValueError("no samples")
    times = [s[0] for s in samples]
    k = max(1, min(len(samples) - 1, next((i for i, x in enumerate(times) if x >= t), len(samples) - 1)))
    (t0, a0, b0), (t1, a1, b1) = samples[k - 1], samples[k]
    f = 0.0 if t1 <= t0 else min(1.0, max(0.0, (t - t0) / (t1 - t0)))
    return (a0 + b0) + f * ((a1 + b1) - (a0 + b0))


def existing() -> list[str]:
    """Every namespace of this module's naming on the machine."""
    return [m[0] for m in re.findall(rf"^({PREFIX}\d+x\d+{_ROLE})\b", _ip("netns", "list", check=False).stdout,
                                     flags=re.M)]
