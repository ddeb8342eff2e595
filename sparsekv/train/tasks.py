"""RULER-style long-range retrieval documents, built in token space with the model's own tokenizer.

Shared by training (documents with their answers appended) and `sparsekv eval needle` (prompts
that end where the answer starts). Every prompt has exactly the requested number of tokens, and
the needle sits at the requested depth: depth d puts it after round(d * haystack_tokens) tokens
of haystack (snapped back to the start of a line when the haystack is code).

Tasks (answers are digit strings, one token per digit or per group of up to 3, see tokenizer.py):
  passkey   one pass key in a repeated-filler haystack (RULER "passkey")
  multikey  several named keys in code; one is asked for (RULER "niah multikey")
  niah      one "special magic number" line hidden in held-out stdlib code (RULER "niah single")
  vartrack  a chain VAR C = B, VAR B = A, VAR A = value; the answer traces C = B = A = value,
            one lookup per generated step (RULER's variable tracking, asked for one chain's value)
"""
from __future__ import annotations

import random
import re
from dataclasses import dataclass, field

TASKS = ("passkey", "multikey", "niah", "vartrack")
FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again.\n"
NAMES = ("apple", "river", "stone", "cloud", "tiger", "maple", "ocean", "pepper", "silver", "garden", "window",
         "rocket", "forest", "candle", "violet", "hammer", "island", "mirror", "orange", "planet", "castle",
         "dragon", "falcon", "harbor", "jacket", "ladder", "meadow", "needle", "pillow", "saddle", "tunnel",
         "walnut", "yellow", "bridge", "copper", "desert", "engine", "feather", "glacier", "helmet", "lemon",
         "marble", "nickel", "oyster", "parrot", "quartz", "rabbit", "spider", "turtle", "velvet", "wizard",
         "anchor", "basket", "cactus", "dolphin", "eagle", "fossil", "guitar", "hornet", "iris", "jungle",
         "kettle", "lantern", "magnet", "nectar", "olive", "puzzle", "radar", "salmon", "tomato", "umbrella")


def new_caches(tok) -> tuple[dict, set]:
    """(text -> ids cache, newline-ending token ids); pass to many builders of one tokenizer."""
    return {}, {i for t, i in tok.get_vocab().items() if t.endswith("Ċ")}


@dataclass
class Sample:
    """One prompt. `needle_starts` are token indices where the needle lines begin."""

    task: str
    prompt: list[int]
    answer: str
    depth: float
    needle_starts: list[int] = field(default_factory=list)
    answer_ids: list[int] = field(default_factory=list)


def first_number(text: str) -> str | None:
    m = re.search(r"\d+", text)
    return m.group(0) if m else None


def score(answer: str, output_text: str) -> bool:
    """Correct when the first run of digits in the generated text is exactly the answer."""
    return first_number(output_text) == answer


class TaskBuilder:
    """`tok`: a `tokenizers.Tokenizer`; `code`: a token stream of stdlib code for haystacks."""

    def __init__(self, tok, code: list[int] | None, seed: int = 0, caches: tuple[dict, set] | None = None):
        self.tok, self.code = tok, code
        self.rng = random.Random(seed)
        self._cache, self._newline = caches if caches is not None else new_caches(tok)

    def encode(self, text: str) -> list[int]:
        if text not in self._cache:
            self._cache[text] = self.tok.encode(text, add_special_tokens=False).ids
        return self._cache[text]

    # -- haystacks -----------------------------------------------------------------------------
    def haystack(self, kind: str, n: int, end_on_line: bool = False) -> list[int]:
        """n tokens of haystack. With `end_on_line` the haystack ends with a whole line (filler: cut
        at the start instead of the end; code: the window moved back to a line end), so the text
        before the question never ends in a word cut in two, as in RULER's haystacks."""
        if kind == "filler" or not self.code:
            unit = self.encode(FILLER)
            out = unit * (n // len(unit) + 1)
            return out[len(out) - n:] if end_on_line else out[:n]
        if n >= len(self.code):
            out = self.code * (n // len(self.code) + 1)
            return out[:n]
        start = self.rng.randrange(0, len(self.code) - n)
        end = self._line_start(self.code, start + n, max_back=start) if end_on_line else start + n
        return self.code[end - n:end]

    def _line_start(self, hay: list[int], i: int, max_back: int = 256) -> int:
        """Move i back to just after a token ending in a newline (at most max_back tokens back; else keep i)."""
        for j in range(i, max(i - max_back, 0) - 1, -1):
            if j == 0 or hay[j - 1] in self._newline:
                return j
        return i

    def compose(self, kind: str, needles: list[tuple[float, list[int]]], tail: list[int], length: int,
                end_on_line: bool = False):
        """Haystack with needles inserted at depths, then the tail; exactly `length` tokens."""
        n_hay = length - sum(len(ids) for _, ids in needles) - len(tail)
        if n_hay < 0:
            raise ValueError(f"length {length} is too short for the needles and the question")
        hay = self.haystack(kind, n_hay, end_on_line)
        cuts = [self._line_start(hay, min(round(d * n_hay), n_hay)) for d, _ in needles]
        order = sorted(range(len(needles)), key=lambda k: (cuts[k], k))
        out, starts, prev = [], [0] * len(needles), 0
        for k in order:
            out += hay[prev:cuts[k]]
            starts[k] = len(out)
            out += needles[k][1]
            prev = cuts[k]
        out += hay[prev:] + tail
        return out, starts

    # -- training documents: several needles and questions, answers included -------------------
    def make_document(self, length: int) -> tuple[list[int], list[bool]]:
        """(ids, is_answer) of exactly `length` tokens. Key-value tasks carry up to 8 needles and
        ask for several of them, so one document gives many retrieval targets."""
        task = self.rng.choice(TASKS)
        if task == "vartrack":
            kind, needles, question, _, answer = self._vartrack(self.rng.random())
            qa = [(question, answer)]
        elif task == "passkey":
            kind, needles, question, _, answer = self._passkey(self.rng.random())
            qa = [(question, answer)] * self.rng.randint(1, 2)
        else:
            # at most 8 keys; fewer in short rows (from 512 tokens on: 2-8, as before)
            kind, needles, qa = self._key_values(task, self.rng.randint(2, min(8, max(2, length // 64))))
        tail, is_answer = [], []
        for question, answer in qa:
            q, a = self.encode(question), self.encode(answer)
            tail += q + a
            is_answer += [False] * len(q) + [True] * len(a)
        ids, _ = self.compose(kind, needles, tail, length)
        return ids, [False] * (length - len(tail)) + is_answer

    def _key_values(self, task: str, n: int):
        names = self.names(n)
        keys = [self.key() for _ in names]
        if task == "multikey":
            line, ask = "# The pass key for {n} is {k}.\n", "\n# What is the pass key for {n}? The pass key for {n} is"
        else:
            line = "# One of the special magic numbers for {n} is: {k}.\n"
            ask = "\n# What is the special magic number for {n}? The special magic number for {n} is:"
        needles = [(self.rng.random(), self.encode(line.format(n=n_, k=k))) for n_, k in zip(names, keys)]
        asked = self.rng.sample(range(n), self.rng.randint(1, n))
        return "code", needles, [(ask.format(n=names[i]), f" {keys[i]}.\n") for i in asked]

    # -- the four tasks ------------------------------------------------------------------------
    def key(self, digits: int = 5) -> str:
        return str(self.rng.randrange(10 ** (digits - 1), 10 ** digits))

    def names(self, n: int) -> list[str]:
        return self.rng.sample(NAMES, n)

    def make(self, task: str, length: int, depth: float, with_answer: bool = False) -> Sample:
        parts = getattr(self, f"_{task}")(depth)
        kind, needles, question, answer, continuation = parts
        tail = self.encode(question)
        answer_ids = self.encode(continuation) if with_answer else []
        # NOTE: training documents (make_document) keep the old cut, so the bundled model's batches
        # are unchanged; prompts end their haystack on a whole line (a word cut in two
        # before the question made models continue the filler at 8K and 16K, docs/training.md).
        ids, starts = self.compose(kind, needles, tail + answer_ids, length, end_on_line=True)
        return Sample(task, ids, answer, depth, starts, answer_ids)

    def _other_depths(self, n: int) -> list[float]:
        return [self.rng.random() for _ in range(n)]

    def _passkey(self, depth):
        key = self.key()
        needle = self.encode(f"The pass key is {key}. Remember it. {key} is the pass key.\n")
        return ("filler", [(depth, needle)], "\nWhat is the pass key? The pass key is", key, f" {key}.\n")

    def _multikey(self, depth):
        names = self.names(4)
        keys = [self.key() for _ in names]
        needles = [(d, self.encode(f"# The pass key for {n} is {k}.\n"))
                   for d, n, k in zip([depth] + self._other_depths(3), names, keys)]
        return ("code", needles, f"\n# What is the pass key for {names[0]}? The pass key for {names[0]} is",
                keys[0], f" {keys[0]}.\n")

    def _niah(self, depth):
        name, key = self.names(1)[0], self.key()
        needle = self.encode(f"# One of the special magic numbers for {name} is: {key}.\n")
        return ("code", [(depth, needle)],
                f"\n# What is the special magic number for {name}? The special magic number for {name} is:",
                key, f" {key}.\n")

    def _vartrack(self, depth):
        a, b, c, x, y = self.names(5)
        key, other = self.key(), self.key()
        lines = [f"# VAR {a} = {key}\n", f"# VAR {b} = {a}\n", f"# VAR {c} = {b}\n",
                 f"# VAR {x} = {other}\n", f"# VAR {y} = {x}\n"]
        later = sorted(depth + (1 - depth) * self.rng.random() for _ in range(2))  # the chain reads forward
        needles = [(depth, self.encode(lines[0])), (later[0], self.encode(lines[1])), (later[1], self.encode(lines[2])),
                   (self.rng.random(), self.encode(lines[3])), (self.rng.random(), self.encode(lines[4]))]
        return ("code", needles, f"\n# Trace {c}: {c} =", key, f" {b} = {a} = {key}\n")
