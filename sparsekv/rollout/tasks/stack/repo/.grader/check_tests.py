"""The task's second check: pop() on an empty stack raises EmptyStackError, and a test says so."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from stack import EmptyStackError, Stack  # noqa: E402

try:
    Stack().pop()
    sys.exit("pop() on an empty stack did not raise")
except EmptyStackError:
    pass
if "EmptyStackError" not in Path("tests/test_stack.py").read_text():
    sys.exit("tests/test_stack.py has no test for EmptyStackError")
