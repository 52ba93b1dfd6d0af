"""A split run's bootstrap: the decode side's server and the prefill side's lookup.

role=decode serves its decode endpoints at transport.host:transport.bootstrap_port
(`serve_bootstrap`) to authenticated prefill sides; role=prefill asks for them there
(`lookup`). Both sides seal every message with the run secret. A frame without a valid MAC
never changes a run's fate: the decode side counts it, answers a lookup-shaped one with a
sealed refusal, and serves on; the prefill side concludes "different secrets"
(`secret_mismatch`) only after MAC_FAILURES answers in a row that fail the MAC from the peer
it named (peer= or transport.bootstrap_file), not at endpoints.startup_timeout_s.

Fresh lookups (issue 36). A MAC proves the secret, not the moment: a lookup recorded in one
run (by whoever can write a shared bootstrap dir and point a prefill at itself) opened in
every later run with the same secret, and its peer fields (the prefill's advertised address)
were judged as the real prefill's. Now the prefill side draws a nonce per run and the decode
side a challenge per run; a lookup without the current challenge is answered with it
(`challenge`), and only a lookup that carries it, sent within LOOKUP_WINDOW_S of this side's
clock, is judged and answered. The MAC covers the nonce, the challenge and the time. A
lookup for another challenge (a replay), an old-format one (no nonce) and one outside the
window are refused, counted and logged, never fatal, and never judged: the address verdict
belongs to the prefill side that answered this run's challenge, per nonce. Every answer
echoes the lookup's nonce (answer_to): the prefill side takes a challenge or endpoints only
when they answer its own nonce (a recorded answer is ignored and counted as stale). An
authentic message with a string over its limit is refused as that (wire.TooLong: the field,
its length and the limit), to the sender too; it never counts as a MAC failure.

The runner calls it once per side (orchestrator.job.runner), with what it reads (a
BootstrapSpec, built in orchestrator.job.specs) and the run's secret, from which each side
builds its own Authenticator. What ends the run here is a RunFailed; a signal ends the
wait (`signals.caught`). The job's own part (Mooncake's metadata server, what the decode
processes tell the runner meanwhile) is orchestrator.job.bootstrap.
"""

from __future__ import annotations

import json
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable, Optional, Protocol

import structlog

from orchestrator.handoff.specs import BootstrapSpec
from orchestrator.handoff.transport import wire
from orchestrator.handoff.transport.advert import Adverts
from orchestrator.handoff.transport.auth import Authenticator
from orchestrator.handoff.transport.peercheck import PeerCheck
from orchestrator.profile.kinds import ConfigError, host_port
from orchestrator.profile.platform import clock as _clock
from orchestrator.results.outcomes import RunFailed
from orchestrator.results.records import RunResult
from orchestrator.results.rundir import NotARegularFile, read_shared

_wall_ns = time.time_ns  # the lookup's sent_ms: the two hosts' wall clocks, not monotonic
MAC_FAILURES = 3  # answers in a row from the named peer that fail the MAC: different secrets
REFUSAL_LINGER_MS = 500  # how long a decode side that refused lets its refusals leave
LOOKUP_WINDOW_S = 120  # a lookup sent further than this from the decode side's clock: refused
MAX_JUDGED = 16  # prefill sides (nonces that answered the challenge) judged per decode run
STALE = "a lookup for another run's challenge (recorded earlier: a replay)"
OLD_FORMAT = ("a lookup without a nonce (a prefill side before fresh lookups, or a replay of "
              "one): run the same orchestrator version on both sides")


class Caught(Protocol):
    """The job's signals as the bootstrap reads them (orchestrator.job.lifecycle.Signals):
    `caught` names a SIGINT or SIGTERM taken, and ends the wait."""

    caught: Optional[str]


Infos = Adverts  # per decode instance, per TP rank: its endpoints


def _never() -> bool:
    return False


def secret_mismatch(spec: BootstrapSpec) -> str:
    var = spec.secret_env
    return (f"the peer's MAC did not match: the two sides have different secrets in ${var} "
            f"(transport.secret_env={var})" if var else
            "the peer's MAC did not match: set the same transport.secret_env on both sides")


def _unauthentic_lookup(frame: bytes) -> bool:
    """A frame that reads as our lookup message but whose MAC failed (read, never acted on)."""
    from orchestrator.handoff.transport.auth import MAC_BYTES

    try:
        return isinstance(wire.decode(frame[:-MAC_BYTES]), wire.LookupMsg)
    except (wire.WireError, KeyError, TypeError, ValueError):
        return False


def serve_bootstrap(spec: BootstrapSpec, secret: Optional[bytes], infos: Infos, out: RunResult,
                    log: structlog.stdlib.BoundLogger, signals: Caught, watch: Callable[[], bool] = _never) -> None:
    """role=decode: serve the decode endpoints at transport.host:transport.bootstrap_port to
    prefill sides with the run's `secret`, until `watch()` says the job is done (the runner:
    every prefill rank said bye to every instance) or a signal was caught. `watch` is called
    every beat; what it raises ends the serving."""
    _Bootstrap(spec, secret, infos, out, log).serve(signals, watch)


class _Bootstrap:
    """The bootstrap socket of one role=decode run, and what it made of the lookups."""

    def __init__(self, spec: BootstrapSpec, secret: Optional[bytes], infos: Infos, out: RunResult,
                 log: structlog.stdlib.BoundLogger):
        from orchestrator.handoff.transport.auth import new_nonce

        self.spec, self.out, self.log = spec, out, log
        self.auth = Authenticator(secret)  # this side's: the socket's seals, its peer check's
        self.want = spec.prefill_ranks
        self.check = PeerCheck(spec, "decode", self.auth, log)
        self.challenge = new_nonce()  # this run's: a lookup must carry it to be judged
        # the peer checks' verdict per prefill side (its lookup nonce), and when
        self.judged: dict[str, tuple[Optional[str], float]] = {}
        self.refusals = 0
        self.infos = [[i.public() for i in inst] for inst in infos]
        self.answered = False
        self.rejected, self.quiet_until = 0, 0.0
        self.mac_failed = 0  # lookup-shaped frames whose MAC did not match (counted, refused)
        self.stale = 0  # authentic lookups refused as not fresh (replays, old format, clock)
        self.too_long: Optional[str] = None  # an authentic lookup's over-long field, as said
        self.quiet: dict[str, float] = {}  # rate limit of bootstrap_rejected, per reason
        self.record: Optional[str] = None

    def serve(self, signals: Caught, watch: Callable[[], bool] = _never) -> None:
        import zmq

        zctx = zmq.Context()
        self.sock = zctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.MAXMSGSIZE, wire.CONTROL_FRAME_BYTES)
        wait_s = self.spec.startup_timeout_s
        try:
            self._listen()
            deadline = _clock() + wait_s
            while not signals.caught:
                if not self.answered and _clock() > deadline:
                    hint = (f": refused its lookups: {self.too_long}" if self.too_long else
                            f" (started with role=prefill peer={self.out.bootstrap} and the same "
                            "transport.secret_env?)")
                    raise RunFailed(f"no prefill side looked up {self.out.bootstrap} within "
                                          f"endpoints.startup_timeout_s={wait_s:g}{hint}"
                                          + self._mac_note() + self._stale_note())
                if self.sock.poll(20):
                    self._answer(self.sock.recv_multipart())
                self._refused()
                if watch():
                    return
        finally:
            # a refusal just sent gets half a second to leave (LINGER 0 would drop it)
            self.sock.close(REFUSAL_LINGER_MS if self.refusals else 0)
            zctx.term()
            self._forget()
            self.check.close()

    def _listen(self) -> None:
        """Bind, and tell where: bootstrap.json, transport.bootstrap_file, the console."""
        import zmq

        from orchestrator.results.rundir import NoSpace, write_atomic

        sp, out, host = self.spec, self.out, self.spec.host
        try:
            if sp.bootstrap_port:
                self.sock.bind(f"tcp://{host}:{sp.bootstrap_port}")
                port = sp.bootstrap_port
            else:
                port = self.sock.bind_to_random_port(f"tcp://{host}")
        except zmq.ZMQError as exc:
            raise RunFailed(f"cannot listen on transport.bootstrap_port={sp.bootstrap_port} "
                                  f"at {host}: {exc.strerror} (another process holds it? pick another port, "
                                  "or 0 for any free one)") from None
        out.bootstrap = f"{host}:{port}"
        self.record = json.dumps({"address": out.bootstrap}) + "\n"
        write_atomic(Path(out.run_dir) / "bootstrap.json", self.record)
        if sp.bootstrap_file:
            path = Path(sp.bootstrap_file)
            try:
                write_atomic(path, self.record)
            except NoSpace:
                raise
            except OSError as exc:
                self.record = None  # nothing of ours there to forget
                raise RunFailed(f"cannot write transport.bootstrap_file={path}: "
                                      f"{exc.strerror or exc}") from None
        print(f"decode side up: bootstrap address {out.bootstrap} (start the prefill side with "
              f"role=prefill peer={out.bootstrap})", flush=True)
        self.log.info("bootstrap_listening", address=out.bootstrap)

    def _forget(self) -> None:
        """A stale address in transport.bootstrap_file must not send the next prefill here
        (read as a shared file: whatever was planted there since cannot block this)."""
        from orchestrator.results.rundir import read_shared

        if self.spec.bootstrap_file and self.record is not None:
            try:
                path = Path(self.spec.bootstrap_file)
                if read_shared(path) == self.record:
                    path.unlink()
            except (OSError, ValueError):
                pass

    def _answer(self, frames: list[bytes]) -> None:
        """One request on the bootstrap socket: an authentic, fresh lookup gets the endpoints."""
        auth, sock = self.auth, self.sock
        body = auth.unseal(frames[1]) if len(frames) == 2 else None
        if body is None:
            if len(frames) == 2 and _unauthentic_lookup(frames[1]):
                # a lookup in our format whose MAC does not match: a prefill side with another
                # secret, or anyone who can reach this port. Counted and refused, never fatal:
                # the refusal is sealed, so a prefill side with another secret cannot open it and
                # concludes "different secrets" itself (MAC_FAILURES in a row from its peer).
                self.mac_failed += 1
                sock.send_multipart([frames[0], auth.seal(wire.encode(wire.ErrorMsg(detail="bad MAC")))])
            return self._reject("not an authentic lookup")
        try:
            msg = wire.decode(body)
        except wire.TooLong as exc:  # authentic: its sender is told what is wrong, not "secret"
            self.too_long = str(exc)
            self._send(frames[0], wire.ErrorMsg(detail=str(exc), answer_to=wire.nonce_in(body, "nonce")))
            return self._reject(str(exc))
        except wire.WireError as exc:
            return self._reject(f"a malformed message: {exc}")
        if not isinstance(msg, wire.LookupMsg):
            return self._reject(f"not a lookup: {msg.TYPE}")
        if msg.nonce is None:  # an older prefill side, or a replay of its lookup: never judged
            self.stale += 1
            self._send(frames[0], wire.ErrorMsg(detail=OLD_FORMAT))
            return self._reject(OLD_FORMAT)
        if msg.challenge != self.challenge:  # its first ask, a decode side before us, or a replay
            self._send(frames[0], wire.ChallengeMsg(challenge=self.challenge, answer_to=msg.nonce))
            if msg.challenge is not None:
                self.stale += 1
                self._reject(STALE)
            return None
        apart_ms = None if msg.sent_ms is None else abs(_wall_ns() // 1_000_000 - msg.sent_ms)
        if apart_ms is None or apart_ms > LOOKUP_WINDOW_S * 1000:
            self.stale += 1
            apart = "no time" if apart_ms is None else f"{apart_ms / 1000:.0f} s from this side's clock"
            late = (f"the lookup was sent {apart}, outside the {LOOKUP_WINDOW_S} s lookup window "
                    "(a replay, or the two hosts' clocks apart: sync them)")
            self._send(frames[0], wire.ErrorMsg(detail=late, answer_to=msg.nonce))
            return self._reject("a lookup outside the time window")
        if msg.prefill_ranks != self.want:
            self._send(frames[0], wire.ErrorMsg(
                detail=f"this decode side expects endpoints.prefill_ranks={self.want}, "
                       f"the prefill side has {msg.prefill_ranks}", answer_to=msg.nonce))
        elif (why := self._judge(msg)) is not None:  # before any handoff
            self._send(frames[0], wire.ErrorMsg(detail=why, answer_to=msg.nonce))
            self.refusals += 1
        else:
            self._send(frames[0], wire.DecodesMsg(infos=self.infos, prefill_ranks=self.want,
                                                  answer_to=msg.nonce, **self.check.fields()))
            self.answered = True
        return None

    def _send(self, identity: bytes, msg: wire.Message) -> None:
        self.sock.send_multipart([identity, self.auth.seal(wire.encode(msg))])

    def _reject(self, reason: str) -> None:
        """Counted; logged at most once per 5 s per reason, with the count."""
        self.rejected += 1
        if _clock() >= self.quiet.get(reason, 0.0):
            self.log.warning("bootstrap_rejected", reason=reason, count=self.rejected)
            self.quiet[reason] = _clock() + 5.0

    def _judge(self, msg: wire.LookupMsg) -> Optional[str]:
        """The peer checks of the prefill side that answered this run's challenge (its
        nonce), once: the probe may take seconds, and it asks again meanwhile (each ask gets
        the same answer). A replayed lookup never gets here."""
        assert msg.nonce is not None  # (_answer)
        if msg.nonce not in self.judged:
            if len(self.judged) >= MAX_JUDGED:
                return f"more than {MAX_JUDGED} prefill sides looked up this decode side"
            self.judged[msg.nonce] = (self.check.judge(msg, self.out), _clock())
        return self.judged[msg.nonce][0]

    def _refused(self) -> None:
        """A refusal ends this side once the prefill side got it (it asks again while the
        probe runs, so the first answer may have gone to a socket it closed), or 3 s after."""
        for why, when in self.judged.values():
            if why is not None and (self.refusals >= 2 or _clock() > when + 3.0):
                raise RunFailed(f"refused before any handoff: {why}")

    def _mac_note(self) -> str:
        if not self.mac_failed:
            return ""
        return (f"; {self.mac_failed} lookups carried a MAC that did not match (a prefill side with "
                f"another secret? {secret_mismatch(self.spec).split(': ', 1)[1]})")

    def _stale_note(self) -> str:
        if not self.stale:
            return ""
        return (f"; {self.stale} authentic lookups were refused as not fresh (recorded in another "
                "run, or from a prefill side before fresh lookups: bootstrap_rejected in the log)")


def lookup(spec: BootstrapSpec, secret: Optional[bytes], signals: Caught, out: Optional[RunResult] = None,
           log: Optional[structlog.stdlib.BoundLogger] = None) -> Optional[Infos]:
    """role=prefill: the decode endpoints, from the decode side's bootstrap address (asked
    again every second until endpoints.startup_timeout_s: that side may start later), with
    the run's `secret`; None when a signal ended the wait. The two sides' peer checks
    (transport.peercheck: versions, the address SGLang would advertise) run on the way;
    warnings go to `out`. The address asked: spec.peer, or (None) the one in
    transport.bootstrap_file."""
    auth = Authenticator(secret)  # this side's: its lookups' seals, its peer check's
    check = PeerCheck(spec, "prefill", auth, log or structlog.get_logger())
    try:
        return _lookup(spec, auth, signals, check, out if out is not None else RunResult())
    finally:
        check.close()


def _lookup(spec: BootstrapSpec, auth: Authenticator, signals: Caught, check: PeerCheck,
            out: RunResult) -> Optional[Infos]:
    deadline = _clock() + spec.startup_timeout_s
    address = _await_address(spec, deadline, signals)
    if address is None:
        return None
    asker = _Asker(spec, auth, check, address)
    try:
        while _clock() < deadline and not signals.caught:
            if spec.peer is None:  # a decode side restarted meanwhile writes a new address
                asker.reread_address()
            asker.ask()
            msg = asker.answer()
            if msg is None:
                continue
            why = check.judge(msg, out)
            if why is not None:
                raise RunFailed(f"refused before any handoff: {why}")
            if check.reached is not None:  # the endpoints' Mooncake probe of it (prefill endpoint)
                return [[replace(i, advertised=check.reached) for i in inst] for inst in msg.infos]
            return msg.infos
        if signals.caught:
            return None
        raise asker.unanswered()
    finally:
        asker.close()


class _Asker:
    """role=prefill's side of one lookup: the decode side's address, this run's nonce (every
    answer it takes echoes it), the decode side's challenge once it said it, the socket it
    asks on, and the answers it could not take (MAC failures in a row, stale ones)."""

    def __init__(self, spec: BootstrapSpec, auth: Authenticator, check: PeerCheck,
                 address: tuple[str, int]) -> None:
        import zmq

        from orchestrator.handoff.transport.auth import new_nonce

        self.spec, self.check = spec, check
        self.auth = auth
        self.host, self.port = address
        self.bad = 0  # answers in a row from the named peer that failed the MAC
        self.stale = 0  # authentic answers to another lookup than this run's (recorded: replays)
        self.nonce = new_nonce()  # this run's: every answer it takes echoes it
        self.challenge: Optional[str] = None  # the decode side's, once it said it
        self.zctx = zmq.Context()
        self.sock: Any = None
        self.at: Optional[tuple[str, int]] = None

    def reread_address(self) -> None:
        """The address in transport.bootstrap_file now, if it can be read."""
        try:
            self.host, self.port = peer_address(None, self.spec.bootstrap_file)
        except (ConfigError, ValueError):
            pass

    def _connect(self) -> None:
        """One socket per decode address, asked again every second: an answer to any ask
        reaches it. (A socket per ask lost the answers to the asks before: a decode side that
        refused after a probe of seconds answered the closed ones and ended.) SNDHWM 1: while
        the decode side is not up, one ask waits, not one per second. Not IMMEDIATE: with it,
        an answer that arrived just before the decode side closed is dropped with the
        connection, unread."""
        import zmq

        if self.sock is not None:
            self.sock.close(0)
        self.sock, self.at, self.challenge = self.zctx.socket(zmq.DEALER), (self.host, self.port), None
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.SNDHWM, 1)
        self.sock.setsockopt(zmq.MAXMSGSIZE, wire.CONTROL_FRAME_BYTES)
        self.sock.connect(f"tcp://{self.host}:{self.port}")

    def ask(self) -> None:
        """This run's lookup (with the challenge, once said), on a new socket if the address
        changed."""
        import zmq

        if self.at != (self.host, self.port):
            self._connect()
        try:
            self.sock.send(self.auth.seal(wire.encode(wire.LookupMsg(
                rank=0, prefill_ranks=self.spec.prefill_ranks, **self.check.fields(), nonce=self.nonce,
                challenge=self.challenge, sent_ms=_wall_ns() // 1_000_000))), zmq.NOBLOCK)
        except zmq.Again:  # not connected yet, and an ask already waits
            pass

    def answer(self) -> Optional[wire.DecodesMsg]:
        """The decode side's answer to this run's lookup within a second, if it brought the
        endpoints; None for no answer, a challenge (taken), a MAC failure or a stale answer
        (counted). A refusal, an answer refused, or MAC_FAILURES in a row: RunFailed."""
        frame = self.sock.recv() if self.sock.poll(1000) else None
        if frame is None:
            return None
        body = self.auth.unseal(frame)
        if body is None:  # counted; "different secrets" only after MAC_FAILURES in a row
            self.bad += 1
            if self.bad >= MAC_FAILURES:
                raise RunFailed(f"{secret_mismatch(self.spec)} (the decode side at {self.host}:{self.port}: "
                                      f"{self.bad} answers in a row failed the MAC)")
            return None
        self.bad = 0
        try:
            msg = wire.decode(body)
        except wire.WireError as exc:  # authentic, malformed: said if it answers this run
            if wire.nonce_in(body, "answer_to") == self.nonce:
                raise RunFailed(f"the decode side at {self.host}:{self.port} answered with a message "
                                      f"refused: {exc}") from None
            self.stale += 1
            return None
        match msg:
            case wire.ChallengeMsg(answer_to=to) if to == self.nonce:
                self.challenge = msg.challenge  # asked again at once, answering it
                return None
            # a refusal without answer_to: to a lookup whose nonce the decode side could
            # not read (an over-long field), or from a decode side before answer_to
            case wire.ErrorMsg(detail=detail, answer_to=to) if to in (self.nonce, None):
                raise RunFailed(f"the decode side at {self.host}:{self.port} refused: {detail}")
            case wire.DecodesMsg(answer_to=to) if to == self.nonce:
                return msg
            case _:  # an answer to another run's lookup (recorded), or not an answer
                self.stale += 1
                return None

    def unanswered(self) -> RunFailed:
        """Why the lookup ended at endpoints.startup_timeout_s."""
        note = (f"; {self.stale} authentic answers were to another run's lookup (recorded: replays?)"
                if self.stale else "")
        return RunFailed(f"no decode side answered at {self.host}:{self.port} within endpoints.startup_timeout_s="
                               f"{self.spec.startup_timeout_s:g} (is it up, with the same transport.secret_env and "
                               f"an orchestrator with fresh lookups?){note}")

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close(0)
        self.zctx.term()


def peer_address(peer: Optional[str], bootstrap_file: Optional[str], timeout_s: float = 0.0) -> tuple[str, int]:
    """The decode side's bootstrap address: `peer`, or what the decode side wrote to
    transport.bootstrap_file (waited for up to `timeout_s`)."""
    if peer is not None:
        addr = host_port(peer)
        assert addr is not None, "checked by OrchestratorConfig.check"
        return addr
    assert bootstrap_file is not None, "checked by OrchestratorConfig.check"
    path = Path(bootstrap_file)
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            addr = host_port(json.loads(read_shared(path))["address"])
            if addr is not None:
                return addr
        except NotARegularFile:
            raise  # a FIFO or device planted there: refused, never waited on
        except (OSError, ValueError, KeyError, TypeError):
            pass
        if time.monotonic() >= deadline:
            raise ConfigError("transport.bootstrap_file", str(path),
                              "a file the decode side (role=decode) writes its address to; none "
                              f"appeared within {timeout_s:g} s")
        time.sleep(0.5)


def _await_address(spec: BootstrapSpec, deadline: float, signals: Caught) -> Optional[tuple[str, int]]:
    """The decode side's address: spec.peer, or transport.bootstrap_file once the decode side
    wrote it (until `deadline`; a signal ends the wait: None). A bootstrap file that is not a
    regular file (a FIFO, a device) is refused at once."""
    said = False
    while True:
        try:
            return peer_address(spec.peer, spec.bootstrap_file)
        except NotARegularFile as exc:
            raise RunFailed(f"transport.bootstrap_file: {exc}; refused (the decode side writes a "
                                  "regular file there)") from None
        except ConfigError:
            if _clock() >= deadline:
                raise RunFailed(f"transport.bootstrap_file={spec.bootstrap_file}: no address appeared "
                                      f"there within endpoints.startup_timeout_s={spec.startup_timeout_s:g} "
                                      "(is the decode side, role=decode, up and writing it?)") from None
        if signals.caught:
            return None
        if not said:
            structlog.get_logger("orchestrator.bootstrap").info(
                "bootstrap_waiting", file=spec.bootstrap_file)
            said = True
        time.sleep(0.1)
