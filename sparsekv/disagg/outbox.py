"""The prefill side of a room's transfer: its signed metadata batches under the room's keys, each
followed by its tensors over the room's data path (decode.py's `Inbox` is the other side)."""
from __future__ import annotations

from .transfer import Room, as_sent, meta_key, sender
from .wire import TransferError, as_bytes, sign, tensor_specs


def as_published(secret: bytes, meta: dict, stacked: list, first_tag: int) -> list:
    """A batch's tensors as they go (contiguous bytes, from tag `first_tag`); `meta` gets their specs."""
    meta["tensors"] = tensor_specs(secret, stacked)
    return as_sent([as_bytes(t) for t in stacked], first_tag)


class Batches:
    """The prefill side of a room: its metadata batches (`meta/0`, `meta/1`, ...), each followed by
    its tensors over the room's data path (transfer.sender, made at the first tensor, kept for the room).
    `rank`: the data-parallel rank > 0 that publishes and sends them instead (dp_send.py), None: this
    process."""

    def __init__(self, link: Room, settings, device, agent):
        self.link, self.settings, self.device, self.agent = link, settings, device, agent
        self.index, self.tags, self.path = 0, 0, None
        self.rank: int | None = None
        self.claimed = self.told_error = self.ended = self.sending = False

    @property
    def peer_waiting(self) -> bool:
        """A decode worker claimed the room and waits for the metadata of a batch still to come (not
        while a batch's tensors move: a send that fails there fails its receive too)."""
        return self.claimed and not self.ended and not self.sending

    def publish(self, meta: dict, stacked: list) -> list:
        """Publish one batch's signed metadata; returns its tensors as they go (contiguous bytes), for
        `push` once the data path is connected (`path.needs_connect`: the decode worker joins it when
        it reads the metadata)."""
        secret = self.settings.secret
        tensors = as_published(secret, meta, stacked, self.tags)
        if tensors and self.path is None:
            self.path = sender(meta["backend"], self.link, self.settings, self.device, self.agent)
        if tensors:
            meta.update(self.path.offer(tensors))
        self.link.put(meta_key(self.index), sign(secret, meta))
        self.published(meta, tensors)
        return tensors

    def published(self, meta: dict, tensors: list) -> None:
        """A batch's metadata is in the store (put here or by the rank that sends it), its `tensors` to follow."""
        self.index += 1
        self.ended = bool(meta["last"])
        self.sending = bool(tensors)

    def push(self, tensors: list) -> int:
        """Send the published batch's tensors; returns their bytes."""
        if tensors:
            self.path.push(tensors, self.tags)
        return self.pushed(len(tensors), sum(t.numel() for t in tensors))

    def pushed(self, count: int, nbytes: int) -> int:
        """The published batch's `count` tensors of `nbytes` were sent (here or by the rank that sends
        them); returns `nbytes`."""
        self.tags += count
        self.sending = False
        return nbytes

    def answered(self) -> bool:
        """Whether the decode worker wrote its verdict (before the last batch only when it failed);
        it then waits for nothing more."""
        if self.link.ready("done"):
            self.ended = True
            return True
        return False

    def refused(self) -> bool:
        """Whether the decode worker wrote its verdict (False when the store is gone too)."""
        try:
            return self.answered()
        except TransferError:
            return False

    def error_unless_answered(self, reason: str) -> None:
        try:
            if self.answered():
                return
        except TransferError:  # the store is gone: nobody reads an error
            return
        self.error({"error": reason})

    def error(self, failure: dict) -> None:
        """Let a decode worker waiting on the room fail now rather than at its timeout. `failure`: the
        batch metadata that says why (`error`; for the prefill's own refusal of the request its
        `status` below 500 and `param`, which the decode worker answers with as one server would).
        The decode worker deletes the room's keys once it has read it; one that left the room before
        (its claim deleted first: `Room.forget`), or never claimed it, never reads it, so then this
        side deletes them (a decode worker that claims later waits for the error until its own
        timeout, or until its client goes away); as it does when the decode worker's verdict is there
        after the put (it failed the room meanwhile, and reads nothing more: decode._verdict)."""
        try:
            meta = {"room": self.link.name, **failure}
            self.link.put(meta_key(self.index), sign(self.settings.secret, meta))
            self.told_error, self.ended = True, True
            if not self.link.written_by_peer("claim") or self.link.ready("done"):
                self.link.forget(self.index + 1)
        except TransferError:
            pass

    def close(self) -> None:
        if self.path is not None:
            self.path.close()
