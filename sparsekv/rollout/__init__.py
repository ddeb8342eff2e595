"""Agentic RL rollouts against any OpenAI-compatible policy, with reward-hack interception.

task.py     a task: a small repository, an instruction, a check command (YAML spec)
sandbox.py  the per-episode copy of the repository and the four tools, run under limits without network
rules.py    the recall filter: rules as data (rules.yaml, extensible), each with an id
judge.py    the precision stage: an OpenAI-compatible judge answering a JSON-schema verdict
intercept.py  rules -> judge -> a virtual tool result for a confirmed hack
episode.py  the agent loop: policy turns, tools, compaction, reward; one trajectory per episode
cli.py      `sparsekv rollout` and `sparsekv rl screen | eval-filter`; report.py: progress, summary, figures
"""
