"""How a caught exception reads inside another message: a bottom-layer module, no sparsekv imports
(tests/test_imports.py), so every layer that quotes an error words it the same way."""
from __future__ import annotations


def first_line(e: BaseException) -> str:
    """The first line of `e`'s message, or its type's name when the message is empty. torch.distributed's
    and the stores' errors carry a C++ stack trace after the reason, which would bury a message quoting it."""
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__
