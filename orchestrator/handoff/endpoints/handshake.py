"""The hello/bootstrap exchange, the prefill's end: a hello to every decode rank, its answer
checked (layout, process space, the answer is to this hello), the session opened, the
backend's send path connected and its first contact made (the engine route: Mooncake's
handshake and first write on a watchdog, orchestrator.handoff.backends.mooncake); and the
decode's end: the hello checked, the rank bound to its connection, the session opened, the
answer (Offer) sent."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import structlog
import zmq

from orchestrator.handoff.backends.base import LayoutMismatch, Peer, SendPath
from orchestrator.handoff.digest import Keys, RowDigest
from orchestrator.handoff.endpoints.common import Side, new_socket
from orchestrator.handoff.endpoints.decode_state import Drops, Notices, Peers, PrefillSession, Replies
from orchestrator.handoff.endpoints.links import Instance, Link, Links
from orchestrator.handoff.faults import wrap
from orchestrator.handoff.specs import FaultSpec
from orchestrator.handoff.transport import wire
from orchestrator.handoff.transport.advert import Advertisement, Adverts
from orchestrator.handoff.transport.wire import Layout
from orchestrator.profile.kinds import AddressCheck
from orchestrator.profile.layout import describe, fingerprint, first_difference
from orchestrator.profile.plan import Plan, same_process_space_rule
from orchestrator.profile.platform import clock as _clock
from orchestrator.profile.platform import pid_namespace
from orchestrator.results.rundir import proc_name


class PrefillHandshake:
    """Bootstraps one prefill rank with every decode rank it was given. `stuck`: a Mooncake
    handshake never returned (the process must exit hard: the backend says so)."""

    def __init__(self, links: Links, side: Side, plan: Plan, rank: int, faults: FaultSpec,
                 tag_in_status: bool, address_check: AddressCheck):
        self.links, self.side, self.plan, self.rank, self.faults = links, side, plan, rank, faults
        self.tag_in_status = tag_in_status
        self.address_check = address_check  # transport.address_check
        self.layout = describe(side.buffers.specs)

    @property
    def stuck(self) -> bool:
        return self.side.backend.stuck

    @property
    def timeout_s(self) -> float:
        return self.links.timeout_s

    def connect(self, decodes: Adverts) -> None:
        """`decodes[i][t]`: what decode instance i's TP rank t said when it came up (its
        control and data endpoints). Says hello to every rank, learns its engine session,
        buffer pointers and layout, and keeps the leader's control channel for arrivals,
        grants and verdicts."""
        links = self.links
        for i, ranks in enumerate(decodes):
            inst: Instance | None = None
            for t, info in enumerate(ranks):
                ctl = new_socket(links.ctx, zmq.DEALER, self.timeout_s)
                ctl.connect(info.control_endpoint)
                push = new_socket(links.ctx, zmq.PUSH, self.timeout_s)
                push.connect(info.data_endpoint)
                path = self.side.backend.router(push, links.me.auth, self.rank, self.tag_in_status)
                name = proc_name("decode", i, len(decodes), t, len(ranks))
                if inst is None:
                    inst = Instance(i, ctl)
                inst.links.append(Link(i, t, push, wrap(path, self.faults), name))
                self.hello(inst, inst.links[-1], path, ctl, info.advertised)
                if t > 0:
                    ctl.close(0)
            assert inst is not None, "an instance has at least one rank"
            links.add(inst)  # bootstrapped on every rank

    def hello(self, inst: Instance, link: Link, path: SendPath, ctl: zmq.Socket,
              advertised: Optional[Advertisement] = None) -> None:
        """`path`: the backend's send path of `link` (its router, less any fault around it)."""
        me = self.links.me
        ctl.send(me.auth.seal(wire.encode(wire.HelloMsg(
            rank=self.rank, layout=self.layout, fingerprint=fingerprint(self.layout), nonce=me.nonce,
            pid_ns=pid_namespace(), boot_id=me.boot_id))))
        match self.recv_one(ctl, link.name):
            case wire.ErrorMsg(detail=detail):
                raise LayoutMismatch(f"{link.name} refused bootstrap: {detail}")
            case wire.BootstrapMsg() as msg if msg.tp_rank == link.tp_rank:
                pass
            case other:
                raise RuntimeError(f"{link.name} answered hello with {other.as_json()}")
        diff = first_difference(self.layout, msg.layout)
        if diff is not None:
            raise LayoutMismatch(f"layout mismatch with {link.name}: {diff}")
        why = same_process_space_rule(self.plan.engine_transport, (pid_namespace(), me.boot_id),
                                      (msg.pid_ns or "", msg.boot_id))
        if why is not None:  # before any byte moves
            raise LayoutMismatch(f"{link.name} refused: {why}")
        session = me.auth.session(self.rank, me.nonce, msg.nonce, "prefill")
        peer = Peer(msg.session_id, msg.aux_ptrs, msg.item_lens, msg.slots,
                    msg.tp_rank, msg.boot_id, msg.scratch_ptr, auth=session)
        link.router.connect(peer)
        if link.tp_rank == 0:
            inst.slots = peer.slots
            inst.auth = session
        inst.same_clock = inst.same_clock and bool(me.boot_id) and peer.boot_id == me.boot_id
        warm_s = self.side.backend.first_contact(path, advertised, self.timeout_s, self.address_check,
                                                 self.links.log)
        self.links.log.info("bootstrapped", decode=link.name, peer_session=peer.session_id,
                            peer_pid_ns=msg.pid_ns or "", pid_ns=pid_namespace(),
                            slots=peer.slots, same_clock=inst.same_clock, first_write_us=round(warm_s * 1e6, 1))

    def recv_one(self, ctl: zmq.Socket, name: str) -> wire.Message:
        """The answer to this hello (answers to another run's hello are counted and skipped)."""
        deadline = _clock() + self.timeout_s
        links = self.links
        while True:
            left = deadline - _clock()
            if left <= 0 or not ctl.poll(int(left * 1000)):
                raise TimeoutError(f"{name} did not answer hello within "
                                   f"transport.timeout_s={self.timeout_s:g}")
            msg = links.open(ctl.recv_multipart())
            if isinstance(msg, wire.BootstrapMsg) and msg.hello_nonce != links.me.nonce:
                links.dropped.replayed += 1  # an answer to another hello (another run's): not ours
                links.log.warning("bootstrap_replayed", decode=name)
                continue
            if msg is not None:
                return msg


@dataclass(frozen=True)
class Offer:
    """What a decode rank tells every prefill about itself when it answers hello."""

    session_id: Optional[str]  # its engine session (silent_peer: a port that never answers)
    aux_ptrs: list[int]
    item_lens: list[int]
    slots: int
    layout: Layout
    tp_rank: int
    scratch_ptr: int


class DecodeHandshake:
    """The decode's end: the first authentic hello for a prefill rank binds that rank to its
    connection and opens its session; any other hello for a bound rank (a copy replayed from
    anywhere, or a second one) is refused and counted. A hello whose layout or process space
    does not fit is refused with the reason (the leader tells the runner too)."""

    def __init__(self, offer: Offer, peers: Peers, replies: Replies, drop: Drops, digest: RowDigest,
                 notices: Notices, plan: Plan, log: structlog.stdlib.BoundLogger, leader: bool):
        self.offer, self.peers, self.replies, self.drop = offer, peers, replies, drop
        self.digest, self.notices, self.plan, self.log, self.leader = digest, notices, plan, log, leader

    def hello(self, identity: bytes, sess: Optional[PrefillSession], msg: wire.HelloMsg) -> None:
        rank = msg.rank
        peers, offer = self.peers, self.offer
        bound = peers.ranks.get(rank)
        if bound is not None or sess is not None:
            self.drop("hijack_refused", "hello_refused", prefill=rank,
                      detail="rank already bound to another connection" if bound is not None
                      and bound.identity != identity else "hello again on a bound connection")
            return
        diff = first_difference(offer.layout, msg.layout)
        if diff is not None:
            self.log.error("layout_mismatch", prefill=rank, detail=diff)
            self.refuse(identity, rank, f"layout mismatch: {diff}")
            return
        why = same_process_space_rule(self.plan.engine_transport, (peers.pid_ns, peers.boot_id),
                                      (msg.pid_ns or "", msg.boot_id or ""))
        if why is not None:  # refused before any byte moves, on both sides
            self.log.error("process_space_mismatch", prefill=rank, detail=why)
            self.refuse(identity, rank, why)
            return
        keys = Keys(peers.secret, msg.nonce)
        new = PrefillSession(rank, identity, peers.auth.session(rank, msg.nonce, peers.nonce, "decode"),
                             keys, _clock())
        self.digest.rank_keys[rank] = keys
        # the answer goes under the secret (the prefill needs our nonce to derive the session)
        self.replies.send(identity, wire.encode(wire.BootstrapMsg(
            session_id=offer.session_id, aux_ptrs=offer.aux_ptrs, item_lens=offer.item_lens,
            slots=offer.slots, layout=offer.layout, fingerprint=msg.fingerprint,
            tp_rank=offer.tp_rank, boot_id=peers.boot_id, scratch_ptr=offer.scratch_ptr,
            nonce=peers.nonce, hello_nonce=msg.nonce, pid_ns=peers.pid_ns)))
        peers.bind(new)
        self.log.info("prefill_bound", prefill=rank)

    def refuse(self, identity: bytes, rank: int, why: str) -> None:
        """Refused at hello: the prefill is told; the leader tells the runner too."""
        self.replies.send(identity, wire.encode(wire.ErrorMsg(detail=why)))
        if self.leader:
            self.notices.refused.append((rank, why))
