"""NIXL as the data path of a transfer (`--disaggregation-transfer-backend nixl`), the form vLLM's
NIXL connector takes: the decode worker READs each batch's tensors straight out of the prefill
worker's registered memory, over UCX (RDMA where the network has it, shared memory or TCP otherwise).

Each worker holds one NIXL agent for its lifetime, so a pair of workers connects once, not once per
room. The prefill worker registers a batch's tensors and names them in the batch's signed metadata
(its agent's name and metadata, the serialized descriptors); it never waits on the read, and
deregisters them when the room closes. The decode worker checks the descriptors against the sizes
the metadata announces, reads them into one buffer of its own and checks every digest as for any
backend (wire.py). The room's keys, claim and verdict stay on the bootstrap store (transfer.py).

The agents run without NIXL's progress thread, which polls without pause and would take a core
from the engine: the reading side progresses its own transfers while it waits on them, and the
prefill side's agent is progressed by a thread of its own every PUMP_S, only while some batch is
exposed (a read over TCP or shared memory completes only when its target progresses too).

The tensors are host memory on both sides, as the torch.distributed backends deliver them to the
decode worker's engine, which copies them into its pool.
"""
from __future__ import annotations

import base64
import importlib
import logging
import threading
import time
import uuid

import torch

from .wire import TransferError, at_once

logger = logging.getLogger("sparsekv.disagg")

UCX = "UCX"
PUMP_S = 0.001  # the prefill side's pause between two progress calls while a batch is exposed
INSTALL_HINT = "pip install nixl-cu12 (or nixl-cu13, after the torch of your choice)"


def _nixl_api():
    """NIXL's Python API: the `nixl` meta package's, else a CUDA-specific wheel's (the meta package
    needs the one matching this machine's CUDA; on a CPU-only machine either wheel runs over UCX)."""
    for name in ("nixl._api", "nixl_cu13._api", "nixl_cu12._api"):
        try:
            return importlib.import_module(name)
        except ImportError:
            continue
    raise ValueError(f"--disaggregation-transfer-backend nixl needs NIXL, which is not installed: {INSTALL_HINT}")


def nixl_available() -> bool:
    try:
        _nixl_api()
    except ValueError:
        return False
    return True


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


class NixlAgent:
    """A worker's NIXL agent: its memory registrations, the peers it has read from, and one lock
    (the transfer threads share it; NIXL's own thread-sync mode is left at its default)."""

    def __init__(self, role: str):
        api = _nixl_api()
        self.name = f"sparsekv-{role}-{uuid.uuid4().hex[:12]}"
        self.agent = api.nixl_agent(self.name, api.nixl_agent_config(enable_prog_thread=False, backends=[UCX]))
        if UCX not in self.agent.backends:
            raise ValueError("--disaggregation-transfer-backend nixl: NIXL's UCX backend did not start (see NIXL's log)")
        self.lock = threading.Lock()
        self.peers: dict[str, bytes] = {}  # agent name -> its metadata as last loaded
        self.exposed = 0  # registrations of the prefill side not released yet (each room releases its own)
        self.pumping = threading.Condition()
        self.pump, self.progress_calls = None, 0

    def expose(self, tensors: list[torch.Tensor]) -> tuple[dict, object]:
        """Prefill side: register flat uint8 host tensors for a peer to read. Returns what the batch's
        metadata names (agent, its metadata, the descriptors, their sizes) and the registration;
        TransferError if NIXL refuses them (nothing stays registered)."""
        with self.lock:
            try:
                registration = self.agent.register_memory(tensors)
            except Exception as e:  # NIXL's own errors (memory it cannot pin): this room fails
                raise TransferError(f"NIXL could not register the batch's memory: {e}") from None
            try:
                descs = self.agent.get_serialized_descs(self.agent.get_xfer_descs(tensors))
                metadata = self.agent.get_agent_metadata()
            except Exception as e:
                self.agent.deregister_memory(registration)
                raise TransferError(f"NIXL could not describe the batch's memory: {e}") from None
        with self.pumping:
            self.exposed += 1
            self.pumping.notify()
            if self.pump is None:
                self.pump = threading.Thread(target=self._progress, name="sparsekv-nixl-progress", daemon=True)
                self.pump.start()
        return {"agent": self.name, "metadata": _b64(metadata), "descs": _b64(descs),
                "sizes": [t.numel() for t in tensors]}, registration

    def release(self, registration) -> None:
        """Prefill side: the batch is no longer exposed, also when NIXL refuses its deregistration
        (that memory stays pinned; the progress thread must not poll on for it)."""
        try:
            with self.lock:
                self.agent.deregister_memory(registration)
        finally:
            with self.pumping:
                self.exposed -= 1

    def _progress(self) -> None:
        """The prefill side's progress: every PUMP_S while a batch is exposed, asleep otherwise."""
        failing = False
        while True:
            with self.pumping:
                self.pumping.wait_for(lambda: self.exposed > 0)
            with self.lock:
                try:
                    self.agent.get_new_notifs()  # NOTE: progresses the backend's workers; no notification is used
                    failing = False
                except Exception:  # noqa: BLE001 - a thread that ended here would leave every later read unprogressed
                    if not failing:  # once per run of failures: this runs every PUMP_S
                        logger.exception("NIXL progress failed (logged again only after it recovers)")
                    failing = True
                self.progress_calls += 1
            time.sleep(PUMP_S)

    def read(self, remote: dict, sizes: list[int], timeout_s: float, pace=None) -> list[torch.Tensor]:
        """Decode side: the tensors a peer exposed, `sizes` bytes each, read into host memory of this
        worker, one read per tensor, each run through `pace(fn)` (decode.Pacer; at once without
        one); TransferError if the descriptors do not match the sizes, a read fails or takes longer
        than `timeout_s`."""
        try:
            return self._read(remote, sizes, timeout_s, pace or at_once)
        except TransferError:
            raise
        except Exception as e:  # NIXL's own errors (releasing a handle, deregistering): this room fails
            raise TransferError(f"the NIXL read failed: {e}") from None

    def _read(self, remote: dict, sizes: list[int], timeout_s: float, pace) -> list[torch.Tensor]:
        buffer = torch.empty(sum(sizes), dtype=torch.uint8)
        parts = list(buffer.split(sizes))
        with self.lock:
            registration = self.agent.register_memory(buffer)
        try:
            name, peer, descs = self._remote(remote, sizes)
            deadline = time.monotonic() + timeout_s
            for i, part in enumerate(parts):
                pace(lambda: self._read_one(name, peer, part, descs[i], deadline))
        finally:
            with self.lock:
                self.agent.deregister_memory(registration)
        return parts

    def _remote(self, remote: dict, sizes: list[int]):
        """The peer's agent (loaded), its name and the exposed tensors' descriptors, checked against `sizes`."""
        try:
            name, metadata = str(remote["agent"]), base64.b64decode(remote["metadata"])
            serialized = base64.b64decode(remote["descs"])
        except (KeyError, TypeError, ValueError):
            raise TransferError("the prefill worker's NIXL descriptors are malformed") from None
        with self.lock:
            try:
                peer = self._peer(name, metadata)
                descs = self.agent.deserialize_descs(serialized)
                descs = [descs[i] for i in range(descs.descCount())]
            except Exception as e:  # NIXL's own errors: metadata or descriptors it cannot take
                self.peers.pop(name, None)  # NOTE: reloaded from the next batch (_peer)
                raise TransferError(f"the NIXL descriptors from {name} could not be loaded: {e}") from None
        lengths = [d[1] for d in descs]
        if lengths != sizes:
            raise TransferError(f"the prefill worker exposed {lengths} bytes for tensors of {sizes}")
        return name, peer, descs

    def _read_one(self, name: str, peer: bytes, part: torch.Tensor, desc: tuple, deadline: float) -> None:
        with self.lock:
            try:
                handle = self.agent.initialize_xfer("READ", self.agent.get_xfer_descs([part]),
                                                    self.agent.get_xfer_descs([tuple(desc)], "DRAM"), peer)
                self.agent.transfer(handle)  # NOTE: its state ("ERR" included) is read again by _wait
            except Exception as e:  # NIXL's own errors: a stale peer, descriptors it cannot reach
                self.peers.pop(name, None)  # NOTE: reloaded from the next batch (_peer)
                raise TransferError(f"the NIXL read from {name} could not start: {e}") from None
        try:
            self._wait(handle, name, deadline)
        finally:
            with self.lock:
                self.agent.release_xfer_handle(handle)

    def _wait(self, handle, name: str, deadline: float) -> None:
        pause = 1e-4
        while True:
            with self.lock:
                state = self.agent.check_xfer_state(handle)
            if state == "DONE":
                return
            if state == "ERR":
                with self.lock:
                    self.peers.pop(name, None)  # NOTE: reloaded from the next batch (_peer)
                raise TransferError(f"the NIXL read from {name} failed (the prefill worker gone?)")
            if time.monotonic() > deadline:
                raise TransferError(f"the NIXL read from {name} did not end within the transfer timeout")
            time.sleep(pause)
            pause = min(2 * pause, 0.005)

    def _peer(self, name: str, metadata: bytes) -> bytes:
        """The peer's agent, loaded from its metadata whenever that changed (each registration of the
        peer's adds to it; loading it again updates a known agent). Never removed: that would break
        another room's read in flight from the same peer."""
        if self.peers.get(name) != metadata:
            self.agent.add_remote_agent(metadata)
            self.peers[name] = metadata
        return name.encode()


class NixlSender:
    """The prefill side of a room over NIXL: each batch's tensors registered until the room closes."""

    needs_connect = False  # the agents know each other from the metadata: no rendezvous per room

    def __init__(self, agent: NixlAgent):
        self.agent, self.exposed = agent, []  # (registration, the tensors it keeps alive)

    def offer(self, tensors: list[torch.Tensor]) -> dict:
        names, registration = self.agent.expose(tensors)
        self.exposed.append((registration, tensors))
        return {"nixl": names}

    def push(self, tensors: list[torch.Tensor], first: int) -> None:
        """Nothing to do: the decode worker reads what `offer` exposed."""

    def close(self) -> None:
        for registration, _ in self.exposed:
            try:
                self.agent.release(registration)
            except Exception:  # NOTE: a failed deregistration leaves the memory pinned, nothing else
                pass
        self.exposed = []


class NixlReceiver:
    needs_connect = False  # the agents know each other from the metadata: no rendezvous per room

    def __init__(self, agent: NixlAgent, timeout_s: float):
        self.agent, self.timeout_s = agent, timeout_s

    def pull(self, meta: dict, sizes: list[int], first: int, pace=None) -> list[torch.Tensor]:
        """The batch's tensors, a read each, paced by `pace` (decode.Pacer)."""
        remote = meta.get("nixl")
        if not isinstance(remote, dict):
            raise TransferError("the prefill worker named NIXL but no descriptors")
        return self.agent.read(remote, sizes, self.timeout_s, pace)

    def close(self) -> None:
        pass
