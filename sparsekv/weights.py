"""Weight updates without a restart: check an update whole, then load it into the running model.

An update is plain data, checked on rank 0 before anything changes (`check_tensor_update`,
`check_disk_update`): every name must be one of the loaded model's tensors, every shape the whole
tensor's, an FP8 weight must come with its `weight_scale_inv` (and a scale with its weight). A bad
update raises `WeightUpdateError` and the old weights keep serving.

Applying it (`WeightSource.apply`, on every rank, each on its own slices) goes part by part (a
decoder layer, the MTP layer, the embedding, final norm and head): it builds the part from the new
tensors with the model's own constructor, on the host, then copies every tensor of it into the running
part in place (`copy_weights`) and drops it. Derived tensors (fused gate/up, transposed latent
projections, fp32 router copies) are thus made exactly as a fresh load makes them, the running model
keeps its identity (the runner, the drafter, the cache and its selectors hold the same objects), and an
update holds one part's new weights at a time besides the model, never a second model. A failure while
reading or building a part puts back the parts copied before it, from the weights before the update;
only if that fails too (the checkpoint they came from changed or cannot be read) does the engine stop
serving (`WeightRestoreError`).

A partial in-process update needs the tensors it leaves out: they are read again from the checkpoint
the engine loaded (refused if that directory changed since), plus the tensors earlier in-process
updates gave (`overlay`, host memory; an update from disk clears it). Without that host copy
(`keep_host_copy` off) only the names those updates replaced are kept (`replaced`): a partial update
leaving one of them out of a part it touches is refused, and a part they replaced cannot be put back.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace
from functools import partial

import torch

from .config import ModelConfig, overrides_indexer_schedule
from .model.checkpoint import (CheckpointError, as_stored, check_header, check_names, check_stored_format,
                               checkpoint_listing, dequantize_fp8, expected_shapes, files_stamp, list_tensor_files,
                               load_tensors, mtp_shapes)
from .parallel.launch import RankFailure

logger = logging.getLogger("sparsekv.engine")

SCALE_SUFFIX = "_scale_inv"
# attributes of the model's objects that hold no weights: per-request and per-slot state (selectors,
# Quest bounds), scratch buffers, the collectives, the routed-expert recorder, the config (and the
# checkpoint's stamp at the load)
NOT_WEIGHTS = frozenset({"selector", "comm", "scratch", "index_scratch", "record", "cfg", "policy", "loaded_stamp"})


class WeightUpdateError(ValueError):
    """A weight update refused whole (unknown name, wrong shape, FP8 weight without its scale, another
    architecture); the message names the tensors. The old weights keep serving."""


class WeightUpdateConflict(RuntimeError):
    """A weight update that cannot start now (another is waiting; generation is paused with requests
    that must finish under the old weights). Nothing changed."""


class WeightLoadError(RuntimeError):
    """A checked weight update that failed to load (I/O, memory; on every rank that tried): the old
    weights keep serving. `aborted`: the final outputs of the requests the "abort" policy ended before
    the load, which the caller must still deliver to their clients."""

    def __init__(self, message: str, aborted: list | None = None):
        super().__init__(message)
        self.aborted = list(aborted or [])


class WeightRestoreError(RankFailure):
    """A weight update failed part-way and the parts it had loaded could not be put back: the model
    holds parts of two versions, so the engine serves no more (as after a rank failure)."""


WEIGHT_UPDATE_POLICIES = ("drain", "abort")


@dataclass
class TensorUpdate:
    """Tensors by Hugging Face name, whole (not sliced), FP8 already dequantised, on the host.
    `owned`: nobody but the engine holds them (received from a trainer, or copied), so what loads
    them keeps them as they are."""

    tensors: dict[str, torch.Tensor]
    owned: bool = field(default=False, kw_only=True)

    def kept_for_later(self) -> "TensorUpdate":
        """This update as it is now, for a drain that loads it later: the caller's tensors copied (a
        trainer may step them in place meanwhile); its own as they are."""
        if self.owned:
            return self
        return replace(self, tensors={n: t.clone() for n, t in self.tensors.items()}, owned=True)


@dataclass
class ReceivedUpdate(TensorUpdate):
    """An update a trainer broadcast over its group `group` (weight_sync.py): rank 0's tensors; every
    other engine rank received its own copy and loads that (`received_here`), so the command that
    tells the ranks to load carries none (`for_other_ranks`)."""

    group: str = ""
    ticket: int = 0  # rank 0's number of the update over the group (weight_sync.WorkerGroups)
    owned: bool = field(default=True, kw_only=True)  # received by the engine: nobody else holds them

    def for_other_ranks(self) -> "ReceivedUpdate":
        return ReceivedUpdate({}, self.group, self.ticket)

    def taken_here(self) -> list:
        """On a worker rank: the (name, tensor) pairs it received for this update itself."""
        from .weight_sync import WORKER_GROUPS
        return WORKER_GROUPS.take(self.group, self.ticket)


def received_here(update: ReceivedUpdate, shapes: dict[str, tuple]) -> ReceivedUpdate:
    """On a worker rank: the tensors it received for `update` itself, checked as rank 0 checked its own."""
    return ReceivedUpdate(check_tensor_update(shapes, update.taken_here()).tensors, update.group, update.ticket)


@dataclass(frozen=True)
class DiskUpdate:
    """A whole checkpoint directory of the same architecture, checked by its headers."""

    path: str


def model_weight_shapes(model) -> dict[str, tuple]:
    """Every tensor name the running model was loaded from, with the whole tensor's shape."""
    cfg = model.cfg
    shapes = expected_shapes(cfg, tie_lm_head=model.lm_head is model.embed)
    if model.mtp is not None:
        required, optional = mtp_shapes(cfg)
        shapes.update(required)
        p = f"model.layers.{cfg.num_hidden_layers}"
        shapes.update({k: v for k, v in optional.items()
                       if (k == f"{p}.embed_tokens.weight" and model.mtp.embed is not None)
                       or (k == f"{p}.shared_head.head.weight" and model.mtp.head is not None)})
    return shapes


def _names(items, limit: int = 6) -> str:
    items = sorted(items)
    return ", ".join(items[:limit]) + (f" (+{len(items) - limit} more)" if len(items) > limit else "")


def check_tensor_update(shapes: dict[str, tuple], named_tensors) -> TensorUpdate:
    """An iterable of (name, tensor) checked against the model's `shapes`; FP8 weights dequantised."""
    given: dict[str, torch.Tensor] = {}
    for item in named_tensors:
        if not (isinstance(item, (tuple, list)) and len(item) == 2 and isinstance(item[0], str)
                and isinstance(item[1], torch.Tensor)):
            raise WeightUpdateError("update_weights takes an iterable of (name, torch.Tensor) pairs")
        name, tensor = item
        if name in given:
            raise WeightUpdateError(f"tensor {name} is given twice")
        given[name] = tensor.detach()
    if not given:
        raise WeightUpdateError("the update has no tensors")
    given = _as_checkpoint_names(given, shapes)
    scales = {n for n in given if n.endswith(SCALE_SUFFIX)}
    weights = {n: t for n, t in given.items() if n not in scales}
    unknown = set(weights) - set(shapes)
    if unknown:
        raise WeightUpdateError(f"unknown tensor(s) {_names(unknown)}: not in the loaded model")
    orphans = {s for s in scales if s[:-len(SCALE_SUFFIX)] not in weights}
    if orphans:
        raise WeightUpdateError(f"FP8 scale(s) {_names(orphans)} without their weight in the same update")
    wrong = {n: tuple(t.shape) for n, t in weights.items() if tuple(t.shape) != tuple(shapes[n])}
    if wrong:
        raise WeightUpdateError("wrong shape(s): " + ", ".join(
            f"{n} {s}, the model's {tuple(shapes[n])}" for n, s in sorted(wrong.items())[:6]))
    out = {}
    for name, t in weights.items():
        out[name] = _dequantized(name, t, given.get(name + SCALE_SUFFIX))
    return TensorUpdate(out)


# torch's dtypes by safetensors' names (model/checkpoint.py: check_stored_format)
STORED_NAMES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.float64: "F64",
                torch.float8_e4m3fn: "F8_E4M3"}


FUSED_GATE_UP, FUSED_DOWN = ".mlp.experts.gate_up_proj", ".mlp.experts.down_proj"


def _as_checkpoint_names(given: dict[str, torch.Tensor], shapes: dict[str, tuple]) -> dict[str, torch.Tensor]:
    """A transformers model's `state_dict()` in the checkpoint's names: its fused routed experts
    (`experts.gate_up_proj` [E, 2I, D], `experts.down_proj` [E, D, I]) split per expert, and a tied
    `lm_head.weight` (the embedding itself) left out."""
    out = {}
    for name, t in given.items():
        if name.endswith(FUSED_GATE_UP) and t.dim() == 3:
            prefix, inter = name[:-len(FUSED_GATE_UP)] + ".mlp.experts", t.shape[1] // 2
            for e in range(t.shape[0]):
                out[f"{prefix}.{e}.gate_proj.weight"], out[f"{prefix}.{e}.up_proj.weight"] = t[e, :inter], t[e, inter:]
        elif name.endswith(FUSED_DOWN) and t.dim() == 3:
            prefix = name[:-len(FUSED_DOWN)] + ".mlp.experts"
            out.update({f"{prefix}.{e}.down_proj.weight": t[e] for e in range(t.shape[0])})
        else:
            out[name] = t
    head, embed = out.get("lm_head.weight"), out.get("model.embed_tokens.weight")
    if head is not None and "lm_head.weight" not in shapes:
        if embed is None or not torch.equal(head, embed):
            raise WeightUpdateError("lm_head.weight: this model ties it to model.embed_tokens.weight; give that "
                                    "(lm_head.weight may come too, equal to it)")
        del out["lm_head.weight"]
    return out


def _dequantized(name: str, t: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    try:
        check_stored_format("the update", name, STORED_NAMES.get(t.dtype, str(t.dtype)), tuple(t.shape),
                            None if scale is None else tuple(scale.shape))
        return dequantize_fp8(t.cpu(), scale.cpu(), name) if t.dtype == torch.float8_e4m3fn else t.cpu()
    except CheckpointError as e:
        raise WeightUpdateError(str(e)) from None


def check_disk_update(path: str, cfg: ModelConfig, overrides: dict | None, shapes: dict[str, tuple]) -> DiskUpdate:
    """A checkpoint directory of the same architecture holding exactly the model's tensors, checked by
    config.json and the safetensors headers (shapes, FP8 scales) without reading the weights."""
    from safetensors import SafetensorError
    try:
        other = ModelConfig.from_json(path, overrides)
        files = list_tensor_files(path)
        want = check_names(other, set(files), path, overrides_indexer_schedule(overrides))
    except (OSError, ValueError, KeyError, SafetensorError) as e:  # the last: a file that is not safetensors
        raise WeightUpdateError(f"{path}: {e}") from None
    # NOTE: not its quantization: FP8 weights are dequantised at load, into the same model
    fields = [f for f in cfg.__dataclass_fields__ if f != "quantization" and getattr(cfg, f) != getattr(other, f)]
    if fields:
        raise WeightUpdateError(f"{path}: another architecture; config fields differ: {', '.join(fields)}")
    if set(want) != set(shapes):
        raise WeightUpdateError(f"{path}: its tensors differ from the loaded model's: missing "
                                f"{_names(set(shapes) - set(want)) or 'none'}; extra {_names(set(want) - set(shapes)) or 'none'}")
    _check_headers(path, files, want)
    return DiskUpdate(path)


def _check_headers(path: str, files: dict[str, str], want: dict[str, tuple]) -> None:
    handles = {}
    try:
        for name, shape in want.items():
            check_header(files, name, shape, handles, path)
    except CheckpointError as e:
        raise WeightUpdateError(str(e)) from None
    finally:
        handles.clear()


def without_frames(error: BaseException | None) -> BaseException | None:
    """`error` to keep, its tracebacks dropped (along its causes): their frames would keep alive what
    the failed load held, a copy of the weights and the files' mappings among it."""
    seen, e = set(), error
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        e.__traceback__ = None
        e = e.__cause__ or e.__context__
    return error


class UpdateOutcomes:
    """Each accepted weight update's result, by its ticket (the count of updates accepted so far), for
    whoever waits for that update (the server's /update_weights_from_disk): (weights_version, None) once
    it loaded, (None, the error) if it failed. One update at a time can wait to load, so the one that
    settles is always the last accepted. The last KEEP results are kept."""

    KEEP = 64

    def __init__(self):
        self.accepted = 0
        self._settled: dict[int, tuple] = {}

    def accept(self) -> int:
        self.accepted += 1
        return self.accepted

    def settle(self, version: int | None, error: BaseException | None) -> None:
        self._settled[self.accepted] = (version, without_frames(error))
        while len(self._settled) > self.KEEP:
            del self._settled[min(self._settled)]

    def outcome(self, ticket: int) -> tuple | None:
        """The update's (version, error), or None while it waits to load."""
        return self._settled.get(ticket)


class WeightSource:
    """Where one rank's weights came from: the checkpoint directory it loaded (and its files then),
    and the tensors in-process updates gave since (this rank's slices, on the host)."""

    def __init__(self, path: str, overrides: dict | None, dtype: torch.dtype, layout=None, identity: list | None = None,
                 keep_host_copy: bool = True):
        """`identity`: the checkpoint's `files_stamp` taken before its weights were read (`load_model`'s),
        so that files written while the engine loaded count as changed since. `keep_host_copy`: keep the
        tensors in-process updates gave (`overlay`); else only their names (`replaced`)."""
        self.path, self.overrides, self.dtype, self.layout = path, overrides, dtype, layout
        self.identity = identity if identity is not None else files_stamp(path)
        self.keep_host_copy = keep_host_copy
        self.overlay: dict[str, torch.Tensor] = {}
        self.replaced: set[str] = set()  # without the host copy: names in-process updates replaced since the load

    def apply(self, model, update: TensorUpdate | DiskUpdate) -> None:
        """Load the update part by part (`model.part_of`: a decoder layer, the MTP layer, the ends):
        each part's tensors read or taken, the part built beside the running one on the host and copied
        in, then dropped, so that an update holds one part's new weights at a time, never a second
        model. An in-process update rebuilds only the parts its tensors touch. A failure part-way puts
        the parts copied so far back from the weights before the update (`_restore`)."""
        source = (self.path, self.identity)
        if isinstance(update, DiskUpdate):
            # NOTE: stamped before the reads: files written while they run count as changed since the load
            source, overlay, parts = (update.path, files_stamp(update.path)), {}, self._parts(model, None)
            listing = checkpoint_listing(update.path, model.cfg, bool(self.overrides))
            tensors_of = partial(self._read, model, update.path, listing=listing)
        else:
            self.check(model, update)  # NOTE: again at the load: a drain update loads well after its check
            mine = {n: self._slice(n, t, model.cfg, update.owned) for n, t in update.tensors.items()
                    if self._holds(n, model.cfg)}
            overlay, parts = {**self.overlay, **mine}, self._parts(model, set(mine))
            tensors_of = self._tensors_from(model, overlay)
        copied: list = []
        try:
            for part, names in parts:
                copy_part(model, part, tensors_of(names))
                copied.append((part, names))
        except Exception as e:
            self._restore(model, copied, e)
            raise
        self._settle(source, overlay, update)

    def _settle(self, source: tuple, overlay: dict[str, torch.Tensor], update) -> None:
        """After a load: where the weights now come from, and what later partial updates build from."""
        (self.path, self.identity) = source
        if isinstance(update, DiskUpdate):
            self.overlay, self.replaced = {}, set()
        elif self.keep_host_copy:
            self.overlay = overlay
        else:
            self.replaced |= set(update.tensors)

    def _parts(self, model, touched: set[str] | None) -> list[tuple[int | str, set[str]]]:
        """(part, the names of this rank's tensors that build it) for every part of the model, or for
        those holding a name in `touched`."""
        from .model.model import part_of
        cfg, by_part = model.cfg, {}
        for name in model_weight_shapes(model):
            if self._holds(name, cfg):
                by_part.setdefault(part_of(name, cfg.num_hidden_layers), set()).add(name)
        return [(part, names) for part, names in by_part.items() if touched is None or names & touched]

    def _tensors_from(self, model, overlay: dict[str, torch.Tensor]):
        """names -> their tensors: the overlay's, the others read from the loaded checkpoint."""
        listing = []  # listed at the first read

        def tensors_of(names: set[str]) -> dict[str, torch.Tensor]:
            missing = {n for n in names if n not in overlay}
            if missing and not listing:
                listing.append(checkpoint_listing(self.path, model.cfg, bool(self.overrides)))
            read = self._read(model, self.path, missing, listing[0]) if missing else {}
            return {**read, **{n: overlay[n] for n in names if n in overlay}}
        return tensors_of

    def _read(self, model, path: str, names: set[str], listing) -> dict[str, torch.Tensor]:
        return load_tensors(path, model.cfg, self.dtype, torch.device("cpu"), bool(self.overrides), self.layout,
                            only=names, listing=listing)

    def _restore(self, model, copied: list, error: Exception) -> None:
        """Put the parts an update copied before it failed back to the weights before it (the loaded
        checkpoint, unchanged on disk since, and the overlay), the same way. If that fails too, this
        rank's weights are a mix of two versions: WeightRestoreError, and the engine serves no more."""
        if not copied:
            return
        try:
            lost = {n for _, names in copied for n in names} & self.replaced
            if lost:
                raise WeightUpdateError(f"earlier in-process updates replaced {_names(lost)} and this engine keeps no "
                                        f"host copy of them (weight_update_host_copy off)")
            reads = any(n not in self.overlay for _, names in copied for n in names)
            if reads and self._changed_on_disk():
                raise WeightUpdateError(f"{self.path}, the checkpoint this engine loaded, changed on disk since")
            tensors_of = self._tensors_from(model, self.overlay)
            for part, names in copied:
                copy_part(model, part, tensors_of(names))
        except Exception as e:
            raise WeightRestoreError(f"the weight update failed part-way ({error!r}) and the weights before it "
                                     f"could not be put back ({e!r}): this rank's model holds parts of both, and "
                                     f"the engine serves no more") from e
        logger.warning("the weight update failed part-way; the %d part(s) it had loaded were put back", len(copied))

    def _changed_on_disk(self) -> bool:
        """Whether the loaded checkpoint's files differ from when it was loaded (a directory gone too)."""
        try:
            return files_stamp(self.path) != self.identity
        except OSError:
            return True

    @staticmethod
    def _left_out(model, given: set[str]) -> set[str]:
        """The model's tensors (every rank's names) in the parts `given` touches that it does not give."""
        from .model.model import part_of
        layers = model.cfg.num_hidden_layers
        touched = {part_of(n, layers) for n in given}
        return {n for n in model_weight_shapes(model) if part_of(n, layers) in touched} - given

    def _holds(self, name: str, cfg) -> bool:
        return self.layout is None or self.layout.holds(name, cfg)

    def _slice(self, name: str, given: torch.Tensor, cfg, owned: bool = False) -> torch.Tensor:
        """This rank's slice of a given tensor as the model keeps it, in memory of its own when the
        overlay keeps it: the overlay outlives the update, and a view would follow the caller's tensor
        (a trainer's parameter, stepped in place) and keep the whole of it alive for a slice. `owned`:
        nobody else holds the tensor (a trainer's broadcast received, a drain's copy), so a whole one is
        kept as it is. Without the host copy nothing outlives the update, which reads views."""
        t, shard = given, self.layout.shard(name, tuple(given.shape)) if self.layout is not None else None
        if shard is not None:
            dim, start, end = shard
            t = t.narrow(dim, start, end - start)
        kept = as_stored(name, t, self.dtype, torch.device("cpu"))
        shared = kept.untyped_storage().data_ptr() == given.untyped_storage().data_ptr()
        return kept.clone() if shared and self.keep_host_copy and not (owned and shard is None) else kept

    def check(self, model, update) -> None:
        """A partial in-process update reads the tensors it leaves out from the loaded checkpoint:
        refused if that directory changed since it was loaded (checked when given, and at the load), and
        without the host copy if it leaves out, in a part it touches, one that earlier updates replaced."""
        if isinstance(update, DiskUpdate):
            return
        unkept = self._left_out(model, set(update.tensors)) & self.replaced
        if unkept:
            raise WeightUpdateError(f"this update leaves out {_names(unkept)}, which earlier in-process updates "
                                    f"replaced, and this engine keeps no host copy of them (weight_update_host_copy "
                                    f"off): give every tensor of the parts it touches (a decoder layer, the MTP "
                                    f"layer, the embedding, final norm and head), or update from disk")
        if not set(model_weight_shapes(model)) - set(self.overlay) - set(update.tensors):
            return
        if self._changed_on_disk():
            raise WeightUpdateError(f"{self.path}: the checkpoint this engine loaded changed on disk since, so the "
                                    f"tensors this update leaves out cannot be read back; give every tensor, "
                                    f"or update from disk")


def copy_part(model, part: int | str, tensors: dict[str, torch.Tensor]) -> int:
    """Build `part` of `model` from `tensors` on the host, as a load builds it, and copy it into the
    running part in place (`copy_weights`)."""
    from .model.indexer import ScoreScratch
    return copy_weights(model.part(part), model.build_part(part, tensors, ScoreScratch()), f"model part {part}")


def copy_weights(model, fresh, where: str = "model") -> int:
    """Copy every tensor of `fresh` (a model, or a part of one, built like `model` from other weights)
    into the same place of `model`, in place. Pairs are found by walking both object graphs in step;
    any difference of structure, shape or dtype raises before anything is copied. Returns how many
    tensors were copied.

    One difference is allowed: a part the running model has and `fresh` lacks (None there), when its
    tensors are all views of tensors copied anyway. The fresh model is built on the host, and a part
    that depends on the device (experts stacked for a grouped GEMM that the host may lack, whose
    experts hold views of the stack) is then updated through those views."""
    pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
    unpaired: list[tuple[str, object]] = []
    _pair(model, fresh, where, pairs, set(), unpaired)
    _check_views(pairs, unpaired)
    with torch.no_grad():
        for old, new in pairs:
            old.copy_(new)
    return len(pairs)


def _pair(old, new, where: str, pairs: list, seen: set, unpaired: list) -> None:
    if isinstance(old, torch.Tensor) or isinstance(new, torch.Tensor):
        if not (isinstance(old, torch.Tensor) and isinstance(new, torch.Tensor)) or \
                old.shape != new.shape or old.dtype != new.dtype:
            raise WeightUpdateError(f"{where}: the updated model's tensor does not match the running one's "
                                    f"({_describe(new)} against {_describe(old)})")
        pairs.append((old, new))
        return
    if id(old) in seen:
        return
    if isinstance(old, (list, tuple)):
        if not isinstance(new, (list, tuple)) or len(old) != len(new):
            raise WeightUpdateError(f"{where}: the updated model's structure differs from the running one's")
        seen.add(id(old))
        for i, (a, b) in enumerate(zip(old, new)):
            _pair(a, b, f"{where}[{i}]", pairs, seen, unpaired)
        return
    if isinstance(old, dict):
        if not isinstance(new, dict) or old.keys() != new.keys():
            raise WeightUpdateError(f"{where}: the updated model's structure differs from the running one's")
        seen.add(id(old))
        for key in old:
            _pair(old[key], new[key], f"{where}[{key!r}]", pairs, seen, unpaired)
        return
    if not type(old).__module__.startswith("sparsekv.model"):
        return  # plain values, functions, collectives: nothing to copy
    if new is None:
        unpaired.append((where, old))
        return
    if type(old) is not type(new):
        raise WeightUpdateError(f"{where}: {type(new).__name__} against {type(old).__name__}")
    seen.add(id(old))
    for name, value in vars(old).items():
        if name not in NOT_WEIGHTS:
            _pair(value, vars(new).get(name), f"{where}.{name}", pairs, seen, unpaired)


def _check_views(pairs: list, unpaired: list) -> None:
    """Every tensor of a running part that the fresh model lacks shares its memory with a tensor copied."""
    copied = {old.untyped_storage().data_ptr() for old, _ in pairs}
    for where, part in unpaired:
        found: list = []
        _pair(part, part, where, found, set(), [])
        alone = [t for t, _ in found if t.untyped_storage().data_ptr() not in copied]
        if alone:
            raise WeightUpdateError(f"{where}: the updated model has no such part, and it holds weights of its "
                                    f"own ({_describe(alone[0])}) that the update would leave stale")


def _describe(t) -> str:
    return f"{tuple(t.shape)} {t.dtype}" if isinstance(t, torch.Tensor) else type(t).__name__
