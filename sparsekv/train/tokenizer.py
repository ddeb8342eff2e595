r"""A byte-level BPE tokenizer trained with `tokenizers`, saved so transformers' AutoTokenizer loads it.

Numbers are cut into groups of `digit_group` digits from the left, each group one token, whatever
the corpus: 1 (every digit its own token, the shipped model), 2, or 3 as the DeepSeek-V3 and GLM
tokenizers cut them (`\p{N}{1,3}`): `60494` is `604` `94`. A number's token count then never
depends on the merges learned from the corpus, and with groups of 3 a 5-digit pass key is two tokens
that rarely repeat, where digit by digit it often repeats a digit (docs/training.md, "Digit groups").
"""
from __future__ import annotations

import json
import os
from itertools import product

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

EOS = "<|endoftext|>"
ROLE_TOKENS = ["<|system|>", "<|user|>", "<|assistant|>"]
SPECIAL_TOKENS = [EOS, *ROLE_TOKENS]

CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def train_tokenizer(texts, vocab_size: int, digit_group: int = 1) -> Tokenizer:
    """BPE over bytes. `texts` is any iterable of strings (the training split only). `vocab_size`
    is the BPE vocabulary learned from `texts` (digits one per token); `digit_group` > 1 adds every
    digit string of 2..digit_group digits on top (100 tokens for 2, 1100 for 3)."""
    if digit_group not in (1, 2, 3):
        raise ValueError(f"digit_group must be 1, 2 or 3, got {digit_group}")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = _pre_tokenizer(1)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer=trainer)
    return tok if digit_group == 1 else _with_digit_groups(tok, digit_group)


def _pre_tokenizer(digit_group: int):
    digits = (pre_tokenizers.Digits(individual_digits=True) if digit_group == 1
              else pre_tokenizers.Split(Regex(f"[0-9]{{1,{digit_group}}}"), behavior="isolated"))
    return pre_tokenizers.Sequence([digits, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])


def _with_digit_groups(tok: Tokenizer, digit_group: int) -> Tokenizer:
    """Append a token per digit string of 2..digit_group digits, with a merge for every way of
    splitting it in two (last in merge order: a pre-token of digits holds nothing else, so no corpus
    merge competes, and whichever pair merges first, the group ends as one token)."""
    spec = json.loads(tok.to_str())
    vocab, merges = spec["model"]["vocab"], spec["model"]["merges"]
    next_id = max(max(vocab.values()), *(t["id"] for t in spec["added_tokens"])) + 1
    for n in range(2, digit_group + 1):
        for chars in product("0123456789", repeat=n):
            group = "".join(chars)
            if group not in vocab:
                vocab[group] = next_id
                next_id += 1
            merges += [[group[:i], group[i:]] for i in range(1, n)]   # any order of merging ends here
    grouped = Tokenizer.from_str(json.dumps(spec))
    grouped.pre_tokenizer = _pre_tokenizer(digit_group)
    return grouped


def digit_group_of(tok: Tokenizer) -> int:
    """The digit group a tokenizer was built with: tokens per number, see the module docstring."""
    return max(len(t) for t in tok.get_vocab() if t.isascii() and t.isdigit())


def save_tokenizer(tok: Tokenizer, out_dir: str) -> None:
    os.makedirs(out_dir, exist_ok=True)
    tok.save(os.path.join(out_dir, "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": EOS,
        "pad_token": EOS,
        "additional_special_tokens": ROLE_TOKENS,
        "model_max_length": 1 << 21,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
        json.dump(config, f, indent=2)


def load_tokenizer(path: str) -> Tokenizer:
    return Tokenizer.from_file(os.path.join(path, "tokenizer.json") if os.path.isdir(path) else path)
