"""The training loops (`rl.train_rl`, and later SFT's) and the parts only they use: the RL step's
two halves (`rl_step`), and the parts of a run that each decide their own "when" (a checkpointer,
a stall watch, a weight sync, an evaluator, the step's log). docs/architecture.md draws them."""
