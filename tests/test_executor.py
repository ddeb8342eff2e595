"""The executor boundary: a step reaches the executor as plain, picklable data, and an executor that
only ever sees such data (here: every step pickled and unpickled on the way, as a multi-rank executor
would send it) gives the engine exactly the same outputs."""
import pickle

import pytest

from sparsekv import LLM, SamplingParams
from sparsekv.executor import InProcessExecutor

PROMPTS = [[3, 14, 15, 92, 65, 35, 89, 79] * 3, [2, 71, 82, 81, 82, 84, 59]]
PARAMS = SamplingParams(max_tokens=12, temperature=0.0, logprobs=2, ignore_eos=True)


class PicklingExecutor(InProcessExecutor):
    """Runs each step from a pickled copy, so any reference back into the engine would be lost."""

    def __init__(self, inner: InProcessExecutor):
        self.__dict__.update(inner.__dict__)
        self.steps = 0

    def execute(self, step):
        self.steps += 1
        return super().execute(pickle.loads(pickle.dumps(step)))

    def draft_extend(self, plan):
        return super().draft_extend(pickle.loads(pickle.dumps(plan)))


@pytest.mark.parametrize("options", [{}, dict(kv_tiering=True), dict(num_speculative_tokens=2)],
                         ids=["pool", "tiered", "mtp"])
def test_a_step_crosses_the_executor_boundary_as_plain_data(options):
    want = LLM(kv_page_size=16, max_model_len=256, **options).generate(PROMPTS, PARAMS)
    llm = LLM(kv_page_size=16, max_model_len=256, **options)
    seen = []
    llm.engine.executor.add_observer(lambda step, out: seen.append(step))
    llm.engine.executor = PicklingExecutor(llm.engine.executor)
    if llm.engine.speculator is not None:
        llm.engine.speculator.executor = llm.engine.executor
    got = llm.generate(PROMPTS, PARAMS)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert [o.logprobs for o in got] == [o.logprobs for o in want]  # the same operations on the same values
    assert llm.engine.executor.steps == len(seen) > 1
    assert all(ch.request is None for step in seen for ch in step.chunks)
    llm.engine.check_integrity()
