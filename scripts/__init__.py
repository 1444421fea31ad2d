"""Set-up: the README's two commands, the pinned environment and the models."""
