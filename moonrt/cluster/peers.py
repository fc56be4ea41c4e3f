"""Where each rank runs, recorded at the rendezvous, to name the ranks and host behind a lost gloo connection.

Before the group forms every rank publishes its host name and the address it reaches the master from
(:func:`_publish_peer`); once it formed, each rank reads the table (:func:`_read_peers`, jobs of at most
:data:`MAX_PEER_TABLE` ranks) and wraps ``sys.excepthook`` so that an uncaught "Connection closed by peer
[10.0.0.12]:40587" is followed by a line naming that address's ranks and host (:func:`describe_lost_peers`).
"""

from __future__ import annotations

import ipaddress
import re
import socket
from collections.abc import Mapping

from moonrt.cluster.detect import Rendezvous
from moonrt.cluster.network import route_source

PEER_KEY = "moonrt/peer/"
"""Store key prefix under which each rank publishes ``"<host name> <address>"`` at the rendezvous."""
MAX_PEER_TABLE = 1024
"""Largest world whose ranks read every rank's host at the rendezvous (one store read of ``world`` keys per rank)."""
_PEERS: dict[int, tuple[str, str]] = {}
_GLOO_PEER = re.compile(r"(?:(?:closed|reset) by peer|(?:Read|Write) error) \[([0-9A-Fa-f.:]+)\]:\d+")
"""gloo's forms of a lost connection: "Connection closed by peer [addr]:port" (an orderly close, e.g. a killed
process's socket) and "Read error [addr]:port: Connection reset by peer" (a reset, e.g. a whole node gone)."""


def _publish_peer(store, rdzv: Rendezvous) -> None:
    """Before the group forms: this rank's host name and the address it reaches the master from (its gloo address)."""
    if rdzv.world_size <= MAX_PEER_TABLE and rdzv.master_addr is not None:
        store.set(f"{PEER_KEY}{rdzv.rank}", f"{socket.gethostname()} {route_source(rdzv.master_addr) or '?'}")


def _read_peers(store, rdzv: Rendezvous) -> None:
    """After the group formed (every rank had published): keep the table of where each rank runs, and make an
    uncaught exception that reports a lost peer name that peer's ranks (:func:`describe_lost_peers`)."""
    if rdzv.world_size > MAX_PEER_TABLE or rdzv.master_addr is None:
        return
    import sys

    keys = [f"{PEER_KEY}{r}" for r in range(rdzv.world_size)]
    values = store.multi_get(keys) if hasattr(store, "multi_get") else [store.get(k) for k in keys]
    _PEERS.clear()
    for r, v in enumerate(values):
        host, _, addr = v.decode(errors="replace").partition(" ")
        _PEERS[r] = (host, addr)
    hook = sys.excepthook
    if getattr(hook, "_moonrt_lost_peers", False):
        return

    def excepthook(exc_type, exc, tb) -> None:
        hook(exc_type, exc, tb)
        texts, seen = [], exc
        while seen is not None and len(texts) < 10:
            texts.append(str(seen))
            seen = seen.__cause__ or seen.__context__
        note = describe_lost_peers("\n".join(texts), me=rdzv.rank)
        if note:
            print(note, file=sys.stderr, flush=True)

    excepthook._moonrt_lost_peers = True  # type: ignore[attr-defined]
    sys.excepthook = excepthook


def describe_lost_peers(text: str, peers: Mapping[int, tuple[str, str]] | None = None, *, me: int | None = None
                        ) -> str | None:
    """A line naming the ranks and host of each peer address that gloo reports gone in ``text`` ("Connection closed
    by peer [10.0.0.12]:40587", "Read error [10.0.0.12]:40587: Connection reset by peer": a dead node, killed
    ranks), from ``peers`` (rank -> (host name, address); default:
    the table read at the rendezvous); ``None`` when ``text`` names no such peer, or only this rank's (``me``) own
    host (a single-host job: the launcher names the failed rank itself)."""
    peers = _PEERS if peers is None else peers
    mine = peers.get(me, ("", ""))[1] if me is not None else None
    lost = []
    for raw in dict.fromkeys(_GLOO_PEER.findall(text)):
        try:
            ip = ipaddress.ip_address(raw)
        except ValueError:
            continue
        ip = getattr(ip, "ipv4_mapped", None) or ip
        ranks = [r for r, (_, addr) in sorted(peers.items()) if addr == str(ip)]
        if ranks and str(ip) != mine:
            host = peers[ranks[0]][0]
            lost.append(f"ranks {ranks} on {host} ({ip})" if len(ranks) > 1 else f"rank {ranks[0]} on {host} ({ip})")
    if not lost:
        return None
    return (f"moonrt: lost the connection to {'; '.join(lost)}: that host's ranks died or were killed (a dead node?); "
            "their own logs tell why")
