"""Training data: the interpreter's own stdlib sources (train / held-out split), retrieval documents
mixed in, and PoSE position ids.

Split: a file is held out when crc32(its path relative to the stdlib) % 20 == 0 (about 5%); the
split depends only on the path, so it is the same on every machine with the same Python.

Position ids (stage 5 of the issue) use PoSE (Zhu et al., 2023): a training row of S tokens is cut
into two chunks and the second chunk's position ids are shifted by a skip u, so relative distances
up to `pose_max_position` are seen while only S tokens are computed. u is log-uniform, so every
scale from S to 1M gets training signal; a fraction of rows keeps contiguous positions.
"""
from __future__ import annotations

import itertools
import math
import os
import random
import sysconfig
import zlib
from dataclasses import dataclass

import torch

from .tasks import TaskBuilder, new_caches

EXCLUDED_DIRS = ("site-packages", "test", "tests", "idle_test")


def stdlib_files(root: str | None = None) -> list[str]:
    """Relative paths of the stdlib's .py files (tests and site-packages excluded), sorted."""
    root = root or sysconfig.get_paths()["stdlib"]
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in EXCLUDED_DIRS and not d.startswith("."))
        out += [os.path.relpath(os.path.join(dirpath, f), root) for f in filenames if f.endswith(".py")]
    return sorted(out)


def is_heldout(rel_path: str) -> bool:
    return zlib.crc32(rel_path.encode()) % 20 == 0


def read_split(root: str | None = None, max_files: int | None = None) -> tuple[list[str], list[str]]:
    """(train texts, held-out texts)."""
    root = root or sysconfig.get_paths()["stdlib"]
    files = stdlib_files(root)
    train = [f for f in files if not is_heldout(f)]
    heldout = [f for f in files if is_heldout(f)]
    if max_files is not None:   # a small but still split corpus (tests)
        train, heldout = train[:max_files], heldout[:max(1, max_files // 10)]

    def read(rel: str) -> str:
        with open(os.path.join(root, rel), encoding="utf-8", errors="replace") as f:
            return f.read()
    return [read(f) for f in train], [read(f) for f in heldout]


def tokenize_stream(tok, texts: list[str], eos_id: int) -> torch.Tensor:
    ids: list[int] = []
    for enc in tok.encode_batch(texts, add_special_tokens=False):
        ids += enc.ids + [eos_id]
    return torch.tensor(ids, dtype=torch.int32)


@dataclass
class FarNegatives:
    """Negatives for one full layer's indexer (the `far` stage): row b's negative j is input token
    `source[b, j]` (a flat index into the batch's [B, S] inputs) at position `positions[b, j]`; the
    indexer scores it from its own input at that token, and each stands for exp(`log_weight`)
    positions of a long context. Far copies (`far_copies`) lie behind every query of the row;
    haystack negatives (`haystack_negatives`) sit at the row's own positions, and query i sees
    negative j only when i > `after[b, j]`."""
    source: torch.Tensor     # [B, M] int64
    positions: torch.Tensor  # [B, M] int64 (may be negative: only distances matter to RoPE)
    log_weight: float        # log(context / M)
    after: torch.Tensor | None = None   # [B, M] row index after which a haystack negative is seen

    def to(self, device) -> "FarNegatives":
        after = None if self.after is None else self.after.to(device)
        return FarNegatives(self.source.to(device), self.positions.to(device), self.log_weight, after)


@dataclass
class Batch:
    ids: torch.Tensor        # [B, S+1] int64; inputs are ids[:, :-1], targets ids[:, 1:]
    positions: torch.Tensor  # [B, S]
    weights: torch.Tensor    # [B, S] loss weight per target (answers weigh more)
    far: dict[int, FarNegatives] | None = None   # full layer -> its far negatives (the `far` stage)

    def to(self, device) -> "Batch":
        far = None if self.far is None else {layer: f.to(device) for layer, f in self.far.items()}
        return Batch(self.ids.to(device), self.positions.to(device), self.weights.to(device), far)


def far_copies(batch_size: int, seq_len: int, first_positions: torch.Tensor, count: int,
               min_distance: int, context: int, seed: str) -> FarNegatives:
    """Layer 0's negatives, `count` per row: half of them tokens of the row itself (so far copies of
    its own tokens), half of any row, at log-uniform distances in [min_distance, context] before the
    row. Layer 0's indexer sees only the token, so a far copy is exact."""
    g = torch.Generator().manual_seed(zlib.crc32(seed.encode()))
    own = torch.randint(0, seq_len, (batch_size, count // 2), generator=g) + \
        torch.arange(batch_size)[:, None] * seq_len
    other = torch.randint(0, batch_size * seq_len, (batch_size, count - count // 2), generator=g)
    lo, hi = math.log(min_distance), math.log(max(context, min_distance + 1))
    distance = torch.exp(torch.rand(batch_size, count, generator=g, dtype=torch.float64) * (hi - lo) + lo)
    positions = first_positions[:, None].long() - distance.round().long()
    return FarNegatives(torch.cat([own, other], 1), positions, math.log(max(context / count, 1.0)))


def haystack_negatives(positions: torch.Tensor, count: int, context: int, haystack: torch.Tensor,
                       seed: str) -> FarNegatives:
    """A later full layer's negatives, `count` per row: tokens of the other rows where `haystack`
    (bool [B, S]) allows, each placed at one of the row's own positions and seen by the queries after
    it, as if the row lay in a context of `context` tokens of other documents. Their hidden states
    are the ones of their own rows (an approximation of a long context's). Placed behind the row
    instead, they teach a distance decay that ends retrieval (docs/training.md, what failed); here
    the distances of negatives and of the row's own keys are the same, so only content separates them."""
    batch_size, seq_len = positions.shape
    g = torch.Generator().manual_seed(zlib.crc32(seed.encode()))
    source = torch.stack([_other_rows(haystack, b, count, g) for b in range(batch_size)])
    after = torch.randint(0, seq_len, (batch_size, count), generator=g)
    return FarNegatives(source, positions.long().gather(1, after), math.log(max(context / count, 1.0)), after)


def _other_rows(haystack: torch.Tensor, row: int, count: int, g: torch.Generator) -> torch.Tensor:
    """`count` flat indices, drawn with replacement, of `haystack` tokens outside row `row`."""
    eligible = haystack.clone()
    eligible[row] = False
    candidates = eligible.reshape(-1).nonzero().squeeze(1)
    if candidates.numel() == 0:
        raise ValueError("haystack negatives need other rows (batch size > 1) with tokens that are not digits")
    return candidates[torch.randint(0, candidates.numel(), (count,), generator=g)]


def pose_positions(seq_len: int, max_position: int, rng: random.Random, plain_frac: float) -> torch.Tensor:
    pos = torch.arange(seq_len)
    if max_position <= seq_len or rng.random() < plain_frac:
        return pos
    cut = rng.randrange(1, seq_len)
    skip = int(math.exp(rng.uniform(0.0, math.log(max_position - seq_len))))
    pos[cut:] += skip
    return pos


STAGES = ("pretrain", "warmup", "sparse", "mtp", "far")   # batch(stage, ...) takes the index


class BatchSource:
    """Deterministic batches: batch (stage, step) depends only on (seed, stage, step).

    `doc_min_frac` < 1 gives each retrieval document a random length in [doc_min_frac, 1] x row
    length, at a random offset inside a window of training code, so that the answer does not sit
    at the same absolute index of every row (a model can learn to copy only there: see
    docs/training.md). 1.0 keeps the original layout (document fills the row, answer at its end).

    Copy warm-up: the first `copy_warmup_steps` steps of stage 0 (pretrain) draw short rows of
    `copy_warmup_seq_len` tokens that are all retrieval documents, with contiguous positions (no
    PoSE): cheap steps with many copy targets, where the induction (copy) circuit forms. A share
    `copy_warmup_repeat_frac` of them are back-to-back repeats of random digit strings (the textbook
    induction task, on the alphabet that pass keys use: `number_tokens`), weighted only on the second copy.
    """

    def __init__(self, tok, train_ids: torch.Tensor, seq_len: int, batch_size: int, seed: int,
                 synth_frac: float = 0.5, pose_max_position: int = 1 << 20, pose_plain_frac: float = 0.2,
                 answer_weight: float = 3.0, doc_min_frac: float = 1.0, copy_warmup_steps: int = 0,
                 copy_warmup_seq_len: int = 128, copy_warmup_repeat_frac: float = 0.0,
                 far_count: int = 0, far_min_distance: int = 512, far_layers: tuple[int, ...] = (0,)):
        if not 0.0 < doc_min_frac <= 1.0:
            raise ValueError(f"doc_min_frac must be in (0, 1], got {doc_min_frac}")
        self.tok, self.train_ids = tok, train_ids
        self.seq_len, self.batch_size, self.seed = seq_len, batch_size, seed
        self.synth_frac, self.answer_weight = synth_frac, answer_weight
        self.pose_max_position, self.pose_plain_frac = pose_max_position, pose_plain_frac
        self.doc_min_frac = doc_min_frac
        self.copy_warmup_steps, self.copy_warmup_seq_len = copy_warmup_steps, copy_warmup_seq_len
        self.copy_warmup_repeat_frac = copy_warmup_repeat_frac
        self.far_count, self.far_min_distance, self.far_layers = far_count, far_min_distance, far_layers
        self.number_tokens = number_tokens(tok)
        self._digit_ids = torch.tensor(self.number_tokens)   # left out of haystack negatives
        self.eos = tok.token_to_id("<|endoftext|>")
        self.caches = new_caches(tok)

    def _code_row(self, rng: random.Random, seq_len: int) -> tuple[list[int], list[float]]:
        n = seq_len + 1
        start = rng.randrange(0, len(self.train_ids) - n)
        return self.train_ids[start:start + n].tolist(), [1.0] * seq_len

    def _document(self, rng: random.Random, length: int) -> tuple[list[int], list[bool]]:
        """A retrieval document of exactly `length` tokens (raises ValueError when it cannot fit)."""
        start = rng.randrange(0, max(len(self.train_ids) - 8 * length, 1))
        builder = TaskBuilder(self.tok, self.train_ids[start:start + 8 * length].tolist(), rng.randrange(1 << 30),
                              self.caches)
        return builder.make_document(length)

    def _task_row(self, rng: random.Random, seq_len: int) -> tuple[list[int], list[float]]:
        n = seq_len + 1
        try:
            if self.doc_min_frac >= 1.0:
                ids, is_answer = self._document(rng, n)
            else:
                m = rng.randint(max(1, math.ceil(self.doc_min_frac * n)), n)
                try:
                    ids, is_answer = self._document(rng, m)
                except ValueError:   # too short for this document: the whole row
                    m = n
                    ids, is_answer = self._document(rng, m)
                k = rng.randint(0, n - m)
                s0 = rng.randrange(0, len(self.train_ids) - (n - m))
                code = self.train_ids[s0:s0 + n - m].tolist()
                ids, is_answer = code[:k] + ids + code[k:], [False] * k + is_answer + [False] * (n - m - k)
        except ValueError:   # rows too short for this document's needles: plain code instead
            return self._code_row(rng, seq_len)
        # target i predicts token i + 1: answers weigh more
        return ids, [self.answer_weight if a else 1.0 for a in is_answer[1:]]

    def batch(self, stage: int, step: int) -> Batch:
        if stage == 0 and step < self.copy_warmup_steps:
            return self._copy_warmup_batch(step)
        rng = random.Random(f"{self.seed}/{stage}/{step}")
        rows, weights, positions = [], [], []
        for _ in range(self.batch_size):
            if rng.random() < self.synth_frac:
                ids, w = self._task_row(rng, self.seq_len)
            else:
                ids, w = self._code_row(rng, self.seq_len)
            rows.append(ids)
            weights.append(w)
            positions.append(pose_positions(self.seq_len, self.pose_max_position, rng, self.pose_plain_frac))
        positions = torch.stack(positions)
        ids = torch.tensor(rows, dtype=torch.long)
        far = self._far(ids, positions, stage, step) if STAGES[stage] == "far" and self.far_count else None
        return Batch(ids, positions, torch.tensor(weights, dtype=torch.float32), far)

    def _far(self, ids: torch.Tensor, positions: torch.Tensor, stage: int, step: int) -> dict[int, FarNegatives]:
        """Each far layer's negatives, from generators of their own (the rows are as without them):
        far copies for layer 0, haystack negatives after it, whose haystack leaves out digit strings
        (the retrieval documents' keys: another row's key is not a distractor to learn away)."""
        far = {}
        haystack = ~torch.isin(ids[:, :-1], self._digit_ids) if any(self.far_layers) else None   # later layers only
        for layer in self.far_layers:
            seed = f"{self.seed}/{stage}/{step}/far" + (str(layer) if layer else "")
            if layer == 0:
                far[0] = far_copies(self.batch_size, self.seq_len, positions[:, 0], self.far_count,
                                    self.far_min_distance, self.pose_max_position, seed)
            else:
                far[layer] = haystack_negatives(positions, self.far_count, self.pose_max_position, haystack, seed)
        return far

    def _copy_warmup_batch(self, step: int) -> Batch:
        rng = random.Random(f"{self.seed}/copy-warmup/{step}")
        s = self.copy_warmup_seq_len
        rows, weights = zip(*(self._repeat_row(rng, s) if rng.random() < self.copy_warmup_repeat_frac
                              else self._task_row(rng, s) for _ in range(self.batch_size)))
        return Batch(torch.tensor(rows, dtype=torch.long), torch.arange(s).expand(self.batch_size, s).clone(),
                     torch.tensor(weights, dtype=torch.float32))

    def _repeat_row(self, rng: random.Random, seq_len: int) -> tuple[list[int], list[float]]:
        """Segments x x of 5-16 random number tokens (digits, or digit groups, see tokenizer.py), back
        to back; only the predictable targets (the second copy after its first token) carry weight."""
        ids, weights = [], []
        while len(ids) < seq_len + 1:
            n = rng.randint(5, 16)
            seg = [rng.choice(self.number_tokens) for _ in range(n)]
            ids += seg + seg
            weights += [0.0] * n + [1.0] * (n - 1) + [0.0]   # weights[i] belongs to target ids[i + 1]
        return ids[:seq_len + 1], weights[:seq_len]


def number_tokens(tok) -> list[int]:
    """Ids of every token that is a whole digit string ('0'..'9', then '00'..'99', ... up to the
    tokenizer's digit group), in that order."""
    from .tokenizer import digit_group_of
    return [tok.token_to_id("".join(c)) for n in range(1, digit_group_of(tok) + 1)
            for c in itertools.product("0123456789", repeat=n)]


def heldout_rows(heldout_ids: torch.Tensor, seq_len: int, num_rows: int) -> torch.Tensor:
    """Fixed, evenly spaced held-out windows [num_rows, seq_len + 1] (contiguous positions)."""
    n = seq_len + 1
    stride = max((len(heldout_ids) - n) // max(num_rows, 1), 1)
    starts = [i * stride for i in range(num_rows) if i * stride + n <= len(heldout_ids)]
    return torch.stack([heldout_ids[s:s + n].long() for s in starts])


def retrieval_probe(tok, heldout_ids: torch.Tensor, length: int, per_task: int = 4, seed: int = 1234):
    """Fixed held-out retrieval prompts with their answers: (ids [N, length], answer mask over the
    targets [N, length - 1]). One prompt per task and depth in linspace(0, 1, per_task); the code
    haystacks are held-out code. For a teacher-forced answer accuracy during training."""
    from .tasks import TASKS
    builder = TaskBuilder(tok, heldout_ids.tolist(), seed)
    rows, masks = [], []
    for task in TASKS:
        for i in range(per_task):
            s = builder.make(task, length, i / max(per_task - 1, 1), with_answer=True)
            rows.append(s.prompt)
            n = len(s.answer_ids)
            masks.append([False] * (length - 1 - n) + [True] * n)
    return torch.tensor(rows, dtype=torch.long), torch.tensor(masks, dtype=torch.bool)
