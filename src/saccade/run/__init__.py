"""A run's parts, built once from its config: the model, the engine and the image cache
(`setup`), and the task (`tasks`: prompts, rewards, environments)."""
