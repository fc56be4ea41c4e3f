"""Network interfaces and addresses of this host: which interface gloo's sockets use, where a route leaves from.

gloo's own listening sockets (``GLOO_SOCKET_IFNAME``, unless set: :func:`set_gloo_interface`) are on the
interface this host reaches the master address through: the loopback interface when the rendezvous is on
loopback (a single-host job), else the interface the kernel routes ``MASTER_ADDR`` through (on rank 0's host,
the one carrying that address). By default gloo binds whatever the host name resolves to, which may be a LAN
address on a single-host job, or loopback on every node of a multi-node one.

Also the address helpers the rendezvous uses (:func:`_resolve`, :func:`route_source`, :func:`interface_of`) and
:func:`free_port` for launchers that pass a port to their children.
"""

from __future__ import annotations

import ipaddress
import os
import socket
from collections.abc import MutableMapping
from pathlib import Path

GLOO_IFNAME_ENV = "GLOO_SOCKET_IFNAME"
"""gloo's choice of network interface; set to loopback for single-host jobs unless already set."""


def loopback_interface() -> str:
    """Name of the loopback network interface (``lo`` on Linux, ``lo0`` on macOS/BSD)."""
    names = [name for _, name in socket.if_nameindex()]
    for name in names:
        try:
            flags = int(Path(f"/sys/class/net/{name}/flags").read_text(), 16)
        except (OSError, ValueError):
            continue
        if flags & 0x8:  # IFF_LOOPBACK
            return name
    return "lo0" if "lo0" in names else "lo"


def set_gloo_interface(master_addr: str, environ: MutableMapping[str, str] = os.environ) -> str | None:
    """Set ``GLOO_SOCKET_IFNAME`` (unless set already) to the interface this host reaches ``master_addr`` through:
    the loopback interface for a single-host job, else the one the kernel routes the master's address through (on
    rank 0's own host: the interface that carries that address), so that gloo's listening sockets are on the network
    the job's nodes share and on nothing else. By default gloo binds whatever the host name resolves to, which may
    be another network's address, or loopback on every node (Debian's ``127.0.1.1`` entry). Returns the value in
    effect (``None``: unset, the route unknown)."""
    if environ.get(GLOO_IFNAME_ENV):
        return environ[GLOO_IFNAME_ENV]
    name = loopback_interface() if _is_loopback(master_addr) else route_interface(master_addr)
    if name is not None:
        environ[GLOO_IFNAME_ENV] = name
    return name


def route_interface(host: str) -> str | None:
    """Name of the network interface whose address this host uses to reach ``host`` (``None``: unresolvable, no
    route, or the source address is on no interface)."""
    source = route_source(host)
    return None if source is None else interface_of(source)


def route_source(host: str) -> str | None:
    """The address this host's packets to ``host`` leave from (the kernel's route choice; ``None``: unresolvable or
    no route). A UDP ``connect`` only asks the kernel for the route and source address; no packet is sent."""
    try:
        ip = _resolve(host, "host")[0]
    except ValueError:
        return None
    family = socket.AF_INET6 if ":" in ip else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect((ip, 9))
            return s.getsockname()[0].split("%")[0]
    except OSError:
        return None


def interface_of(ip: str) -> str | None:
    """The interface (of this network namespace) that carries address ``ip``, ``None`` if none does (Linux:
    ``SIOCGIFADDR`` for IPv4, ``/proc/net/if_inet6`` for IPv6)."""
    addr = ipaddress.ip_address(ip)
    if addr.version == 6:
        try:
            lines = Path("/proc/net/if_inet6").read_text().splitlines()
        except OSError:
            return None
        for line in lines:
            fields = line.split()
            if len(fields) >= 6 and ipaddress.ip_address(bytes.fromhex(fields[0])) == addr:
                return fields[5]
        return None
    import fcntl
    import struct

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                res = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name.encode()[:15]))  # SIOCGIFADDR
            except OSError:
                continue  # no IPv4 address on it
            if socket.inet_ntoa(res[20:24]) == ip:
                return name
    return None


def _resolve(host: str, what: str) -> list[str]:
    """Distinct IP addresses of ``host`` in resolver order; ``ValueError`` naming ``what`` if none."""
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except OSError as exc:
        raise ValueError(f"{what} = {host!r}: cannot resolve ({exc.strerror}): expected an address or host name "
                         "of this host") from None
    return list(dict.fromkeys(str(info[4][0]).split("%")[0] for info in infos))


def _is_loopback(host: str) -> bool:
    """True when ``host`` resolves to loopback addresses only (False when it does not resolve)."""
    try:
        ips = _resolve(host, "host")
    except ValueError:
        return False
    return all(ipaddress.ip_address(ip).is_loopback for ip in ips)


def _routable_host() -> str:
    """This host's name if it resolves, else its loopback address (single-node runs)."""
    name = socket.gethostname()
    try:
        socket.getaddrinfo(name, None)
        return name
    except OSError:
        return "127.0.0.1"


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port the OS reports free right now (for launchers that must pass a port to children)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]
