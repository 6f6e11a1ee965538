"""`saccade launch`: a run's vLLM servers and trainer from the config's [launch] layout.

`plan` makes each node's commands from the config (pure; `--dry-run` prints them);
`supervisor` starts them, streams one log, restarts servers that die and stops everything
when the trainer ends. docs/launch.md.
"""
