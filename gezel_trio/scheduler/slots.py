"""The slot table: what every slot of one engine holds, who is pinned to it, and why.

The host owns one :class:`SlotTable` per engine. It is the only record of slot
state the scheduler trusts: free slot ids come from it (not from a ``GET /slots``
sample on the request path), and a job may run on a slot only when the table
says the slot holds nothing but the job's own owner's KV.

An *owner* is what the API layer hands the scheduler as a job's ``session``: a
caller's named session, or (``[scheduler] keyless = "shared"``) the caller's
*keyless owner*, which all of that caller's keyless requests share
(:meth:`gezel_trio.kv.sessions.SessionKeys.keyless`). Both are owners like any
other: KV never crosses from one to another, and each is parked and restored
alike (see :meth:`SlotTable.preparation`). In ``"blind"`` mode a keyless request
has no owner (``session`` None).

Each slot has a *content*:

- ``FRESH``: untouched since this engine generation began;
- ``CLEAN``: an erase was acknowledged and nothing ran since;
- ``OWNED``: holds one owner's KV (``session``; ``keyless`` for a keyless owner);
- ``KEYLESS``: a blind keyless job ran on it (dirty: erased before anyone's next use);
- ``UNKNOWN``: nothing vouches for it (an erase, restore or completion was sent
  and not acknowledged, an exclusive op used the engine freely, or
  reconciliation found work the host did not send). Erased before any use.

Every transition is recorded *before* the I/O that causes it: a slot becomes
``UNKNOWN`` before an erase, restore or completion is sent
(:meth:`SlotTable.sending`), and ``CLEAN`` or ``OWNED`` only once the engine has
acknowledged the erase or restore, or the completion has ended. A cancelled
erase therefore leaves the slot ``UNKNOWN``, never falsely ``CLEAN``.

A job with an owner runs only on a slot that holds that owner's KV or nothing, or,
when it may share its caller's prefixes (its ``caller`` is set: an attention model,
``[scheduler] share_prefix_within_caller`` on), the KV of another owner of the same
caller that shares blocks with the request: the engine cuts a slot back to the
prefix the request shares with it, so the job reuses exactly its own prefix (see
:meth:`SlotEntry.shares_with`). The caller is recorded per slot; owners of
different callers never share. A job without an owner is *blind*: it is sent
with ``cache_prompt`` off, so the engine re-evaluates its whole prompt and
reuses nothing the slot held (measured on llama-server: ``timings.cache_n`` is
0), and it may run on any slot without an erase. What it leaves (``KEYLESS``) is
erased before an owner's job uses the slot, and in the background once the slot
has stayed idle.

An ``OWNED`` slot also records the *prefix blocks* of the last request that ran
on it, or of the parked copy restored into it (:mod:`.prefix`; ``()`` when
unknown), so that the scheduler can send an owner's request to the slot it
continues. Blocks decide placement only. An owner may hold several
conversations: in its slots and in parked copies (one per conversation, each
with its blocks). A request of an owner whose slot holds another of its
conversations gets that one parked first (unless its copy is current) and its
own parked copy restored when that shares more blocks with it.

A slot may be *being saved* (``saving``): a background save of its owner's KV,
started once the slot went idle, so that a later handoff finds its parked copy
current and skips the save. The slot is not pinned meanwhile (a request of its
owner may still be placed on it), but nothing is sent to it until the save ends:
the dispatcher makes a job pinned to it wait. A save changes no content.

A *pin* (the job holding a slot) is separate from content. Pins survive an
engine restart (:meth:`SlotTable.sync` makes every slot ``FRESH``, and a pinned
job simply carries on in the new generation); they are released only by
:meth:`SlotTable.unpin`. A slot can also be *held out*: reconciliation saw it
busy with work the host did not send, and until a later sample shows it idle
nobody is pinned to it.

Plain bookkeeping with no I/O: :mod:`gezel_trio.scheduler.dispatcher` drives it.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from gezel_trio.kv.prefix import Prefix, is_prefix, shared_blocks
from gezel_trio.kv.sessions import session_hash

__all__ = ["Content", "Preparation", "SlotEntry", "SlotTable", "SlotTableStats"]


class Content(enum.Enum):
    FRESH = "fresh"
    CLEAN = "clean"
    OWNED = "owned"
    KEYLESS = "keyless"
    UNKNOWN = "unknown"


@dataclass(slots=True)
class SlotEntry:
    """One slot. ``session``, ``keyless``, ``blocks`` and ``caller`` describe an ``OWNED``
    slot's owner and are reset with every other content."""

    id: int
    content: Content = Content.FRESH
    session: str | None = None
    pin: object | None = None
    held_out: bool = False
    parked_current: bool = False
    """The owner's parked copy (KV parking) equals the slot's content: no save needed."""
    keyless: bool = False
    """The owner is a caller's keyless owner (parked and restored like any owner)."""
    blocks: Prefix = ()
    """Prefix blocks of the last request that ran on it (``()``: unknown)."""
    last_used: int = 0
    released: int = 0
    """The table's tick when the slot was last unpinned (for reconciliation races)."""
    saving: object | None = None
    """The background save in flight on this slot (None: none); see :meth:`SlotTable.begin_save`."""
    caller: str | None = None
    """The caller of the owner, when the owner's jobs may share its prefixes with the
    caller's other owners (None: with nobody)."""

    def hold(
        self,
        content: Content,
        session: str | None = None,
        *,
        parked_current: bool = False,
        keyless: bool = False,
        blocks: Prefix = (),
        caller: str | None = None,
    ) -> None:
        """Record what the slot holds now (an owner only with ``OWNED``)."""
        self.content, self.session, self.parked_current = content, session, parked_current
        self.keyless, self.blocks, self.caller = keyless, blocks, caller

    def safe_for(self, session: str | None, caller: str | None = None, prefix: Prefix = ()) -> bool:
        """Whether a job of ``session`` may run on this slot as it is (a keyless job
        is blind: it reads nothing the slot holds). ``caller`` and ``prefix``: the job
        may start from what another owner of that caller left (:meth:`shares_with`)."""
        if session is None or self.content in (Content.FRESH, Content.CLEAN):
            return True
        return self.content is Content.OWNED and (
            self.session == session or self.shares_with(session, caller, prefix) > 0
        )

    def shares_with(self, session: str | None, caller: str | None, prefix: Prefix) -> int:
        """How many blocks of ``prefix`` (a request of ``session``) the slot holds when
        it holds another owner's KV of the same ``caller`` (not None), both sharing
        (0: none, or message headers only). A request sharing some may be sent onto
        it with ``cache_prompt`` on: the engine keeps only the prefix they share."""
        if (
            caller is None
            or session is None
            or self.content is not Content.OWNED
            or self.caller != caller
            or self.session == session
        ):
            return 0
        return shared_blocks(self.blocks, prefix)

    def handoff_cost(self, session: str | None) -> int:
        """How much taking this slot costs a job of ``session``: 0 nothing (its own
        KV; a keyless job on a keyless slot), 1 a clean slot (kept for keyed chats
        when a keyless job has a choice), 2 an erase that costs nobody anything
        (keyless or unknown content), 3 another session's KV is displaced."""
        content = self.content
        if content is Content.OWNED:
            return 0 if session is not None and self.session == session else 3
        if content is Content.KEYLESS:
            return 0 if session is None else 2
        if content is Content.UNKNOWN:
            return 2
        return 0 if session is not None else 1


@dataclass(frozen=True, slots=True)
class Preparation:
    """What must happen to a slot before a job of ``session`` may run on it.

    ``park``: the session whose KV to save first (its parked copy is stale);
    ``restore``: the job's own parked KV replaces the slot's content (which also
    isolates it); ``lend``: the parked copy of that other owner of the job's caller
    replaces it (the job then starts from the prefix the two share: the engine cuts
    the slot back to it); ``erase``: the slot must be erased. At most one of
    ``restore``, ``lend`` and ``erase`` is set. ``drop_tail``: the outgoing owner is
    not parked although its copy is stale (see the field).
    """

    park: str | None = None
    restore: bool = False
    erase: bool = False
    lend: str | None = None
    drop_tail: bool = False
    """The slot's owner (another of the job's caller) loses its unsaved tail beyond the
    prefix the job shares: at most :data:`SHORT_TAIL_BLOCKS` blocks, not worth a save."""

    @property
    def calls(self) -> int:
        return (
            int(self.park is not None)
            + int(self.restore)
            + int(self.erase)
            + int(self.lend is not None)
        )


NOTHING_TO_PREPARE = Preparation()

SHORT_TAIL_BLOCKS = 1
"""How many blocks beyond the prefix a request of its caller shares a slot may hold and
still go to that request without a save first: the engine keeps the shared prefix in the
slot (the owner may start from it again, as any owner of its caller may), and the tail
is one message and the answer to it. Codex's second ``codex exec`` differs from the
first in its last message alone, and the save of the first's 4.6k tokens (105 MB)
made it wait 40 ms; a bare llama-server copies the slot to its RAM cache instead."""


@dataclass(frozen=True, slots=True)
class SlotTableStats:
    generation: int | None
    slots: int
    pinned: int
    held_out: int
    saving: int  # slots a background save is in flight on
    contents: dict[str, int]
    owners: dict[int, str | None]  # slot -> hashed session (None: a keyless job's KV)


class SlotTable:
    """The slots of one engine, for its current generation. See the module docstring."""

    __slots__ = ("_tick", "generation", "slots")

    def __init__(self, size: int = 0, *, generation: int | None = None) -> None:
        self.generation = generation
        self.slots: list[SlotEntry] = [SlotEntry(i) for i in range(size)]
        self._tick = 0

    def __repr__(self) -> str:
        pinned = sum(1 for s in self.slots if s.pin is not None)
        return f"<SlotTable gen={self.generation} slots={len(self.slots)} pinned={pinned}>"

    def __len__(self) -> int:
        return len(self.slots)

    @property
    def tick(self) -> int:
        return self._tick

    def _advance(self) -> int:
        self._tick += 1
        return self._tick

    # ------------------------------------------------------------------ generations

    def sync(self, generation: int, size: int) -> list[object]:
        """Adopt the engine's generation and slot count.

        A new generation is a new engine process: every slot is ``FRESH`` and
        nothing is held out. Pins are kept (their jobs carry on in the new
        process), except pins on slot ids the new engine no longer has: those
        jobs are returned, and must not send anything more.
        """
        if generation == self.generation and size == len(self.slots):
            return []
        lost: list[object] = []
        restarted = generation != self.generation
        old = self.slots
        self.generation = generation
        self.slots = [SlotEntry(i) for i in range(size)]
        for entry in old:
            if entry.id < size:
                new = self.slots[entry.id]
                new.pin = entry.pin
                new.last_used = entry.last_used
                if not restarted:  # same process, new size: keep what we knew
                    new.hold(
                        entry.content,
                        entry.session,
                        parked_current=entry.parked_current,
                        keyless=entry.keyless,
                        blocks=entry.blocks,
                        caller=entry.caller,
                    )
                    new.held_out = entry.held_out
                    new.saving = entry.saving
            elif entry.pin is not None:
                lost.append(entry.pin)
        return lost

    def forget(self) -> None:
        """Nothing vouches for any slot any more (an exclusive op used the engine as
        it pleased): each becomes ``UNKNOWN`` and is erased before its next use."""
        for entry in self.slots:
            entry.hold(Content.UNKNOWN)

    # ------------------------------------------------------------------ pins

    def free(self) -> list[int]:
        """Slot ids a new job may be pinned to: not pinned, not held out."""
        return [s.id for s in self.slots if s.pin is None and not s.held_out]

    def all_free(self) -> bool:
        return bool(self.slots) and all(s.pin is None and not s.held_out for s in self.slots)

    def pin(self, slot: int, job: object) -> None:
        if not 0 <= slot < len(self.slots):
            raise IndexError(f"slot {slot} is not in this table of {len(self.slots)}")
        entry = self.slots[slot]
        if entry.pin is not None:
            raise AssertionError(f"slot {slot} is already pinned to {entry.pin!r}")
        if entry.held_out:
            raise AssertionError(f"slot {slot} is held out")
        entry.pin = job
        entry.last_used = self._advance()

    def pinned_to(self, slot: int) -> object | None:
        return self.slots[slot].pin if 0 <= slot < len(self.slots) else None

    def unpin(self, slot: int, job: object) -> None:
        """Release ``job``'s pin on ``slot`` (a no-op if it no longer holds it)."""
        if 0 <= slot < len(self.slots) and self.slots[slot].pin is job:
            entry = self.slots[slot]
            entry.pin = None
            entry.released = self._advance()

    # ------------------------------------------------------------------ content

    def owner(self, slot: int) -> str | None:
        entry = self.slots[slot]
        return entry.session if entry.content is Content.OWNED else None

    def content(self, slot: int) -> Content:
        return self.slots[slot].content

    def safe_for(
        self, slot: int, session: str | None, caller: str | None = None, prefix: Prefix = ()
    ) -> bool:
        return self.slots[slot].safe_for(session, caller, prefix)

    def shares_with(
        self, slot: int, session: str | None, caller: str | None, prefix: Prefix
    ) -> int:
        return self.slots[slot].shares_with(session, caller, prefix)

    def last_used(self, slot: int) -> int:
        return self.slots[slot].last_used

    def blocks(self, slot: int) -> Prefix:
        """The prefix blocks of the last request that ran on an ``OWNED`` slot (``()``:
        unknown, or not owned)."""
        return self.slots[slot].blocks

    def handoff_cost(self, slot: int, session: str | None) -> int:
        return self.slots[slot].handoff_cost(session)

    def holds(self, session: str) -> bool:
        """True when some slot owns ``session``'s KV (O(slots))."""
        return any(e.content is Content.OWNED and e.session == session for e in self.slots)

    def handoff_likely(self, slot: int) -> bool:
        """Whether ``slot`` may soon change hands, so that saving its KV ahead of time
        pays: no other slot is left fresh or clean for a newcomer. While one is, the
        next owner takes it, and saving every turn would only cost time: the engine
        pauses its other slots while it writes a save. (Another owner already waiting
        is the dispatcher's to see.)"""
        return not any(
            entry.id != slot and entry.content in (Content.FRESH, Content.CLEAN)
            for entry in self.slots
        )

    def holders(self) -> dict[str, list[int]]:
        """Session -> the slots whose KV it owns, most recently used first."""
        out: dict[str, list[int]] = {}
        for entry in sorted(self.slots, key=lambda s: s.last_used, reverse=True):
            if entry.content is Content.OWNED and entry.session is not None:
                out.setdefault(entry.session, []).append(entry.id)
        return out

    def preparation(
        self,
        slot: int,
        session: str | None,
        *,
        erase_on_handoff: bool = True,
        parking: bool = False,
        is_parked: Callable[[str], bool] = lambda _s: False,
        prefix: Prefix = (),
        is_current: Callable[[str, Prefix], bool] | None = None,
        parked_shares: Callable[[str], int | None] | None = None,
        caller: str | None = None,
        lent: Callable[[], tuple[str, int] | None] | None = None,
    ) -> Preparation:
        """What a job of ``session`` needs done to ``slot`` before it runs (no I/O).

        With ``parking``: the outgoing owner's KV is saved first unless its parked
        copy is current, and the job's own parked KV is restored in place of an
        erase. A blind job (``session`` None) needs no erase, only the park of a
        session it displaces. ``erase_on_handoff`` off (a benchmark baseline) skips
        the erase of another owner's or a blind job's KV, never of ``UNKNOWN``.

        ``is_parked(session)``: the job's owner has a parked copy it may restore (for
        this request). ``is_current(owner, blocks)``: a parked copy of ``owner`` holds
        exactly ``blocks`` (default: ``is_parked(owner)``). ``prefix``: the request's
        blocks; ``parked_shares(session)``: how many of them the copy a restore would
        bring back shares (None: none). With both, a slot of the job's own owner
        that holds another of its conversations (its blocks diverge from
        ``prefix``) has that one parked first (unless current), and the job's copy
        restored when it shares more blocks than the slot does.

        ``caller``: the job may share its caller's prefixes (:meth:`SlotEntry.shares_with`).
        A slot holding another owner's KV of that caller that shares blocks of
        ``prefix`` (more than message headers) is not erased: that owner's
        KV is parked first (unless current, or it holds at most
        :data:`SHORT_TAIL_BLOCKS` beyond the shared prefix and the slot keeps that
        prefix: ``drop_tail``), and the job's own copy restored unless
        the slot shares more blocks with the request (a tie goes to the copy: blocks
        are whole pieces, and the copy may hold more of the last one); else the
        request goes onto the slot as it is and the engine keeps only the prefix they
        share.

        ``lent()``: the parked copy of another owner of ``caller`` the job could start
        from instead, and how many blocks of ``prefix`` it shares (None: none). With
        ``parking`` and no copy of the job's own to restore, it replaces the slot's
        content (the outgoing owner parked first, as on any handoff) when it shares
        more blocks than the slot: the slot was taken by others since, or never held
        that prefix. A copy stays its owner's; the slot then holds that owner's KV,
        current (no save), and the request goes onto it as above.
        """
        entry = self.slots[slot]
        owner = entry.session if entry.content is Content.OWNED else None

        def current(who: str) -> bool:
            return is_current(who, entry.blocks) if is_current is not None else is_parked(who)

        # The owner's copy needs saving unless it is current and still on disk.
        stale = owner is not None and not (entry.parked_current and current(owner))
        if session is None:
            return Preparation(park=owner) if parking and stale else NOTHING_TO_PREPARE

        def lend(than: int) -> str | None:
            """The owner of the caller's copy to restore, when it shares more than
            ``than`` blocks."""
            if not parking or caller is None or lent is None:
                return None
            found = lent()
            return found[0] if found is not None and found[1] > than else None

        if entry.safe_for(session):
            if not parking:
                return NOTHING_TO_PREPARE
            if entry.content is not Content.OWNED:
                if is_parked(session):
                    return Preparation(restore=True)
                lender = lend(0)
                return Preparation(lend=lender) if lender is not None else NOTHING_TO_PREPARE
            if (
                parked_shares is None
                or not entry.blocks
                or not prefix
                or is_prefix(entry.blocks, prefix)
            ):
                return NOTHING_TO_PREPARE  # the request continues what the slot holds
            # The slot holds another conversation of the job's owner.
            shares = parked_shares(session)
            restore = shares is not None and shares > shared_blocks(entry.blocks, prefix)
            return Preparation(park=session if stale else None, restore=restore)
        park = owner if parking and stale else None
        shared = entry.shares_with(session, caller, prefix)
        if shared:
            restore = parking and is_parked(session)
            if restore and parked_shares is not None:
                shares = parked_shares(session)
                restore = shares is not None and shares >= shared
            lender = None if restore else lend(shared)
            if (
                park is not None
                and not restore
                and lender is None
                and len(entry.blocks) - shared <= SHORT_TAIL_BLOCKS
            ):
                return Preparation(drop_tail=True)  # the slot keeps the shared prefix
            return Preparation(park=park, restore=restore, lend=lender)
        if parking and is_parked(session):
            return Preparation(park=park, restore=True)
        lender = lend(0)
        if lender is not None:
            return Preparation(park=park, lend=lender)
        if not erase_on_handoff and entry.content is not Content.UNKNOWN:
            return Preparation(park=park)
        return Preparation(park=park, erase=True)

    def sending(self, slot: int, job: object) -> None:
        """``job`` is about to send an erase, restore or completion to ``slot``: from
        now until the engine acknowledges, nothing vouches for its content."""
        self._pinned(slot, job).hold(Content.UNKNOWN)

    def erased(self, slot: int, job: object) -> None:
        """The engine acknowledged an erase of ``slot`` sent by ``job``."""
        self._pinned(slot, job).hold(Content.CLEAN)

    def restored(
        self,
        slot: int,
        job: object,
        session: str,
        *,
        keyless: bool = False,
        blocks: Prefix = (),
        caller: str | None = None,
    ) -> None:
        """The engine acknowledged a restore of ``session``'s parked copy (of ``blocks``)
        into ``slot``: the slot holds that copy, which is current (``caller``: as in
        :meth:`completed`)."""
        self._pinned(slot, job).hold(
            Content.OWNED,
            session,
            parked_current=True,
            keyless=keyless,
            blocks=blocks,
            caller=caller,
        )

    def started(
        self, slot: int, job: object, session: str, *, keyless: bool = False, blocks: Prefix = ()
    ) -> None:
        """The engine acknowledged that ``slot`` holds the first ``blocks`` of ``job``'s
        own request (its caller's lead, see :mod:`gezel_trio.kv.lead`): ``session``'s
        KV, of which no parked copy is current."""
        self._pinned(slot, job).hold(Content.OWNED, session, keyless=keyless, blocks=blocks)

    def parked(self, slot: int, job: object, session: str) -> None:
        """``session``'s KV in ``slot`` was saved (acknowledged) by ``job``: see
        :meth:`_saved`."""
        self._saved(self._pinned(slot, job), session)

    def _saved(self, entry: SlotEntry, session: str) -> None:
        """``session``'s KV in ``entry`` was saved: its parked copy is current, and the
        copies it replaced (those it continues, see :meth:`KvStore.put
        <gezel_trio.kv.store.KvStore.put>`) are no longer any other slot's."""
        if entry.content is Content.OWNED and entry.session == session:
            for other in self.slots:
                if other.session == session and (
                    not other.blocks or is_prefix(other.blocks, entry.blocks)
                ):
                    other.parked_current = False
            entry.parked_current = True

    # ------------------------------------------------------------------ background saves

    def begin_save(self, slot: int, token: object) -> str | None:
        """Mark ``slot`` as being saved by ``token`` (a background save): returns the owner
        whose KV to save, or None when the slot is not an idle owned slot (pinned, held
        out, already being saved, or holding no owner's KV): then nothing is marked."""
        if not 0 <= slot < len(self.slots):
            return None
        entry = self.slots[slot]
        if (
            entry.pin is not None
            or entry.held_out
            or entry.saving is not None
            or entry.content is not Content.OWNED
            or entry.session is None
        ):
            return None
        entry.saving = token
        return entry.session

    def saving(self, slot: int) -> object | None:
        """The background save in flight on ``slot`` (None: none)."""
        return self.slots[slot].saving if 0 <= slot < len(self.slots) else None

    def end_save(self, slot: int, token: object, session: str, *, tokens: int | None) -> None:
        """``token``'s background save of ``slot`` ended: ``tokens`` saved (None: it failed
        or was cut; 0: the engine says the slot is empty). A no-op when the slot is no
        longer the one ``token`` marked (the engine restarted)."""
        if not 0 <= slot < len(self.slots) or self.slots[slot].saving is not token:
            return
        entry = self.slots[slot]
        entry.saving = None
        if tokens is None:
            return
        if tokens:
            self._saved(entry, session)
        elif entry.content is Content.OWNED and entry.session == session and entry.pin is None:
            entry.hold(Content.CLEAN)

    def completed(
        self,
        slot: int,
        job: object,
        session: str | None,
        *,
        keyless: bool = False,
        blocks: Prefix = (),
        caller: str | None = None,
    ) -> None:
        """``job``'s completion on ``slot`` ended (finished, failed or cancelled).

        The job ran only on a slot that was safe for it, so the slot now holds its
        owner's KV and nothing else (``session`` None, a blind job: dirty), or, when
        it started from another owner's prefix of its caller, what it shared of that
        (its own prefix) and its own KV. ``keyless``: the owner is a caller's keyless
        owner; ``blocks``: the prefix blocks of the job's request; ``caller``: the
        job's caller when its owner shares prefixes with the caller's other owners.
        """
        entry = self._pinned(slot, job)
        entry.last_used = self._advance()
        if session is None:
            entry.hold(Content.KEYLESS)
        else:
            entry.hold(Content.OWNED, session, keyless=keyless, blocks=blocks, caller=caller)

    def _pinned(self, slot: int, job: object) -> SlotEntry:
        if not 0 <= slot < len(self.slots):
            raise IndexError(f"slot {slot} is not in this table of {len(self.slots)}")
        entry = self.slots[slot]
        if entry.pin is not job:
            raise AssertionError(f"slot {slot} is not pinned to {job!r} (pinned: {entry.pin!r})")
        return entry

    # ------------------------------------------------------------------ reconciliation

    def reconcile(self, busy: Iterable[int], *, sampled_at: int) -> list[int]:
        """Apply a ``/slots`` sample requested at tick ``sampled_at``.

        A slot the engine reports busy that no job of ours holds, and that was not
        released after the sample was requested, runs work the host did not send:
        it becomes ``UNKNOWN`` and is held out. A held-out slot the engine reports
        idle is released (still ``UNKNOWN``: erased before use). Returns the slot
        ids newly held out.
        """
        busy_ids = set(busy)
        newly: list[int] = []
        for entry in self.slots:
            if entry.id in busy_ids:
                if entry.pin is None and entry.saving is None and entry.released <= sampled_at:
                    if not entry.held_out:
                        newly.append(entry.id)
                    entry.held_out = True
                    entry.hold(Content.UNKNOWN)
            elif entry.held_out:
                entry.held_out = False
        return newly

    # ------------------------------------------------------------------ status

    def statistics(self) -> SlotTableStats:
        contents: dict[str, int] = {}
        owners: dict[int, str | None] = {}
        for entry in self.slots:
            contents[entry.content.value] = contents.get(entry.content.value, 0) + 1
            if entry.content is Content.OWNED:
                owners[entry.id] = session_hash(entry.session)
            elif entry.content is Content.KEYLESS:
                owners[entry.id] = None
        return SlotTableStats(
            generation=self.generation,
            slots=len(self.slots),
            pinned=sum(1 for s in self.slots if s.pin is not None),
            held_out=sum(1 for s in self.slots if s.held_out),
            saving=sum(1 for s in self.slots if s.saving is not None),
            contents=contents,
            owners=owners,
        )
